"""Policies: the `Policy` interface, the default small policy, and a by-name factory."""

from __future__ import annotations

from hpcvla.policies.base import ActOutput, Policy
from hpcvla.policies.default import DefaultPolicy, count_parameters

# name -> class; every class takes (obs_spec, action_dim, chunk_len, vocab_size, **kwargs).
POLICIES: dict[str, type[Policy]] = {
    "default": DefaultPolicy,
}


def make_policy(name: str, obs_spec: dict, action_dim: int, chunk_len: int, vocab_size: int, **kwargs) -> Policy:
    """Build the policy registered under `name`; extra kwargs go to its constructor."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid names: {sorted(POLICIES)}") from None
    return cls(obs_spec, action_dim, chunk_len, vocab_size, **kwargs)


__all__ = ["ActOutput", "Policy", "DefaultPolicy", "POLICIES", "make_policy", "count_parameters"]
