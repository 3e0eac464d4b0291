"""The dynamic batching scheduler of an inference rank (RL-VLA³ section 3.2, Eq. 1).

Requests (one per env shard, carrying that shard's envs) queue as they arrive. A forward pass
fires as soon as `batch_max` envs wait, or the oldest request has waited `wait_max` seconds,
whichever comes first; it takes requests in arrival order up to `batch_max` envs (at least
one request) and serves them in slot order. `batch_max = inf, wait_max = inf` waits for
everybody (the synchronous baseline); `batch_max = 1` serves each request alone (no
batching).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Container


class DynamicBatcher:
    def __init__(self, batch_max: float, wait_max: float,
                 clock: Callable[[], float] = time.monotonic):
        if batch_max < 1 or wait_max < 0:
            raise ValueError(f"batch_max {batch_max} must be >= 1 and wait_max {wait_max} >= 0")
        self.batch_max, self.wait_max, self.clock = batch_max, wait_max, clock
        self._queue: OrderedDict[int, tuple[int, float]] = OrderedDict()  # slot -> (envs, t)

    def add(self, slot: int, envs: int) -> None:
        self._queue[slot] = (envs, self.clock())

    def queued(self) -> list[int]:
        """Waiting slots, oldest first."""
        return list(self._queue)

    def waiting_envs(self, eligible: Container[int] | None = None) -> int:
        return sum(n for s, (n, _) in self._queue.items() if eligible is None or s in eligible)

    def fire_reason(self, eligible: Container[int] | None = None) -> str | None:
        """'batch_max' or 'wait_max' if a forward pass should start now, else None.
        `eligible` (a set of slots) are the requests allowed to proceed; the others (held
        back by the staleness quota) still count towards `batch_max`: they cannot be served
        before the learner moves on, so waiting for them would stall a synchronous batch."""
        queued = [(s, n, t) for s, (n, t) in self._queue.items()
                  if eligible is None or s in eligible]
        if not queued:
            return None
        if self.waiting_envs() >= self.batch_max:
            return "batch_max"
        if self.clock() - queued[0][2] >= self.wait_max:
            return "wait_max"
        return None

    def take(self, eligible: Container[int] | None = None) -> list[int]:
        """Pop the requests of the next batch (taken in arrival order, up to batch_max envs),
        in slot order: the pass draws its action noise in that order, so a batch of the
        same requests is served alike however they arrived (a synchronous run repeats)."""
        batch: list[int] = []
        envs = 0
        for slot, (n, _) in list(self._queue.items()):
            if eligible is not None and slot not in eligible:
                continue
            if batch and envs + n > self.batch_max:
                break
            batch.append(slot)
            envs += n
            del self._queue[slot]
        return sorted(batch)

    def time_to_deadline(self, eligible: Container[int] | None = None) -> float:
        """Seconds until the oldest eligible request reaches wait_max (inf if none)."""
        times = [t for s, (_, t) in self._queue.items() if eligible is None or s in eligible]
        return math.inf if not times else max(0.0, times[0] + self.wait_max - self.clock())
