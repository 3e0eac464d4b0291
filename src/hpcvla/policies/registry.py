"""The policy families by name: `POLICIES`, `make_policy`, the constructor arguments a config
gives (`policy_kwargs`), and what needs the name of a family (rebuilding a saved folder,
counting a preset's parameters). Above the families: they never import it."""

from __future__ import annotations

from pathlib import Path

import torch

from hpcvla.config.families import family
from hpcvla.policies.base import Policy
from hpcvla.policies.default import DefaultPolicy
from hpcvla.policies.flow import FlowPolicy
from hpcvla.policies.folders import config_json, load_weights
from hpcvla.policies.oft import OFTPolicy
from hpcvla.policies.tokens import ActionTokenPolicy

# name -> class; every class takes (obs_spec, action_dim, chunk_len, vocab_size, **kwargs).
POLICIES: dict[str, type[Policy]] = {
    "default": DefaultPolicy,
    "flow": FlowPolicy,
    "tokens": ActionTokenPolicy,
    "oft": OFTPolicy,
}


def make_policy(name: str, obs_spec: dict, action_dim: int, chunk_len: int, vocab_size: int,
                **kwargs) -> Policy:
    """Build the policy registered under `name`; extra kwargs go to its constructor."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid names: {sorted(POLICIES)}") from None
    return cls(obs_spec, action_dim, chunk_len, vocab_size, **kwargs)


def policy_kwargs(name: str, policy_config) -> dict:
    """The constructor arguments of policy `name` taken from a PolicyConfig section: the
    fields its family's row reads (config/families.py FamilyTraits.settings)."""
    return {field: getattr(policy_config, field) for field in family(name).settings}


def load_pretrained(folder, **overrides):
    """Rebuild the policy `config.json` describes and load its weights into it.
    `overrides` replace constructor arguments (e.g. logprob_granularity, train_expert_only)."""
    folder = Path(folder)
    config = config_json(folder)
    if not config:
        raise ValueError(f"{folder}: no config.json (a folder save_pretrained wrote has one)")
    name = config.get("hpcvla_policy")
    if name not in POLICIES:
        raise ValueError(f"{folder / 'config.json'}: hpcvla_policy {name!r} is not one of "
                         f"{sorted(POLICIES)}")
    obs_spec = {k: (tuple(s), dt) for k, (s, dt) in config["obs_spec"].items()}
    policy = POLICIES[name](obs_spec, config["action_dim"], config["chunk_len"],
                            config["vocab_size"], **{**config["kwargs"], **overrides})
    load_weights(policy, folder)
    return policy


def count_preset_parameters(name: str, size: str, obs_spec: dict, action_dim: int,
                            chunk_len: int, vocab_size: int) -> int:
    """Parameters of a preset, counted on the meta device (no memory is allocated)."""
    with torch.device("meta"):
        policy = POLICIES[name](obs_spec, action_dim, chunk_len, vocab_size, size=size,
                                dtype="float32")
    return sum(p.numel() for p in policy.parameters())


__all__ = ["POLICIES", "count_preset_parameters", "load_pretrained", "make_policy",
           "policy_kwargs"]
