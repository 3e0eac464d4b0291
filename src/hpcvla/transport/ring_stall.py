"""What a learner's stall message says about its trajectory ring (ring_reader.py)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from hpcvla.transport.ring_window import RingWindow
    from hpcvla.transport.slots import RingStats


class StalledReader(Protocol):
    """What a stall report reads of a RingReader (ring_reader.py, which imports this module)."""

    @property
    def ring(self) -> RingWindow: ...
    @property
    def stats(self) -> RingStats: ...
    @property
    def next(self) -> list[int]: ...  # per lane, the next fragment to read
    @property
    def started_words(self) -> np.ndarray: ...  # per lane, the started word


def describe_stall(reader: StalledReader, producers: Iterable[int] = ()) -> str:
    """Why nothing arrives: what each producer delivered and when, and whether fragments were
    started but never published (their payloads are stuck in transit: a progress or network
    problem; producers mark them started only when the ring spans hosts) or nothing was even
    started (the producers are stuck upstream)."""
    ring, stats = reader.ring, reader.stats
    ring.win.Sync()
    now = time.monotonic()
    seen = sorted(set(producers) | set(stats.delivered))
    per = "; ".join(
        f"producer rank {p}: {n} records, last {now - t:.0f} s ago" if n else
        f"producer rank {p}: nothing" for p, (n, t) in
        ((p, stats.delivered.get(p, (0, 0.0))) for p in seen)) or "no producer yet"
    closed = f"; closed: {sorted(stats.closed)}" if stats.closed else ""
    stuck = [(ring.producers[lane], int(started) - reader.next[lane])
             for lane, started in enumerate(reader.started_words)
             if started > reader.next[lane]]
    if stuck:
        cause = (f"{sum(n for _, n in stuck)} fragment(s) started but not published ("
                 + ", ".join(f"{n} in the lane of comm rank {r}" for r, n in stuck)
                 + "): writes into this ring are in flight and not completing, a "
                 "progress or network problem between producer and learner hosts")
    else:
        cause = (f"all {sum(reader.next)} fragment(s) started were delivered and no "
                 f"producer has tried to write since (stuck upstream: simulators, "
                 f"inference, the layout), or their first request never reached this "
                 f"host (network)")
    return f"ring ({'spans hosts' if ring.spans_hosts else 'one host'}, progress " \
           f"{'thread' if ring.progress.running else 'on poll'}): {cause}. {per}{closed}"
