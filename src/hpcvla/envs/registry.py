"""The simulators by name, and how the configured one is built (`make_env`, `env_kwargs`,
`probe_spec`; `env_spec` is in envs/__init__.py). A module of its own so that isolated.py
imports `make_env` without an import cycle through envs/__init__."""

import copy

from hpcvla.config.families import SIMULATORS
from hpcvla.envs.base import EnvSpec, VectorEnv
from hpcvla.envs.libero import LiberoEnv
from hpcvla.envs.maniskill import ManiSkillEnv
from hpcvla.envs.maniskill_gpu import ManiSkillGPUEnv
from hpcvla.envs.reach import ReachEnv

ENVS: dict[str, type[VectorEnv]] = {"reach": ReachEnv, "maniskill": ManiSkillEnv,
                                    "libero": LiberoEnv}
# env.sim_backend=gpu: the GPU-batched variant of a simulator (same spec, one env per shard)
GPU_ENVS: dict[str, type[VectorEnv]] = {"maniskill": ManiSkillGPUEnv}
# env name -> (module to import, package that provides it); reach needs nothing extra
SIMULATOR_PACKAGES = {name: traits.package for name, traits in SIMULATORS.items()
                      if traits.package}


def make_env(name: str, num_envs: int, seed: int, sim_backend: str = "cpu",
             keep_final_obs: bool = False, **kwargs) -> VectorEnv:
    """Build the env registered as `name` (its GPU_ENVS variant with sim_backend="gpu"),
    keeping the horizon-ended episodes' last observations if asked (VectorEnv.keep_final_obs);
    kwargs go to its constructor."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; valid names: {sorted(ENVS)}")
    if sim_backend == "gpu" and name not in GPU_ENVS:
        raise ValueError(f"env {name!r} has no GPU simulation (env.sim_backend=gpu is for "
                         f"{', '.join(GPU_ENVS)}); set env.sim_backend=cpu")
    cls = GPU_ENVS[name] if sim_backend == "gpu" else ENVS[name]
    env = cls(num_envs, seed=seed, **kwargs)
    env.keep_final_obs = keep_final_obs
    return env


def env_class(env_cfg) -> type[VectorEnv]:
    """The class the configured env is built from (its GPU_ENVS variant with
    env.sim_backend=gpu)."""
    gpu = env_cfg.sim_backend == "gpu" and env_cfg.name in GPU_ENVS
    return GPU_ENVS[env_cfg.name] if gpu else ENVS[env_cfg.name]


def env_kwargs(env_cfg) -> dict:
    """Constructor arguments of the configured env (the `env` config section)."""
    return dict(image_size=env_cfg.image_size, chunk_len=env_cfg.chunk_len,
                max_episode_chunks=env_cfg.max_episode_chunks, state=env_cfg.state,
                **ENVS[env_cfg.name].config_kwargs(env_cfg))


def probe_spec(env_cfg) -> EnvSpec:
    """The EnvSpec of the configured env, building as little of a simulator as it can, here.
    A GPU_ENVS variant has its CPU env's spec, so the probe needs no GPU wherever it runs
    (envs.env_spec runs it in a worker process where this one will simulate on the GPU).
    A built probe's spec is kept for the process (a ManiSkill env takes seconds to build:
    `hpcvla plan` of several layouts, or of several recipes, asks again); each caller gets
    its own copy."""
    cls, kwargs = ENVS[env_cfg.name], env_kwargs(env_cfg)
    kwargs.pop("sim_backend", None)
    if cls.spec_of is not None:
        return cls.spec_of(**kwargs)
    key = (env_cfg.name, repr(sorted(kwargs.items())))
    if key not in _PROBED:
        probe = cls(1, seed=0, **kwargs)
        probe.close()
        _PROBED[key] = probe.spec
    return copy.deepcopy(_PROBED[key])


_PROBED: dict[tuple[str, str], EnvSpec] = {}  # probe_spec's, by env and constructor arguments
