"""Doorbells between the ranks of one node: a rank that changed what a peer polls for wakes
that peer at once, so the peer can sleep long between polls instead of waking thousands of
times a second to look.

The polled memory (the exchange's flags in a shared window) stays the truth: a ring is only
a hint that something changed. A ring that finds the peer's queue full is not needed (the
peer has rings to wake it), and a spurious one costs one poll; so a waiter never misses an
answer, whatever the timing. Each rank binds an abstract unix datagram socket (Linux's
abstract namespace: no file to create or clean up, gone with the process); a waiter sleeps
in `poll` on it for at most its back-off delay, a ringer sends one byte without blocking.
`poll` counts whole milliseconds (and `select` fails on a descriptor past 1023, which a
process with a simulator's libraries may well have): a shorter sleep is a plain one, and
the rings it sleeps through end the next wait at once.
"""

from __future__ import annotations

import select
import socket
import time
import uuid
from collections.abc import Iterable

from mpi4py import MPI


class Doorbell:
    """This rank's bell, and its peers' addresses on `comm` (one node's ranks).
    Collective: the peers in `check` must be able to ring each other, or it raises."""

    def __init__(self, comm: MPI.Comm, check: Iterable[int] = ()):
        token = comm.bcast(uuid.uuid4().hex if comm.Get_rank() == 0 else None,  # [dist]
                           root=0)
        self._names = [f"\0hpcvla-{token}-{rank}" for rank in range(comm.Get_size())]
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(self._names[comm.Get_rank()])
        self._socket.setblocking(False)
        self._poll = select.poll()
        self._poll.register(self._socket, select.POLLIN)
        comm.Barrier()  # [dist] every bell bound before any rings
        for peer in check:
            if not self._ring(peer):
                raise RuntimeError(
                    f"rank {comm.Get_rank()} of a node's communicator cannot ring rank {peer} "
                    "(an abstract unix socket): the two are in different network namespaces, "
                    "though MPI placed them on one node. Run a node's ranks in one network "
                    "namespace (one container per node, not per rank)")
        comm.Barrier()  # [dist] the checks' rings are in before they are drained
        self.wait(0)

    def ring(self, peer: int) -> None:
        """Wake `peer` (its rank on the communicator); a peer that has gone is not woken."""
        self._ring(peer)

    def _ring(self, peer: int) -> bool:
        """False when no bell of that name exists (gone, or out of this namespace's reach)."""
        try:
            self._socket.sendto(b"\0", self._names[peer])
        except BlockingIOError:  # its queue is full: rung already
            pass
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        return True

    def wait(self, seconds: float) -> float:
        """Sleep until rung or `seconds` have passed; the seconds slept."""
        start = time.monotonic()
        if 0 < seconds < 1e-3:
            time.sleep(seconds)
        elif self._poll.poll(max(seconds, 0.0) * 1e3):
            try:  # every ring so far: one wake-up answers them all
                while self._socket.recv(64):
                    pass
            except BlockingIOError:
                pass
        return time.monotonic() - start

    def close(self) -> None:
        self._socket.close()
