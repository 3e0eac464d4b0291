"""Vectorized environments: the `VectorEnv` interface and a registry of simulators."""

from importlib.util import find_spec

from hpcvla.envs.base import EnvSpec, StepResult, VectorEnv
from hpcvla.envs.libero import LiberoEnv
from hpcvla.envs.maniskill import ManiSkillEnv
from hpcvla.envs.maniskill_gpu import ManiSkillGPUEnv
from hpcvla.envs.reach import ReachEnv, oracle_actions
from hpcvla.envs.isolated import IsolatedEnv
from hpcvla.process.watchdog import deadline
from hpcvla.envs.registry import (ENVS, GPU_ENVS, SIMULATOR_PACKAGES, env_class, env_kwargs,
                                  make_env, probe_spec)

__all__ = ["ENVS", "GPU_ENVS", "EnvSpec", "LiberoEnv", "ManiSkillEnv", "ManiSkillGPUEnv",
           "ReachEnv", "StepResult", "VectorEnv", "check_env", "env_class", "env_kwargs",
           "env_problems", "env_spec", "env_uses_gpu", "make_env", "oracle_actions",
           "spec_needs_a_simulator"]


def env_spec(env_cfg) -> EnvSpec:
    """The EnvSpec of the configured env (registry.probe_spec). SAPIEN cannot simulate on the
    GPU in a process that made a CPU PhysX scene, and rank 0 probes and may then simulate: a
    GPU-simulated config's CPU probe is built in a worker process of its own. A probe's build
    that never returns (an EGL deadlock) ends the process past env.build_timeout_s, every
    stack printed: a world's other ranks wait for it (in a broadcast, or in MPI_Init where
    a rank's own checks build one first)."""
    if env_cfg.name not in GPU_ENVS or env_cfg.sim_backend != "gpu":
        with deadline(env_cfg.build_timeout_s):
            return probe_spec(env_cfg)
    kwargs = env_kwargs(env_cfg)
    kwargs.pop("sim_backend")
    probe = IsolatedEnv(env_cfg.name, 1, 0, kwargs, timeout_s=env_cfg.build_timeout_s,
                        max_restarts=0, owner="the spec probe")  # a build, and its close
    probe.close()
    return probe.spec


def spec_needs_a_simulator(env_cfg) -> bool:
    """Whether the configured env's spec is known only from a built env (ManiSkill's, the
    built-in reach's), not from its settings alone (LIBERO's: `spec_of`)."""
    return ENVS[env_cfg.name].spec_of is None


def env_uses_gpu(env_cfg) -> bool:
    """Whether the configured simulator renders or simulates on a GPU where there is one
    (the device map gives its ranks one, devices.py); each env class says
    (VectorEnv.uses_gpu)."""
    return ENVS[env_cfg.name].uses_gpu(env_cfg)


def env_problems(cfg) -> list[tuple[str, object, str]]:
    """What stops the configured simulator here, before any rank starts: its package missing,
    or a task, setting or evaluation protocol it cannot run (as config problems)."""
    env = cfg.env
    if env.name in SIMULATOR_PACKAGES:
        module, package = SIMULATOR_PACKAGES[env.name]
        if find_spec(module) is None:
            return [("env.name", env.name, f"a simulator installed here: package "
                     f"`{package}` is missing; run `make install` (README.md)")]
    return env_class(env).config_problems(env) + env_class(env).protocol_problems(env, cfg.eval)


def check_env(cfg) -> None:
    """env_problems as a ConfigError."""
    from hpcvla.config import ConfigError
    problems = env_problems(cfg)
    if problems:
        raise ConfigError(problems, "env configuration")
