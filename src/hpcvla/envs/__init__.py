"""Vectorized environments: the `VectorEnv` interface and a registry of simulators."""

from importlib.util import find_spec

from hpcvla.envs.base import EnvSpec, StepResult, VectorEnv, obs_dtype
from hpcvla.envs.libero import LiberoEnv
from hpcvla.envs.maniskill import ManiSkillEnv
from hpcvla.envs.maniskill_gpu import ManiSkillGPUEnv
from hpcvla.envs.reach import ReachEnv, oracle_actions
from hpcvla.envs.isolated import IsolatedEnv
from hpcvla.envs.registry import (ENVS, GPU_ENVS, SIMULATOR_PACKAGES, env_kwargs, make_env,
                                  probe_spec)

__all__ = ["ENVS", "GPU_ENVS", "EnvSpec", "LiberoEnv", "ManiSkillEnv", "ManiSkillGPUEnv",
           "ReachEnv", "StepResult", "VectorEnv", "check_env", "env_kwargs", "env_spec",
           "env_uses_gpu", "make_env", "obs_dtype", "oracle_actions"]


def env_spec(env_cfg) -> EnvSpec:
    """The EnvSpec of the configured env (registry.probe_spec). SAPIEN cannot simulate on the
    GPU in a process that made a CPU PhysX scene, and rank 0 probes and may then simulate: a
    GPU-simulated config's CPU probe is built in a worker process of its own."""
    if env_cfg.name not in GPU_ENVS or env_cfg.sim_backend != "gpu":
        return probe_spec(env_cfg)
    kwargs = env_kwargs(env_cfg)
    kwargs.pop("sim_backend")
    probe = IsolatedEnv(env_cfg.name, 1, 0, kwargs, timeout_s=600, max_restarts=0,
                        owner="the spec probe")
    probe.close()
    return probe.spec


def env_uses_gpu(env_cfg) -> bool:
    """Whether the configured simulator renders or simulates on a GPU where there is one
    (the device map gives its ranks one, devices.py): ManiSkill renders with SAPIEN on the
    GPU (and simulates there with env.sim_backend=gpu); LIBERO's MuJoCo renders through EGL
    on a GPU unless MUJOCO_GL says otherwise (osmesa renders on the CPU); reach runs on CPU."""
    import os
    if env_cfg.name == "maniskill":
        return True
    if env_cfg.name == "libero":
        return os.environ.get("MUJOCO_GL", "egl") == "egl"
    return False


def check_env(cfg) -> None:
    """Raise a ConfigError, before any rank starts, if the configured simulator is not
    installed or cannot run the configured task here."""
    from hpcvla.config import ConfigError
    env = cfg.env
    problems = []
    if env.name in SIMULATOR_PACKAGES:
        module, package = SIMULATOR_PACKAGES[env.name]
        if find_spec(module) is None:
            problems.append(("env.name", env.name, f"a simulator installed here: package "
                             f"`{package}` is missing; run `make install` (README.md)"))
    if env.name == "maniskill":
        from hpcvla.envs.maniskill import CONTROL_MODES
        if env.control_mode not in CONTROL_MODES:
            problems.append(("env.control_mode", env.control_mode, f"one of "
                             f"{', '.join(CONTROL_MODES)} (ManiSkill's control modes whose "
                             "actions are normalized to [-1, 1]; the absolute ones take "
                             "joint angles and metres)"))
    if not problems and env.name == "maniskill":
        from hpcvla.envs.maniskill import NO_DOWNLOAD_TASKS, missing_assets
        try:
            missing = missing_assets(env.task)
        except ValueError:
            missing = None
        if missing is None or missing:
            problems.append(("env.task", env.task, "a ManiSkill3 task whose assets are here "
                             f"(no download needed: {', '.join(NO_DOWNLOAD_TASKS)})" +
                             (f"; or download {', '.join(missing)} first with `python -m "
                              f"mani_skill.utils.download_asset {env.task}`" if missing else "")))
    if not problems and env.name == "maniskill" and env.sim_backend == "gpu":
        from hpcvla.envs.maniskill_gpu import physx_gpu_missing  # CUDA is checked on the nodes
        missing = physx_gpu_missing()
        if missing:
            problems.append(("env.sim_backend", env.sim_backend, f"cpu, or {missing}"))
    if env.name == "libero":
        from hpcvla.envs.libero import SUITES
        if env.suite not in SUITES:
            problems.append(("env.suite", env.suite, f"one of {', '.join(SUITES)}"))
        tasks = 90 if env.suite == "libero_90" else 10
        if env.suite_task >= tasks:
            problems.append(("env.suite_task", env.suite_task,
                             f"-1 (all tasks) or a task index below {tasks} for {env.suite}"))
        if env.reward != "sparse":
            problems.append(("env.reward", env.reward, "sparse (LIBERO has no dense reward)"))
    if problems:
        raise ConfigError(problems, "env configuration")
