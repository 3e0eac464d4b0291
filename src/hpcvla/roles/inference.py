"""Inference rank: serve the cell's env shards with a dynamic batcher, stamp every step with
the policy version, assemble trajectory segments and stream them to the learner's ring.

Weights are swapped only between forward passes. A request that would start a new segment
is held back while the producer's staleness quota is used up (see hpcvla/schedule.py); its shard
then waits, which is what throttles the simulators.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from hpcvla.devices import HostStaging
from hpcvla.emulate import pad
from hpcvla.envs.base import horizon_cut
from hpcvla.metrics import phases
from hpcvla.roles.batcher import DynamicBatcher
from hpcvla.roles.segments import (FINAL, SegmentBuilder, SegmentGroup, outcome_fields,
                                   truncation_values)
from hpcvla.roles.setup import Counters, RoleSetup
from hpcvla.schedule import Schedule, eligible
from hpcvla.transport import records
from hpcvla.transport.backoff import Nag
from hpcvla.transport.ring_writer import RingWriter

if TYPE_CHECKING:
    from hpcvla.metrics.dump_writer import TrajectoryDump
    from hpcvla.policies.base import Policy
    from hpcvla.transport.exchange import ObsActionExchange
    from hpcvla.transport.manifest import Manifest
    from hpcvla.transport.weights import WeightPlane


class WeightLoader:
    """Copies the newest published weights into a local policy (on a GPU, from a
    page-locked host copy straight into its parameters)."""

    def __init__(self, policy: Policy, plane: WeightPlane, manifest: Manifest):
        self.policy, self.plane, self.manifest = policy, plane, manifest
        flat = torch.empty(manifest.nbytes, dtype=torch.uint8)
        self.flat = (flat.pin_memory() if policy.device.type == "cuda" else flat).numpy()
        self.version = -1

    def refresh(self) -> bool:
        """Load the newest version if there is one: whole the first time, then only what
        training changes (the frozen tensors are already in place)."""
        if self.plane.latest_version() <= self.version:
            return False
        names = None if self.version < 0 else self.manifest.trainable
        self.version = self.plane.read_into(self.flat, trainable_only=names is not None)
        self.policy.load_arrays(self.manifest.views(self.flat, names))
        if self.policy.device.type == "cuda":  # the copies read `flat`, rewritten next time
            torch.cuda.current_stream(self.policy.device).synchronize()
        return True


def first_weights(plane: WeightPlane, version: int, rank: int, patience_s: float) -> None:
    """An inference rank's wait for the learners' first version (0, or the one resumed),
    which the weight root publishes first: after loading the resumed weights, minutes at full
    size from a busy file system. No deadline (a learner that died ends the world); the wait
    is said each `patience_s` (pipeline.stall_timeout_s)."""
    plane.wait_for(version, remind=(patience_s, lambda waited: (
        f"hpcvla: rank {rank} (inference): no weight version {version} from the learners' "
        f"weight root after {waited:.0f} s (it loads the weights it starts from and "
        "publishes them first); still waiting (said every pipeline.stall_timeout_s)")))


class InferenceServer:
    """The state of one inference rank: its cell's slots, one SegmentBuilder per slot (env
    shard), the batcher, the ring to its learner and the staleness quota."""

    def __init__(self, setup: RoleSetup, *, sched: Schedule, policy: Policy,
                 loader: WeightLoader, exchange: ObsActionExchange, ring: RingWriter, quota: int,
                 envs_per_shard: int, obs_keys: list[str], learner: int,
                 dump: TrajectoryDump | None = None, metrics: tuple[str, ...] = ()):
        """`quota`: segments per learner batch (schedule.producer_quota); `learner`: the world
        rank the ring feeds; `dump`: the rank's HDF5 trajectory dump, if the run writes one;
        `metrics`: the env's episode metrics (EnvSpec.episode_metrics)."""
        self.policy, self.loader, self.exchange, self.ring = policy, loader, exchange, ring
        self.quota, self.n, self.obs_keys = quota, envs_per_shard, obs_keys
        self.timeline, self.emulate_ms = setup.timeline, setup.emulated_inference_ms
        self.max_staleness, self.dump = sched.max_staleness, dump
        # an off-policy learner's transitions need the observation after a group's last row
        self.send_next_obs = setup.cfg.algorithm.off_policy
        self.values_truncations = setup.cfg.algorithm.values_truncations
        first_version, segment_len = setup.first_version, setup.cfg.rollout.segment_len
        shapes = {k: (exchange.obs_dtype[k].shape[1:], exchange.obs_dtype[k].base.str)
                  for k in obs_keys}
        shapes.update(policy.extra_fields())  # recorded with every step, as observations
        self.builders = [SegmentBuilder(shapes, envs_per_shard, policy.chunk_len,
                                        policy.action_dim, segment_len, setup.rank, slot,
                                        metrics)
                         for slot in range(exchange.n_slots)]
        self.outcomes = list(outcome_fields(metrics))
        self.batcher = DynamicBatcher(sched.batch_max, sched.wait_max_s)
        self.staging = HostStaging(policy.device)  # observations gather here, then go over
        self.first_version = first_version
        self.rank, self.patience_s = setup.rank, setup.cfg.pipeline.stall_timeout_s
        self.quiet = Nag(self.patience_s)  # since the last new version
        self.learner = learner
        ring.remind = (self.patience_s, lambda waited: (
            f"hpcvla: rank {self.rank} (inference): its ring lane to learner rank {learner} has "
            f"been full for {waited:.0f} s, the learner taking nothing ({self._learner_said}); "
            "still waiting (said every pipeline.stall_timeout_s)"))
        ring.waiting = partial(self.timeline.span, "ring_full")  # the learner sets the pace
        self.stats: Counters = {
            "forward_passes": 0, "batch_envs": 0, "fired_batch_max": 0, "fired_wait_max": 0,
            "segments_sent": 0, "throttled_s": 0.0, "weight_swaps": 0, "value_passes": 0,
            "held_valued": 0, "truncation_passes": 0, "truncations_valued": 0,
            # segment counter c: segment c belongs to learner batch c // quota
            "segments_started": first_version * quota}

    def run(self) -> Counters:
        """Serve until the learners finish (the weight plane says so), then stop every shard."""
        exchange, batcher, loader, stats = self.exchange, self.batcher, self.loader, self.stats
        first_weights(loader.plane, self.first_version, self.rank, self.patience_s)
        loader.refresh()
        self.silence = SilentSimulators(exchange, self.rank, self.patience_s / 2)
        stopped: set[int] = set()
        backoff = exchange.backoff()  # rung by requests
        while len(stopped) < exchange.n_slots:
            for slot in exchange.pending():
                batcher.add(slot, self.n)
                self.silence.asked(slot)
            self.silence.check()
            if loader.plane.finished():  # the learners are done: release every shard
                for slot in batcher.take():
                    exchange.request_actions(slot)["stop"] = 1
                    exchange.respond(slot)
                    stopped.add(slot)  # (not answered: its simulator asks no more)
                self._still_waiting(lambda: self._not_stopped(stopped))
                backoff.wait()
                continue
            begin = self.timeline.now()
            if loader.refresh():  # between batches only
                self.timeline.record("load_weights", begin, self.timeline.now())
                stats["weight_swaps"] += 1
                self.quiet.restart()
            eligible = self._eligible()
            # throttled at a segment boundary: their finished segments still go to the
            # learner (it may be waiting for them), valued by the next pass, or by a pass of
            # their own when no other is coming
            held = [s for s in batcher.queued() if s not in eligible and self.builders[s].full]
            reason = batcher.fire_reason(eligible)
            if reason is None:
                if held and not eligible:
                    self._serve([], held)
                throttled = batcher.waiting_envs() and not eligible
                if throttled:
                    self._still_waiting(lambda: "the staleness quota holds every env")
                waited = backoff.wait(at_most=batcher.time_to_deadline(eligible))
                stats["throttled_s"] += waited if throttled else 0.0
                continue
            backoff.reset()
            stats[f"fired_{reason}"] += 1
            self._serve(batcher.take(eligible), held)
        self.ring.close()
        if self.dump:  # its backlog: after the rank's work (summary's active_s), in wall_s
            self.dump.close()
            phases.mark("dump_written")
        return stats

    def _not_stopped(self, stopped: set[int]) -> str:
        ranks = self.exchange.world_ranks(set(range(self.exchange.n_slots)) - stopped)
        return f"the learners finished, and simulator rank(s) {ranks} have not asked again"

    def _still_waiting(self, why: Callable[[], str]) -> None:
        """Say why this rank waits (`why()`), each pipeline.stall_timeout_s since the last new
        version. Not an error: a version, with its checkpoint, may take that long at full
        size; but a learner that hangs, or a simulator that hangs at the end, is heard of."""
        self.quiet.check(lambda waited: (
            f"hpcvla: rank {self.rank} (inference), {waited:.0f} s since the last new policy "
            f"version from learner rank {self.learner}: {why()} ({self._learner_said}); still "
            "waiting (said every pipeline.stall_timeout_s)"))

    # what tells a long version from a learner that hangs
    _learner_said = ("a learner in a long version says so itself, each pipeline.stall_timeout_s"
                     ": silence from it, stopped or stuck")

    def _serve(self, slots: Sequence[int], held: Sequence[int] = ()) -> None:
        """One forward pass for `slots`: answer the simulators first, then assemble. `held`
        requests (full segments the staleness quota holds back) ride along unanswered: the
        pass values their next observation, which finishes their segments (a pass of their
        own would cost its fixed overhead again)."""
        n, exchange, every = self.n, self.exchange, [*slots, *held]
        with self.timeline.span("infer"):
            begin = time.monotonic()
            obs, outcome = _gather(exchange, every, self.obs_keys, self.staging), \
                _gather(exchange, every, self.outcomes)
            final = self._final_obs(every, outcome) if self.values_truncations else None
            with torch.no_grad():
                out, extras = self.policy.sample(self.staging.to_device(obs))
            actions, logprob, value = (t.cpu().numpy() for t in out)
            obs.update({k: v.cpu().numpy() for k, v in extras.items()})
            if self.emulate_ms:  # the emulated cost is the whole forward pass
                pad(begin, self.emulate_ms(len(every) * n) / 1e3)
            for i, slot in enumerate(slots):
                exchange.request_actions(slot)["actions"][...] = actions[i * n:(i + 1) * n]
                exchange.request_actions(slot)["stop"] = 0
                exchange.respond(slot)
            self.silence.answered(slots)
        self.stats["forward_passes" if slots else "value_passes"] += 1
        self.stats["batch_envs"] += len(slots) * n  # answered env steps
        self.stats["held_valued"] += len(held) * n
        truncation = None if final is None else self._value_truncations(*final)
        with self.timeline.span("assemble"):
            finished = []
            for i, slot in enumerate(every):
                part, builder = slice(i * n, (i + 1) * n), self.builders[slot]
                builder.record_outcome({k: v[part] for k, v in outcome.items()},
                                       None if truncation is None else truncation[part])
                if builder.full:
                    next_obs = {k: obs[k][part] for k in self.obs_keys} \
                        if self.send_next_obs else None
                    finished.append(builder.finish(value[part], next_obs))
                if i >= len(slots):
                    continue  # held: its next segment starts once the quota allows
                if builder.t == 0:  # a segment starts: it belongs to learner batch c // quota
                    builder.batch = self.stats["segments_started"] // self.quota
                    self.stats["segments_started"] += n
                builder.add_step({k: v[part] for k, v in obs.items()}, actions[part],
                                 logprob[part], value[part], self.loader.version)
        self._send(finished)

    def _final_obs(self, slots: Sequence[int], outcome: dict[str, np.ndarray]
                   ) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
        """(mask over the pass's envs, their last observations): the episodes the horizon
        ended whose step awaits its outcome; None if there are none. Copied out now: a slot
        is the simulator's again once answered."""
        cut = horizon_cut(outcome["truncated"], outcome["env_fault"]).reshape(len(slots), self.n)
        if not cut.any():
            return None
        cut &= np.array([self.builders[s].acted for s in slots])[:, None]
        if not cut.any():
            return None
        rows = [(self.exchange.request_obs(s), cut[i]) for i, s in enumerate(slots)
                if cut[i].any()]
        return cut.reshape(-1), {k: np.concatenate([slot[FINAL + k][m] for slot, m in rows])
                                 for k in self.obs_keys}

    def _value_truncations(self, cut: np.ndarray, final: dict[str, np.ndarray]) -> np.ndarray:
        """V of the horizon-ended episodes' last observations at the pass's envs `cut`, 0
        elsewhere: a pass of its own after the simulators have their actions (off their
        critical path, not off this rank's: assembly and the next pass wait for it)."""
        with self.timeline.span("infer"):
            begin = time.monotonic()
            values = truncation_values(self.policy, cut, final)
            if self.emulate_ms:
                pad(begin, self.emulate_ms(int(cut.sum())) / 1e3)
        self.stats["truncation_passes"] += 1
        self.stats["truncations_valued"] += int(cut.sum())
        return values

    def _send(self, groups: list[SegmentGroup]) -> None:
        """Hand this pass's finished segment groups to the learner, small ones packed into
        shared ring slots (a full lane's wait: `ring_full`, inside `send`)."""
        if not groups:
            return
        with self.timeline.span("send"):
            self.ring.put_many([(records.encode(g), records.schema_of(g)) for g in groups])
        self.stats["segments_sent"] += self.n * len(groups)
        if self.dump:  # after the learner has it: the dump is off the data path's clock
            with self.timeline.span("dump"):
                for group in groups:
                    self.dump.add_segment(group)

    def _eligible(self) -> set[int]:
        """Queued slots that may be served now: those mid-segment, plus those starting a
        segment while the staleness quota lasts (in arrival order; schedule.eligible)."""
        builders = self.builders
        return eligible(self.batcher.queued(), lambda s: builders[s].t == 0 or builders[s].full,
                        self.n, self.loader.version, self.max_staleness, self.quota,
                        self.stats["segments_started"])


class SilentSimulators:
    """Slots answered (at the start: expected) longer than `limit_s` ago and not asked since:
    their simulators are stopped, lost, or stuck (a hung env step is also ended by its
    watchdog, env.step_timeout_s). Said once per silence, naming the simulator
    ranks, at half pipeline.stall_timeout_s: before the learner's stall abort, which sees
    only that trajectories stopped coming."""

    def __init__(self, exchange: ObsActionExchange, rank: int, limit_s: float):
        self.exchange, self.rank, self.limit_s = exchange, rank, limit_s
        self.since = np.full(exchange.n_slots, time.monotonic())  # inf: a request is queued
        self.said = np.zeros(exchange.n_slots, dtype=bool)
        self.checked = 0.0

    def asked(self, slot: int) -> None:
        self.since[slot], self.said[slot] = np.inf, False

    def answered(self, slots: Sequence[int]) -> None:
        self.since[list(slots)] = time.monotonic()

    def check(self) -> None:
        now = time.monotonic()
        if now - self.checked < 1.0:  # a second's resolution is plenty, and costs nothing
            return
        self.checked = now
        silent = np.nonzero((now - self.since > self.limit_s) & ~self.said)[0]
        if len(silent):
            self.said[silent] = True
            waited = now - self.since[silent].max()
            print(f"hpcvla: rank {self.rank} (inference): simulator rank(s) "
                  f"{self.exchange.world_ranks(silent.tolist())} have not asked for actions "
                  f"for {waited:.0f} s or more (half pipeline.stall_timeout_s): stopped, "
                  f"lost, or stuck (in an env step: its watchdog, env.step_timeout_s, "
                  f"ends it)", file=sys.stderr, flush=True)


def _gather(exchange: ObsActionExchange, slots: Sequence[int], keys: Iterable[str],
            staging: HostStaging | None = None) -> dict[str, np.ndarray]:
    """Fields of several requests, concatenated along the env axis (a copy out of the
    shared slots, which the simulators reuse as soon as they are answered), into
    `staging`'s buffers when given."""
    if staging is None:
        return {k: np.concatenate([exchange.request_obs(s)[k] for s in slots]) for k in keys}
    return {k: staging.gather(k, [exchange.request_obs(s)[k] for s in slots]) for k in keys}
