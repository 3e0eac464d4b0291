"""The envs of one shard as the config asks for them, for training, evaluation, the scale
probe and the benches. No torch: a simulator rank builds its envs and nothing else."""

from __future__ import annotations

from hpcvla.config.families import simulator
from hpcvla.envs.groups import GroupedRestarts
from hpcvla.envs.isolated import IsolatedEnv
from hpcvla.envs.registry import env_kwargs, make_env


def make_envs(cfg, n: int, seed: int, latency_sleep: bool = True, first_env: int = 0,
              owner: str = "this rank"):
    """`n` envs as configured; `first_env` is the run-wide index of the first (simulators
    spread tasks and report failures by it); `owner` names the rank in failure reports."""
    kwargs = env_kwargs(cfg.env)
    kwargs["keep_final_obs"] = cfg.algorithm.values_truncations
    if simulator(cfg.env.name).emulated:
        kwargs["latency_sleep"] = latency_sleep
    else:
        kwargs["first_env"] = first_env
    if cfg.env.isolation == "process":  # a worker process per shard, restarted on faults
        env = IsolatedEnv(cfg.env.name, n, seed, kwargs, cfg.env.step_timeout_s,
                          cfg.env.max_restarts, first_env, owner, cfg.env.build_timeout_s,
                          cfg.env.restart_window_s)
    else:
        env = make_env(cfg.env.name, n, seed, **kwargs)
    if cfg.algorithm.traits.advantage == "group":  # episodes from one state compared
        env = GroupedRestarts(env, cfg.rollout.segment_len, cfg.algorithm.group_size, seed)
    return env


def env_failures(envs) -> list:
    """Every env fault so far, (env id, what happened), from inline slots (envs/serial.py)
    and isolated workers (envs/isolated.py)."""
    return [f for env in envs for f in env.failures]
