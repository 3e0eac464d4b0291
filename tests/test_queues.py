"""The learner's ledger of trained segment groups (roles/queues.Ranges): a set of ints kept as
ranges, which says exactly what a set says, in a range or a few per slot over a run of days."""

import numpy as np

from hpcvla.roles.queues import Ranges


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
