"""The learner's side of the data plane: segment groups from its trajectory ring, bucketed by
learner batch, each trained exactly once."""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hpcvla.transport import records
from hpcvla.transport.ring_reader import RingReader
from hpcvla.transport.segment_meta import SegmentMeta

if TYPE_CHECKING:
    from hpcvla.roles.segments import SegmentGroup
    from hpcvla.roles.setup import Counters


class Ranges:
    """A set of ints as sorted disjoint ranges [start, end): one slot's trained segment
    groups, which come in order (but for the holes a stop leaves), so a run of days holds a
    range or a few per slot, not every index it trained (~65 B each: ~0.8 GB a day on the
    default run's learner)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def __contains__(self, x: int) -> bool:
        i = bisect_right(self.starts, x) - 1
        return i >= 0 and x < self.ends[i]

    def add(self, x: int) -> None:
        """Add `x`, not yet in the set."""
        i = bisect_right(self.starts, x)  # the ranges before x: 0..i-1
        left = i > 0 and self.ends[i - 1] == x
        right = i < len(self.starts) and self.starts[i] == x + 1
        if left and right:  # x fills the hole between two ranges
            self.ends[i - 1] = self.ends.pop(i)
            del self.starts[i]
        elif left:
            self.ends[i - 1] = x + 1
        elif right:
            self.starts[i] = x
        else:
            self.starts.insert(i, x)
            self.ends.insert(i, x + 1)

    def __len__(self) -> int:
        return sum(end - start for start, end in zip(self.starts, self.ends))

    def first(self) -> int:
        return self.starts[0]

    def last(self) -> int:
        return self.ends[-1] - 1


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
        self.trained: dict[tuple[int, int], Ranges] = defaultdict(Ranges)

    def ledger(self) -> dict[str, dict[str, int]]:
        """Per producer/slot: groups trained and their index range. A slot's groups go to
        batches in order, so a complete run trains 0..last of each, every one once:
        `missing` counts the holes."""
        return {f"{p}/{s}": {"groups": len(g), "first": g.first(), "last": g.last(),
                             "missing": g.last() + 1 - g.first() - len(g)}
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
