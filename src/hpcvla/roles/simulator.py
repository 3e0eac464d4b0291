"""Simulator rank: E envs in K shards; a shard steps and asks for actions on its own.

Each shard owns one slot of its cell's ObsActionExchange. The observation slot carries the
env observation plus the outcome of the previous action (segments.outcome_fields: reward,
terminated, truncated, env_fault, success, episode return, the env's episode metrics) and the
shard's env-step count;
where rollouts value truncations (algorithm.bootstrap_truncated), also `final.<name>`: the
observation each episode the horizon ended reached, before its auto-reset (rows of the other
envs are stale). The action slot carries the chunk and a stop flag.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from hpcvla.envs.base import check_observation, final_observations, horizon_cut
from hpcvla.envs.build import make_envs
from hpcvla.process.watchdog import StepGuard, build_deadline_s, deadline
from hpcvla.roles.segments import FINAL, outcome_fields, outcome_of
from hpcvla.seeds import shard_seed
from hpcvla.transport.backoff import DATA_POLL_CAP

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from hpcvla.config.schema import Config
    from hpcvla.envs.base import EnvSpec, StepResult, VectorEnv
    from hpcvla.metrics.timeline import Timeline
    from hpcvla.transport.exchange import ObsActionExchange


def slot_dtypes(spec: EnvSpec, envs_per_shard: int,
                final_obs: bool = False) -> tuple[np.dtype, np.dtype]:
    """(observation slot dtype, action slot dtype) of one shard; `final_obs`: with the
    horizon-ended episodes' last observations (the module docstring)."""
    n = envs_per_shard
    obs: list[tuple[str, DTypeLike] | tuple[str, DTypeLike, tuple[int, ...]]] = [
        (k, np.dtype(dt), (n, *shape)) for k, (shape, dt) in spec.obs.items()]
    if final_obs:
        obs += [(FINAL + k, np.dtype(dt), (n, *shape)) for k, (shape, dt) in spec.obs.items()]
    obs += [(k, np.dtype(dt), (n, *shape))
            for k, (shape, dt) in outcome_fields(spec.episode_metrics).items()]
    obs.append(("env_steps", np.int64))
    action = [("actions", np.float32, (n, spec.chunk_len, spec.action_dim)), ("stop", np.int64)]
    return np.dtype(obs), np.dtype(action)


def build_shards(cfg: Config, shards: int, rank: int,
                 first_built: Callable[[VectorEnv], object] | None = None,
                 start: int = 0) -> list[VectorEnv]:
    """Simulator rank `rank`'s envs in `shards` shards of equal size, each with its seed (of
    a world started at policy version `start`) and run-wide env ids; `first_built(env)` as
    soon as the first shard is (the rank that tells the others the env's spec sends it). An
    inline shard's build is guarded (env.build_timeout_s, process/watchdog.py): a simulator
    that deadlocks while it builds stops the job, not every rank waiting for it."""
    per_shard = cfg.env.envs_per_simulator // shards
    envs = []
    for shard in range(shards):
        with deadline(build_deadline_s(cfg.env)):
            envs.append(make_envs(cfg, per_shard, shard_seed(cfg, rank, shard, start),
                                  latency_sleep=False,
                                  first_env=rank * cfg.env.envs_per_simulator
                                  + shard * per_shard, owner=f"rank {rank} (simulator)"))
        if shard == 0 and first_built is not None:
            first_built(envs[0])
    return envs


def run_simulator(envs: list[VectorEnv], exchange: ObsActionExchange, timeline: Timeline,
                  step_timeout_s: float = 0.0) -> int:
    """Step the shards until the inference rank says stop; returns env steps taken
    (primitive steps: chunks x chunk_len x envs). Every shard whose actions are in is started
    before any is collected, so shards in worker processes (env.isolation=process) step
    concurrently. A shard's emulated latency (`env.last_latency_s`, when the env does not
    sleep itself) delays only that shard's observation: shards stay in flight together, as
    one-process-per-env simulators do."""
    steps = [0] * len(envs)
    chunk = envs[0].spec.chunk_len
    for shard, env in enumerate(envs):
        with deadline(step_timeout_s):
            first = env.reset()
        check_observation(env, first)
        _write(exchange.obs(shard), first, None, steps[shard], env.spec.episode_metrics)
        exchange.submit(shard)
    running = set(range(len(envs)))
    stepping: dict[int, tuple[float, float]] = {}  # shard -> (timeline start, start)
    held: dict[int, tuple[float, StepResult]] = {}  # shard -> (release, result)
    backoff = exchange.backoff()
    with StepGuard(step_timeout_s) as watchdog:  # a step that never returns ends the job
        while running:
            now = time.monotonic()
            for shard, (release, result) in list(held.items()):
                if now >= release:
                    del held[shard]
                    _write(exchange.obs(shard), result.obs, result, steps[shard],
                           envs[shard].spec.episode_metrics)
                    exchange.submit(shard)
            ready = [s for s in sorted(running - held.keys() - stepping.keys())
                     if exchange.actions_ready(s)]
            for shard in ready:
                answer = exchange.actions(shard)
                if answer["stop"]:
                    running.discard(shard)
                    continue
                stepping[shard] = (timeline.now(), time.monotonic())
                envs[shard].step_async(np.array(answer["actions"]))
            finished = [s for s in stepping if envs[s].step_ready()]
            for shard in finished:
                begin, started = stepping.pop(shard)
                with watchdog.guard():
                    result = envs[shard].step_wait()
                steps[shard] += envs[shard].num_envs * chunk
                latency = 0.0 if envs[shard].latency_sleep else envs[shard].last_latency_s
                # the emulated latency is the whole step (its compute runs inside); shards
                # overlap
                held[shard] = (started + latency, result)
                timeline.record("simulate", begin, max(timeline.now(), begin + latency))
            if ready or finished:
                backoff.reset()
            else:
                watchdog.idle()
                # the bell rings for actions, not for a worker's step or a held result's time
                now = time.monotonic()
                backoff.wait(at_most=DATA_POLL_CAP if stepping else min(
                    (release - now for release, _ in held.values()), default=None))
    return sum(steps)


def _write(slot: np.void, obs: Mapping[str, np.ndarray], result: StepResult | None,
           env_steps: int, metrics: Sequence[str] = ()) -> None:
    """Observation and the previous action's outcome, in place in the shared slot (with the
    horizon-ended episodes' last observations where the slot has room for them)."""
    for key, value in obs.items():
        slot[key][...] = value
    if result is None:
        for key in outcome_fields(metrics):
            slot[key][...] = 0
    else:
        for key, value in outcome_of(result, metrics).items():
            slot[key][...] = value
        if FINAL + next(iter(obs)) in (slot.dtype.names or ()) and \
                horizon_cut(result.truncated, result.env_fault).any():
            for key, value in final_observations(result).items():
                slot[FINAL + key][...] = value
    slot["env_steps"] = env_steps
