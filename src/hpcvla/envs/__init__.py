"""Vectorized environments: the `VectorEnv` interface and a registry of simulators."""

from importlib.util import find_spec

from hpcvla.envs.base import EnvSpec, StepResult, VectorEnv, obs_dtype
from hpcvla.envs.libero import LiberoEnv
from hpcvla.envs.maniskill import ManiSkillEnv
from hpcvla.envs.maniskill_gpu import ManiSkillGPUEnv
from hpcvla.envs.reach import ReachEnv, oracle_actions
from hpcvla.envs.registry import (ENVS, GPU_ENVS, SIMULATOR_PACKAGES, env_kwargs, env_spec,
                                  make_env)

__all__ = ["ENVS", "GPU_ENVS", "EnvSpec", "LiberoEnv", "ManiSkillEnv", "ManiSkillGPUEnv",
           "ReachEnv", "StepResult", "VectorEnv", "check_env", "env_kwargs", "env_spec",
           "env_uses_gpu", "make_env", "obs_dtype", "oracle_actions"]


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
        from hpcvla.envs.maniskill_gpu import physx_gpu_library  # CUDA is checked on the nodes
        library = physx_gpu_library()
        if not library.is_file():
            problems.append(("env.sim_backend", env.sim_backend, "cpu, or SAPIEN's PhysX GPU "
                             f"library at {library} (SAPIEN downloads it on first use, which "
                             "fails without internet); fetch it once where there is internet: "
                             "python -c 'import sapien.physx as p; p.enable_gpu()'"))
    if env.name == "libero":
        tasks = 90 if env.suite == "libero_90" else 10
        if env.suite_task >= tasks:
            problems.append(("env.suite_task", env.suite_task,
                             f"-1 (all tasks) or a task index below {tasks} for {env.suite}"))
        if env.reward != "sparse":
            problems.append(("env.reward", env.reward, "sparse (LIBERO has no dense reward)"))
    if problems:
        raise ConfigError(problems, "env configuration")
