"""Policies: the `Policy` interface, the default small policy, the VLA families (flow
matching, action tokens, the published OpenVLA-OFT), and a by-name factory."""

from __future__ import annotations

from hpcvla.policies.base import ActOutput, Policy
from hpcvla.policies.default import DefaultPolicy, count_parameters
from hpcvla.policies.flow import FlowPolicy
from hpcvla.policies.tokens import ActionTokenPolicy
from hpcvla.policies.oft import OFTPolicy
from hpcvla.policies.folders import load_pretrained, save_pretrained

# name -> class; every class takes (obs_spec, action_dim, chunk_len, vocab_size, **kwargs).
POLICIES: dict[str, type[Policy]] = {
    "default": DefaultPolicy,
    "flow": FlowPolicy,
    "tokens": ActionTokenPolicy,
    "oft": OFTPolicy,
}


def make_policy(name: str, obs_spec: dict, action_dim: int, chunk_len: int, vocab_size: int, **kwargs) -> Policy:
    """Build the policy registered under `name`; extra kwargs go to its constructor."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid names: {sorted(POLICIES)}") from None
    return cls(obs_spec, action_dim, chunk_len, vocab_size, **kwargs)


def policy_kwargs(name: str, policy_config) -> dict:
    """The constructor arguments of policy `name` taken from a PolicyConfig section (each
    class lists the fields it reads in `config_fields`)."""
    return {field: getattr(policy_config, field) for field in POLICIES[name].config_fields}


__all__ = ["ActOutput", "Policy", "DefaultPolicy", "FlowPolicy", "ActionTokenPolicy", "OFTPolicy",
           "POLICIES",
           "make_policy", "policy_kwargs", "count_parameters", "save_pretrained",
           "load_pretrained"]
