"""Learner rank: pull segment groups from the ring, train with the learners' engine (engines/:
DeepSpeed ZeRO or Horovod, `learner.backend`) on the learner communicator, publish every new
policy version.

Each policy version trains one batch: the segments its producers assigned to it (`quota`
from each; schedule.py explains why that bounds staleness), split into
`micro_batches` micro-batches of `micro_batch` segments. The streamer runs forward/backward on
a micro-batch as soon as it is there; the other modes wait for the whole batch first. Per
version:

    for each micro-batch, as it arrives:   advantages (once), forward/backward (epoch 0)
    epochs 1 ..:                           replay the micro-batches against epoch 0's log-probs
    critic epochs (PPO):                   value-only steps, the actor frozen
    (the run's first versions: the critic's warm-up, every pass value-only and the actor
    frozen, then the actor's learning rate rising: actor_lr_factor)
    publish the new version
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import torch

from hpcvla.algorithms.objective import Advantages, Proximal, advantages_of, policy_loss
from hpcvla.emulate import pad
from hpcvla.engines import critic_steps_only
from hpcvla.metrics.episode_metrics import FIELD as METRIC
from hpcvla.process.watchdog import reminding
from hpcvla.roles.setup import Counters, RoleSetup
from hpcvla.transport.segment_meta import SegmentMeta
from hpcvla.transport.backoff import DATA_POLL_CAP, Backoff

if TYPE_CHECKING:
    from hpcvla.config.learning import AlgorithmConfig
    from hpcvla.config.schema import Config
    from hpcvla.engines import SkipNonfinite
    from hpcvla.metrics.progress import Progress
    from hpcvla.metrics.timeline import Timeline
    from hpcvla.roles.queues import SegmentQueues
    from hpcvla.roles.segments import SegmentGroup
    from hpcvla.schedule import Schedule


@dataclass
class MicroBatch:
    """Segment groups stacked along the env axis, with what every epoch reuses: the
    advantages (computed when it arrives) and the proximal log-probs and values (epoch 0's)."""
    arrays: dict[str, np.ndarray]
    advantages: Advantages
    proximal: Proximal | None = None

    @classmethod
    def arrived(cls, cfg: Config, groups: list[SegmentGroup],
                device: torch.device) -> "MicroBatch":
        arrays = {k: np.concatenate([g[k] for g in groups], axis=1)
                  for k in groups[0] if k not in ("version", "meta", "bootstrap_value")}
        arrays["bootstrap_value"] = np.concatenate([g["bootstrap_value"] for g in groups])
        _say_nonfinite(groups)
        return cls(arrays, advantages_of(cfg.algorithm, arrays, device))


_SAID_NONFINITE: set[str] = set()  # the fields said so in this process (once each)


def _say_nonfinite(groups: list[SegmentGroup]) -> None:
    """Name, once per field, a recorded float field that holds a NaN or Inf outside a failed
    env's steps (a simulator's reward or observation, the inference rank's log-prob or value)
    and where it came from: the optimizer step it reaches is skipped (engines/nonfinite.py),
    which the metrics only count."""
    for group in groups:
        fault = group["env_fault"]  # a failed env's steps: masked out of the loss
        for name, values in group.items():  # (an episode metric reaches no loss: its NaN is
            # one not known, metrics/episode_metrics.py)
            if name in _SAID_NONFINITE or values.dtype.kind != "f" or name.startswith(METRIC):
                continue
            if np.isfinite(values[~fault] if values.shape[:2] == fault.shape else values).all():
                continue
            _SAID_NONFINITE.add(name)
            meta = SegmentMeta.of(group)
            print(f"[hpcvla] learner: the trajectories' `{name}` holds NaN or Inf (first in a "
                  f"segment of policy version {int(group['version'][0])} from rank "
                  f"{meta.producer}, env slot {meta.slot}): the optimizer steps it reaches are "
                  "skipped (learner.max_nonfinite_steps in a row stop the run); said once",
                  file=sys.stderr, flush=True)


# What trains one version from its micro-batches (lists of segment groups) as they arrive:
# `learn` below (PPO, GRPO) or the off-policy learner's (roles/off_policy.SoftUpdate.learn)
TrainVersion: TypeAlias = Callable[[Iterable[list["SegmentGroup"]], int], None]


def run_learner(setup: RoleSetup, *, sched: Schedule, train: TrainVersion,
                queues: SegmentQueues, publish: Callable[[int, bool], None],
                stop: Callable[[], bool]) -> Counters:
    """Train policy versions first+1 .. total_updates with `train(micro_batches, version)`,
    publishing each with `publish(version, last)`; end early, after a whole version, when
    `stop()` says so. `queues` is this learner's SegmentQueues (roles/queues.py)."""
    cfg, timeline, progress = setup.cfg, setup.timeline, setup.progress
    total_updates = setup.total_updates
    for version in range(setup.first_version, total_updates):
        def in_version(waited: float, at: int = version + 1) -> str:
            return (f"hpcvla: rank {setup.rank} (learner) has been in version {at} for "
                    f"{waited:.0f} s (its data, training, publishing, a checkpoint; with "
                    "several learners: waiting for the others, or stuck itself)")
        with reminding(cfg.pipeline.stall_timeout_s, in_version):
            train(_arriving(cfg, sched, queues, version, timeline), version)
            last = version + 1 == total_updates or stop()
            # the learners pool their figures where stop() has them meet anyway
            progress.on_update(version + 1, queues.gauges() if progress.board else None)
            with timeline.span("publish"):
                publish(version + 1, last)
        if last:
            break
    return queues.stats


def learn(cfg: Config, engine: SkipNonfinite, micro_batches: Iterable[list[SegmentGroup]],
          version: int, timeline: Timeline, progress: Progress,
          learners_sum: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
    """One policy version. Epoch 0 trains each micro-batch (a list of segment groups) as the
    iterable yields it, which is what lets the streamer start before the batch is complete;
    further `learner.epochs` replay them against the proximal log-probs of epoch 0.
    The engine applies an optimizer step after every `micro_batches` forward/backward passes.
    The episodes count when they arrive; the loss statistics logged are the last epoch's
    (in epoch 0 the policy is still the proximal one: clip fraction and KL are 0 there).
    The actor trains at its rate of this version (actor_lr_factor). `learners_sum`: a vector
    summed over the learners (collective; None for one), for algorithm.advantage_norm=batch,
    which takes the whole batch first."""
    seen, last = [], cfg.learner.epochs - 1
    factor = actor_lr_factor(cfg.algorithm, version)
    warmup = factor == 0.0  # the critic's warm-up: a policy loss would move nothing
    arriving: Iterator[tuple[list[SegmentGroup], MicroBatch]] = (
        (groups, MicroBatch.arrived(cfg, groups, engine.device)) for groups in micro_batches)
    if cfg.algorithm.advantage_norm == "batch":
        arriving = iter(batch_normalized(list(arriving), learners_sum))  # [dist]
    with actor_scaled(engine, factor):
        for groups, micro in arriving:
            stats = train_micro_batch(cfg, engine, micro, timeline, value_only=warmup)
            staleness = float(np.mean([version - g["version"][0] for g in groups]))
            progress.on_segments(_scored(cfg, micro.arrays), staleness)
            if last == 0:
                progress.on_micro_batch(_logged(stats, cfg.algorithm, factor, first_pass=True))
            seen.append(micro)
        for epoch in range(1, cfg.learner.epochs):
            for micro in seen:
                stats = train_micro_batch(cfg, engine, micro, timeline, value_only=warmup)
                if epoch == last:
                    progress.on_micro_batch(_logged(stats, cfg.algorithm, factor))
    if cfg.algorithm.traits.advantage == "gae" and cfg.algorithm.critic_epochs:
        with actor_scaled(engine, 0.0):  # value-only optimizer steps: the critic catches up
            for _ in range(cfg.algorithm.critic_epochs):
                for micro in seen:
                    train_micro_batch(cfg, engine, micro, timeline, value_only=True)


def batch_normalized(arrived: list[tuple[list[SegmentGroup], MicroBatch]],
                     learners_sum: Callable[[np.ndarray], np.ndarray] | None
                     ) -> list[tuple[list[SegmentGroup], MicroBatch]]:
    """The version's micro-batches with their GAE advantages zero-mean and unit-std over all
    of them, every learner's (`learners_sum`: collective), the steps of failed envs left out
    of the statistics (algorithm.advantage_norm=batch)."""
    moments = np.zeros(3)  # count, sum, sum of squares, in float64
    for _, micro in arrived:
        advantages = micro.advantages.advantages
        assert advantages is not None  # (PPO's)
        faults = torch.as_tensor(micro.arrays["env_fault"], device=advantages.device)
        kept = advantages[~faults].double()
        moments += [kept.numel(), float(kept.sum()), float((kept ** 2).sum())]
    n, total, squares = learners_sum(moments) if learners_sum else moments  # [dist]
    mean = float(total / max(n, 1.0))
    std = float(np.sqrt(max(squares - n * mean ** 2, 0.0) / max(n - 1, 1.0)))
    for _, micro in arrived:
        advantages = micro.advantages.advantages
        assert advantages is not None
        micro.advantages = micro.advantages._replace(advantages=(advantages - mean) / (std + 1e-8))
    return arrived


def _logged(stats: dict[str, float], alg: AlgorithmConfig, factor: float,
             first_pass: bool = False) -> dict[str, float]:
    """A micro-batch's statistics as metrics.jsonl records them, with the rate the actor
    trained at (`actor_lr`: the warm-ups' share of algorithm.lr). A first pass's ratios are
    1 (its policy is the proximal one): no clip fraction or KL to report."""
    if first_pass:
        stats = {k: v for k, v in stats.items() if k not in ("clip_fraction", "approx_kl")}
    return {**stats, "actor_lr": alg.lr * factor}


def train_micro_batch(cfg: Config, engine: SkipNonfinite, micro: MicroBatch, timeline: Timeline,
                      value_only: bool = False) -> dict[str, float]:
    """One forward/backward pass and engine step; the first records the proximal log-probs
    and values (objective.Proximal)."""
    with timeline.span("train"):
        begin = time.monotonic()
        loss, stats, proximal = policy_loss(cfg.algorithm, engine, micro.arrays,
                                            micro.advantages, micro.proximal, value_only)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if cfg.emulate.learner_ms_per_micro_batch:  # the emulated cost is the whole pass
            pad(begin, cfg.emulate.learner_ms_per_micro_batch / 1e3)
    micro.proximal = proximal  # (the first pass's, kept)
    return {**stats, **engine.step_stats(cfg.algorithm.max_grad_norm)} if boundary else stats


def actor_lr_factor(alg: AlgorithmConfig, version: int) -> float:
    """The share of `algorithm.lr` the actor trains version `version` at: 0 through the
    critic's warm-up (critic_warmup_versions), then rising linearly over lr_warmup_versions
    (the first trained version at 1/(n+1) of it), then all of it."""
    trained = version - alg.critic_warmup_versions
    if trained < 0:
        return 0.0
    ramp: int = alg.lr_warmup_versions
    return min(1.0, (trained + 1) / (ramp + 1))


@contextmanager
def actor_scaled(engine: SkipNonfinite, factor: float) -> Iterator[None]:
    """Every optimizer param group but the critic's (engines/base.param_groups names them) at
    `factor` times its learning rate; at 0, steps inside move the critic only and leave the
    actor's optimizer state as it was (engines.critic_steps_only)."""
    if factor == 0.0:
        with critic_steps_only(engine):
            yield
        return
    groups = engine.optimizer.param_groups
    saved = [g["lr"] for g in groups]
    for g in groups:
        if g.get("name") != "critic":
            g["lr"] *= factor
    try:
        yield
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr


def _scored(cfg: Config, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The episodes that count in the success metrics: under grouped advantages (GRPO) only
    each column's first (grouped) episode; later ones are cut short by the next restart
    (envs/groups.py)."""
    if cfg.algorithm.traits.advantage != "group":
        return batch
    return dict(batch, done=batch["done"] & (np.cumsum(batch["done"], axis=0) == 1))


def data_patience_s(cfg: Config) -> tuple[float, str]:
    """How long a learner waits for its next trajectory before it stops the job, and the
    settings that say so. Where simulators restart a hung worker (env.isolation=process),
    the hang is found only env.step_timeout_s after its step began, and a learner that shard
    feeds alone hears nothing meanwhile: pipeline.stall_timeout_s counts from there, time
    for the worker's rebuild and the segments the fault ended."""
    env = cfg.env
    if env.isolation == "process" and env.max_restarts > 0 and env.step_timeout_s:
        return cfg.pipeline.stall_timeout_s + env.step_timeout_s, (
            "pipeline.stall_timeout_s after env.step_timeout_s: a hung worker's restart")
    return cfg.pipeline.stall_timeout_s, "pipeline.stall_timeout_s"


def _arriving(cfg: Config, sched: Schedule, queues: SegmentQueues, version: int,
              timeline: Timeline) -> Iterator[list[SegmentGroup]]:
    """The micro-batches of this version's batch, each as soon as it is here (the streamer;
    the other modes wait for the whole batch before the first); a stall past
    data_patience_s stops the run with the ring's diagnosis."""
    micro, n_micro = cfg.learner.micro_batch, cfg.learner.micro_batches
    need = micro if sched.stream_micro_batches else micro * n_micro
    backoff, (patience_s, settings) = Backoff(cap=DATA_POLL_CAP), data_patience_s(cfg)
    for _ in range(n_micro):
        with timeline.span("wait_data"):
            queues.pump()
            last, have = time.monotonic(), queues.available(version)
            looked = last
            while have < need:
                backoff.wait()
                queues.pump()
                now, now_have = time.monotonic(), queues.available(version)
                if now - looked > 1.0:  # this rank was away (stopped, descheduled, reading a
                    last += now - looked  # large group): no silence of its producers
                looked = now
                if now_have != have:
                    last, have = now, now_have
                elif now - last > patience_s:
                    raise RuntimeError(
                        f"no trajectory for {patience_s:g} s while training version "
                        f"{version + 1}: have {have} of {need} segments of batch {version} "
                        f"({settings}). "
                        f"{queues.ring.diagnose(queues.producers)}")
            backoff.reset()
        if need == micro * n_micro:  # the whole batch is here
            queues.settle(version)
        yield queues.take(micro, version)
        need = micro
