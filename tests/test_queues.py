"""The learner's ledger of trained segment groups (roles/queues.Ranges): a set of ints kept as
ranges, which says exactly what a set says, in a range or a few per slot over a run of days;
the learner's last guards against training a group twice or too stale (SegmentQueues.take);
and the producers' staleness quota that keeps them from happening (schedule.eligible)."""

import numpy as np
import pytest

from hpcvla.roles.queues import Ranges, SegmentQueues
from hpcvla.schedule import eligible


def test_ranges_hold_what_a_set_holds_in_any_order():
    rng = np.random.default_rng(0)
    for trial in range(20):
        values = rng.permutation(200)[:rng.integers(1, 200)].tolist()
        ranges, seen = Ranges(), set()
        for x in values:
            assert x not in ranges
            ranges.add(x)
            seen.add(x)
            assert len(ranges) == len(seen)
        assert all((x in ranges) == (x in seen) for x in range(-5, 205)), trial
        assert (ranges.first(), ranges.last()) == (min(seen), max(seen))
        assert all(s < e for s, e in zip(ranges.starts, ranges.ends))  # disjoint, sorted,
        assert all(e < s for e, s in zip(ranges.ends, ranges.starts[1:]))  # never adjacent


def test_groups_trained_in_order_are_one_range():
    ranges = Ranges()
    for group in range(7, 100_000):
        ranges.add(group)
    assert (ranges.starts, ranges.ends, len(ranges)) == ([7], [100_000], 99_993)


def _group(producer: int, slot: int, group: int, batch: int, version: int) -> dict:
    """A segment group of 8 envs as SegmentQueues sees it (transport/segment_meta.py)."""
    return {"meta": np.array([producer, slot, group, 8, batch]), "version": np.array([version])}


def test_a_group_delivered_twice_or_past_max_staleness_is_never_trained():
    """SegmentQueues.take, behind the ring's exactly-once delivery and the producers' quota:
    a group that arrives a second time, or one acted with a version older than its batch
    allows, stops the run naming it instead of being trained."""
    queues = SegmentQueues(ring=None, max_staleness=1, stats={"staleness_hist": {}})
    queues.buckets[3].extend([_group(1, 0, 0, 3, 2), _group(1, 0, 0, 3, 2)])
    assert len(queues.take(8, 3)) == 1 and queues.stats["staleness_hist"] == {1: 8}
    with pytest.raises(RuntimeError, match="segment group 0 of producer 1 slot 0 arrived "
                                           "twice; it would be trained twice"):
        queues.take(8, 3)
    queues.buckets[5].append(_group(1, 1, 0, 5, 3))
    with pytest.raises(RuntimeError, match="staleness 2 exceeds max_staleness 1"):
        queues.take(8, 5)


@pytest.mark.parametrize("staleness,started,served", [
    (0, 0, 4), (0, 8, 3), (0, 32, 0), (1, 32, 4), (1, 56, 1), (1, 64, 0)])
def test_a_producer_starts_segments_while_its_staleness_quota_lasts(staleness, started,
                                                                    served):
    """schedule.eligible at policy version 0 with a quota of 32 envs' segments a version:
    segment starts of 8 envs each are served while (0 + 1 + max_staleness) x 32 - started
    allows them, in arrival order; requests in the middle of a segment always are."""
    starting, middle = [f"start{i}" for i in range(4)], ["middle0", "middle1"]
    ok = eligible(starting + middle, lambda item: item.startswith("start"), envs=8,
                  version=0, max_staleness=staleness, quota=32, started=started)
    assert ok == set(starting[:served]) | set(middle)
