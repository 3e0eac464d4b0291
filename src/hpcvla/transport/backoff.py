"""Polling that does not starve oversubscribed ranks.

A rank waiting on memory another rank writes (a ring slot, a flag in a shared window) polls.
Spinning would steal the core the writer needs when ranks outnumber cores, so every wait sleeps
(after an optional short `spin` of sched_yield calls), starting short (low latency when the
answer is near) and doubling up to a cap (little CPU when it is not). `MPI.Win.Sync` or any MPI
call between polls keeps MPI's progress going.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # for the annotations only: this module works without MPI
    import numpy as np
    from mpi4py import MPI

T = TypeVar("T")


# Longest sleep between polls on the data plane (ring slots, observation/action flags): short
# against a transfer or an env step, long enough that waiting ranks leave the cores to
# working ones. Idle waits (next weight version, sitting out a benchmark) sleep longer.
DATA_POLL_CAP = 2e-4
# A wait's first sleep: short, for an answer that is near
FIRST_SLEEP = 20e-6
# The same where a doorbell (transport/doorbell.py) ends a sleep as soon as the answer is in:
# what nobody rings for sets how long a sleep may be. An inference rank has such things (a
# weight version, a batching deadline, a learner's ring lane): RUNG_SERVER_CAP. A simulator
# waiting for its actions has nothing else to look at (a worker's step or a held result it
# waits for with the shorter caps): RUNG_CLIENT_CAP, a safety net that never needs to fire.
RUNG_SERVER_CAP = 1e-3
RUNG_CLIENT_CAP = 1e-2
# How long a latency-critical wait (a simulator waiting for its actions, the server for the
# next request) yields instead of sleeping: a sleep costs ~50-100 us of timer slack and
# wake-up, longer than the answer usually takes; `sched_yield` hands the core to any rank
# that needs it, so the short spin does not starve oversubscribed ones.
DATA_SPIN = 5e-5


class WaitTimeout(TimeoutError):
    """A wait exceeded its deadline; the message says what was being waited for."""


class Backoff:
    def __init__(self, first: float = FIRST_SLEEP, cap: float = 2e-3,
                 timeout: float | None = None,
                 what: str = "a condition", spin: float = 0.0,
                 sleep: Callable[[float], object] = time.sleep):
        self.first, self.cap, self.what, self.sleep = first, cap, what, sleep
        self.delay = first
        now = time.monotonic()
        self.deadline = None if timeout is None else now + timeout
        self.spin_until = now + spin if spin else 0.0
        self.timeout = timeout

    def wait(self, at_most: float | None = None) -> float:
        """Sleep once (`sleep`: a doorbell's ends early when rung), a little longer than last
        time, and `at_most` that long (yield instead during the first `spin` seconds); the
        seconds waited. Raise WaitTimeout past the deadline."""
        now = time.monotonic()
        if self.deadline is not None and now > self.deadline:
            raise WaitTimeout(f"waited more than {self.timeout:g} s for {self.what}")
        if now < self.spin_until:
            os.sched_yield()
        else:
            self.sleep(self.delay if at_most is None else max(0.0, min(self.delay, at_most)))
            self.delay = min(self.delay * 2, self.cap)
        return time.monotonic() - now

    def reset(self) -> None:
        self.delay = self.first


class Nag:
    """A wait that may rightly be long, said by the waiting loop itself: `check(say)` at each
    turn prints say(seconds waited) to stderr once each `every_s` since the wait began (or
    since `restart()`), so a peer that hangs is the one not saying it."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.restart()

    def restart(self) -> None:
        self.since, self.said = time.monotonic(), 0

    def check(self, say: Callable[[float], str]) -> None:
        waited = time.monotonic() - self.since
        if waited > self.every_s * (self.said + 1):
            self.said += 1
            print(say(waited), file=sys.stderr, flush=True)


# (every_s, say): how a wait_until that may rightly be long says so (Nag)
Reminder = tuple[float, Callable[[float], str]]


def wait_until(ready: Callable[[], T], what: str, timeout: float | None = None,
               cap: float = 2e-3, spin: float = 0.0, remind: Reminder | None = None,
               sleep: Callable[[float], object] = time.sleep, first: float = FIRST_SLEEP) -> T:
    """Poll `ready()` with back-off until it returns a truthy value, which is returned;
    `remind`: say so to stderr while it takes long; `sleep`, `first`: Backoff's."""
    backoff = Backoff(first, cap, timeout, what, spin, sleep)
    every_s, say = remind if remind else (0.0, None)
    nag = Nag(every_s)
    while True:
        value = ready()
        if value:
            return value
        if say:
            nag.check(say)
        backoff.wait()


def wait_request(request: MPI.Request, what: str = "an MPI request", timeout: float | None = None,
                 cap: float = 1e-4) -> None:
    """Complete a nonblocking MPI request by polling `Test` with sleeps. A blocking MPI wait
    (Barrier, Wait, Recv) busy-polls in MPICH and Open MPI, which starves the working ranks
    when ranks outnumber cores."""
    wait_until(request.Test, what, timeout, cap=cap)


def idle_barrier(comm: MPI.Comm, timeout: float | None = None, cap: float = 1e-4) -> None:
    """A barrier that sleeps while it waits (`Ibarrier` + sleeping `Test`)."""
    wait_request(comm.Ibarrier(), "a barrier", timeout, cap)  # [dist]


def idle_bcast(comm: MPI.Comm, make: Callable[[], T], root: int = 0) -> T:
    """`make()` on `root` (seconds of work: an env built to learn its spec, say), broadcast to
    every rank of `comm`; the others wait asleep meanwhile, not in the blocking bcast, which
    spins on the cores the root needs."""
    value = make() if comm.Get_rank() == root else None
    idle_barrier(comm)  # [dist]
    made: T = comm.bcast(value, root=root)  # [dist]
    return made


def idle_recv(comm: MPI.Comm, source: int, tag: int, cap: float = 1e-3,
              remind: Reminder | None = None) -> Any:
    """A pickled message from `source`, waited for asleep (`Iprobe` + sleeps), not in the
    blocking recv, which spins on the cores the sender needs."""
    wait_until(lambda: comm.Iprobe(source=source, tag=tag), f"a message from rank {source}",
               cap=cap, remind=remind)  # [dist]
    return comm.recv(source=source, tag=tag)  # [dist]


def summed(comm: MPI.Comm, values: np.ndarray) -> np.ndarray:
    """`values` (float64) summed over the ranks of `comm`, waited for asleep."""
    from mpi4py import MPI
    out = values.copy()
    wait_request(comm.Iallreduce(values, out, op=MPI.SUM), "a sum over the ranks")  # [dist]
    return out
