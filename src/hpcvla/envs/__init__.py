"""Vectorized environments: the `VectorEnv` interface and a registry of simulators."""

from hpcvla.envs.base import EnvSpec, StepResult, VectorEnv, obs_dtype
from hpcvla.envs.reach import ReachEnv, oracle_actions

ENVS: dict[str, type[VectorEnv]] = {"reach": ReachEnv}

__all__ = ["ENVS", "EnvSpec", "ReachEnv", "StepResult", "VectorEnv", "make_env", "obs_dtype",
           "oracle_actions"]


def make_env(name: str, num_envs: int, seed: int, **kwargs) -> VectorEnv:
    """Build the env registered as `name`; kwargs go to its constructor."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; valid names: {sorted(ENVS)}")
    return ENVS[name](num_envs, seed=seed, **kwargs)
