"""The `meta` field of a trajectory segment group, by name: who assembled it, for which env
shard, and the learner batch it is trained in. The inference rank writes it
(roles/segments.py); the learner's queues (roles/queues.py) and the HDF5 dump
(metrics/dump_writer.py) read it. It lives beside the record format because it travels with every
segment through the ring."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np


class SegmentMeta(NamedTuple):
    """A segment group's `meta` array (5 x i8), by name."""
    producer: int  # world rank of the inference rank (or colocated rank) that assembled it
    slot: int  # the env shard's slot at that producer
    group: int  # index of the group among that slot's, from 0
    envs: int  # envs (columns) in the group
    batch: int  # learner batch (= policy version) it is trained in, set at segment start

    @classmethod
    def of(cls, group: Mapping[str, np.ndarray]) -> "SegmentMeta":
        return cls(*(int(x) for x in group["meta"]))
