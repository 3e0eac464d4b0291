"""Inference rank: serve the cell's env shards with a dynamic batcher, stamp every step with
the policy version, assemble trajectory segments and stream them to the learner's ring.

Weights are swapped only between forward passes. A request that would start a new segment
is held back while the producer's staleness quota is used up (see roles/modes.py); its shard
then waits, which is what throttles the simulators.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from hpcvla.roles.batcher import DynamicBatcher
from hpcvla.roles.segments import SegmentBuilder
from hpcvla.roles.simulator import OUTCOME_FIELDS
from hpcvla.transport import records
from hpcvla.transport.backoff import DATA_POLL_CAP, Backoff


class WeightLoader:
    """Copies the newest published weights into a local policy."""

    def __init__(self, policy, plane, manifest):
        self.policy, self.plane, self.manifest = policy, plane, manifest
        self.flat = np.empty(manifest.nbytes, np.uint8)
        self.version = -1

    def refresh(self) -> bool:
        if self.plane.latest_version() <= self.version:
            return False
        self.version = self.plane.read_into(self.flat)
        with torch.no_grad():
            params = self.policy.state_dict()
            for name, view in self.manifest.views(self.flat).items():
                params[name].copy_(torch.from_numpy(view))
        return True


def run_inference(sched, policy, loader, exchange, ring, quota: int, envs_per_shard: int,
                  obs_keys: list, segment_len: int, producer: int, timeline,
                  emulate_ms=None) -> dict:
    """Serve until the learners finish; `emulate_ms(batch_envs)` adds emulated accelerator
    time per forward pass."""
    spec_shapes = {k: (exchange.obs_dtype[k].shape[1:], exchange.obs_dtype[k].base.str)
                   for k in obs_keys}
    builders = [SegmentBuilder(spec_shapes, envs_per_shard, policy.chunk_len, policy.action_dim,
                               segment_len, producer, slot) for slot in range(exchange.n_slots)]
    batcher = DynamicBatcher(sched.batch_max, sched.wait_max_s)
    stats = {"forward_passes": 0, "batch_envs": 0, "fired_batch_max": 0, "fired_wait_max": 0,
             "segments_started": 0, "segments_sent": 0, "throttled_s": 0.0, "weight_swaps": 0}
    loader.plane.wait_for(0, timeout=600)  # the learner root publishes version 0 first
    loader.refresh()
    stopped, backoff = set(), Backoff(cap=DATA_POLL_CAP)
    while len(stopped) < exchange.n_slots:
        for slot in exchange.pending():
            batcher.add(slot, envs_per_shard)
        if loader.plane.finished():  # the learners are done: release every shard
            for slot in batcher.take():
                exchange.request_actions(slot)["stop"] = 1
                exchange.respond(slot)
                stopped.add(slot)
            backoff.wait()
            continue
        if loader.refresh():  # between batches only
            stats["weight_swaps"] += 1
        allowance = (loader.version + 1 + sched.max_staleness) * quota - stats["segments_started"]
        eligible = _eligible(batcher, builders, allowance, envs_per_shard)
        held = [s for s in batcher.queued() if s not in eligible and builders[s].full]
        if held:  # throttled at a segment boundary: still deliver the finished segments
            with timeline.span("assemble"):
                _finish_segments(held, policy, exchange, builders, ring, obs_keys,
                                 envs_per_shard, stats)
        reason = batcher.fire_reason(eligible)
        if reason is None:
            if batcher.waiting_envs() and not eligible:
                stats["throttled_s"] += backoff.delay
            backoff.wait()
            continue
        backoff.reset()
        slots = batcher.take(eligible)
        stats[f"fired_{reason}"] += 1
        with timeline.span("infer"):
            # One copy out of the shared slots: the batch tensor, and what the segments keep.
            obs, outcome = _gather(exchange, slots, obs_keys), _gather(exchange, slots,
                                                                       OUTCOME_FIELDS)
            with torch.no_grad():
                out = policy.act(policy.obs_to_tensors(obs, "cpu"))
            actions, logprob, value = (t.cpu().numpy() for t in out)
            if emulate_ms:
                time.sleep(emulate_ms(len(slots) * envs_per_shard) / 1e3)
            for i, slot in enumerate(slots):
                exchange.request_actions(slot)["actions"][...] = \
                    actions[i * envs_per_shard:(i + 1) * envs_per_shard]
                exchange.request_actions(slot)["stop"] = 0
                exchange.respond(slot)
        stats["forward_passes"] += 1
        stats["batch_envs"] += len(slots) * envs_per_shard
        with timeline.span("assemble"):
            for i, slot in enumerate(slots):
                part = slice(i * envs_per_shard, (i + 1) * envs_per_shard)
                builder = builders[slot]
                builder.record_outcome(*(outcome[k][part] for k in OUTCOME_FIELDS))
                if builder.full:
                    group = builder.finish(value[part])
                    ring.put(records.encode(group), records.schema_of(group))
                    stats["segments_sent"] += envs_per_shard
                if builder.t == 0:  # a segment starts: it belongs to learner batch c // quota
                    builder.batch = stats["segments_started"] // quota
                    stats["segments_started"] += envs_per_shard
                builder.add_step({k: v[part] for k, v in obs.items()}, actions[part],
                                 logprob[part], value[part], loader.version)
    ring.close()
    return stats


def _gather(exchange, slots, keys) -> dict:
    """Fields of several requests, concatenated along the env axis (a copy out of the
    shared slots, which the simulators reuse as soon as they are answered)."""
    return {k: np.concatenate([exchange.request_obs(s)[k] for s in slots]) for k in keys}


def _finish_segments(slots, policy, exchange, builders, ring, obs_keys, envs_per_shard,
                     stats) -> None:
    """Complete the full segments of requests that must wait: their last outcome is in the
    request and their bootstrap value needs only a forward pass, not an answer."""
    obs = _gather(exchange, slots, obs_keys)
    with torch.no_grad():
        value = policy.act(policy.obs_to_tensors(obs, "cpu")).value.cpu().numpy()
    for i, slot in enumerate(slots):
        part = slice(i * envs_per_shard, (i + 1) * envs_per_shard)
        request = exchange.request_obs(slot)
        builders[slot].record_outcome(*(request[k] for k in OUTCOME_FIELDS))
        group = builders[slot].finish(value[part])
        ring.put(records.encode(group), records.schema_of(group))
        stats["segments_sent"] += envs_per_shard


def _eligible(batcher, builders, allowance: int, envs_per_shard: int) -> set:
    """Queued slots that may be served now: those mid-segment, plus those starting a segment
    while the staleness quota lasts (in arrival order)."""
    eligible = set()
    for slot in batcher.queued():
        starts = builders[slot].t == 0 or builders[slot].full
        if starts:
            if allowance < envs_per_shard:
                continue
            allowance -= envs_per_shard
        eligible.add(slot)
    return eligible
