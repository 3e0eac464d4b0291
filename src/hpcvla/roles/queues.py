"""The learner's side of the data plane: segment groups from its trajectory ring, bucketed by
learner batch, each trained exactly once."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hpcvla.transport import records
from hpcvla.transport.ring_reader import RingReader
from hpcvla.transport.segment_meta import SegmentMeta

if TYPE_CHECKING:
    from hpcvla.roles.segments import SegmentGroup
    from hpcvla.roles.setup import Counters


class SegmentQueues:
    """Segment groups from the ring, bucketed by the learner batch their producer assigned
    at segment start (schedule.py): batch b is trained at version b, which is what bounds
    staleness even when segments arrive out of start order."""

    def __init__(self, ring: RingReader, max_staleness: int, stats: Counters,
                 producers: Iterable[int] = ()):
        self.ring, self.max_staleness, self.stats = ring, max_staleness, stats
        self.producers = tuple(producers)  # world ranks feeding this ring, for stall reports
        self.buckets: dict[int, deque[SegmentGroup]] = defaultdict(deque)
        # (producer, slot) -> groups
        self.trained: dict[tuple[int, int], set[int]] = defaultdict(set)

    def ledger(self) -> dict[str, dict[str, int]]:
        """Per producer/slot: groups trained and their index range. A slot's groups go to
        batches in order, so a complete run trains 0..last of each, every one once:
        `missing` counts the holes."""
        return {f"{p}/{s}": {"groups": len(g), "first": min(g), "last": max(g),
                             "missing": max(g) + 1 - min(g) - len(g)}
                for (p, s), g in sorted(self.trained.items())}

    def leftover(self) -> int:
        """Segment groups pumped from the ring but never trained: a batch past the run's last
        version (the staleness quota lets producers run up to max_staleness batches ahead),
        or one a stop left."""
        return sum(len(bucket) for bucket in self.buckets.values())

    def gauges(self) -> dict[str, float]:
        """How full the data plane is now: segments here not yet trained (a later batch's,
        or this one's rest), the ring's slots holding records not yet taken, and its lanes
        that are full (their producers wait for this learner)."""
        used, full = self.ring.occupancy()
        queued = sum(SegmentMeta.of(g).envs for bucket in self.buckets.values() for g in bucket)
        return {"queued_segments": queued, "ring_slots_used": used, "ring_full_lanes": full}

    def pump(self) -> None:
        for rec in self.ring.poll():
            group = records.decode(rec.data)  # copies out of the ring slot
            self.buckets[SegmentMeta.of(group).batch].append(group)
        self.ring.release()
        self.ring.check_intact()  # every segment is needed: a lost one ends the run now

    def settle(self, batch: int) -> None:
        """Put batch `batch`, whole, in one order whatever order it arrived in (producer,
        slot, group): its micro-batches are then trained in that order, which keeps a
        synchronous run repeatable at one seed."""
        self.buckets[batch] = deque(sorted(self.buckets[batch],
                                           key=lambda g: SegmentMeta.of(g)[:3]))

    def available(self, batch: int) -> int:
        return sum(SegmentMeta.of(g).envs for g in self.buckets[batch])

    def take(self, segments: int, batch: int) -> list[SegmentGroup]:
        groups, got, bucket = [], 0, self.buckets[batch]
        while got < segments:
            group = bucket.popleft()
            meta = SegmentMeta.of(group)
            staleness = batch - int(group["version"][0])
            if staleness > self.max_staleness:  # the quota makes this impossible: a bug
                raise RuntimeError(f"segment of policy version {int(group['version'][0])} "
                                   f"in batch {batch}: staleness {staleness} exceeds "
                                   f"max_staleness {self.max_staleness}")
            trained = self.trained[meta.producer, meta.slot]
            if meta.group in trained:  # the ring delivers exactly once
                raise RuntimeError(f"segment group {meta.group} of producer {meta.producer} "
                                   f"slot {meta.slot} arrived twice; it would be trained twice")
            trained.add(meta.group)
            hist = self.stats["staleness_hist"]
            hist[staleness] = hist.get(staleness, 0) + meta.envs
            groups.append(group)
            got += meta.envs
        if not bucket:
            del self.buckets[batch]
        return groups
