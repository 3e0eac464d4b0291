"""Doorbells between the ranks of one node: a rank that changed what a peer polls for wakes
that peer at once, so the peer can sleep long between polls instead of waking thousands of
times a second to look.

The polled memory (the exchange's flags in a shared window) stays the truth: a ring is only
a hint that something changed, and a spurious one costs one poll. Each rank binds an abstract
unix datagram socket (Linux's abstract namespace: no file to create or clean up, gone with
the process) and rings each peer through a socket of its own connected to that peer's: a
datagram is charged to its sender's socket until read, so a ring that finds its socket full
finds rings to that peer unread, which will wake it (through one socket shared by all
peers, rings unread by busy peers would block the rings to an idle one). A waiter sleeps in
`poll` on its socket for at most its back-off delay. `poll` counts whole milliseconds (and
`select` fails on a descriptor past 1023, which a process with a simulator's libraries may
well have), so the whole milliseconds of a sleep are spent in `poll` and the rest in a plain
sleep; the rings that one sleeps through end the next wait at once.
"""

from __future__ import annotations

import select
import socket
import sys
import time
import uuid
from collections.abc import Iterable

from mpi4py import MPI


class Doorbell:
    """Rank `rank`'s bell among those named by `token` (`on`: a communicator's)."""

    def __init__(self, token: str, rank: int):
        self._token, self._rank, self._warned = token, rank, False
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(self._name(rank))
        self._socket.setblocking(False)
        self._poll = select.poll()
        self._poll.register(self._socket, select.POLLIN)
        self._bells: dict[int, socket.socket] = {}

    @classmethod
    def on(cls, comm: MPI.Comm, peers: Iterable[int]) -> Doorbell:
        """Collective: each rank's bell on `comm` (one node's ranks), reaching `peers`;
        raises where a peer's bell cannot be reached."""
        token = comm.bcast(uuid.uuid4().hex if comm.Get_rank() == 0 else None,  # [dist]
                           root=0)
        bell = cls(token, comm.Get_rank())
        comm.Barrier()  # [dist] every bell bound before any is reached
        try:
            bell.reach(peers)
        except ConnectionRefusedError as unreachable:
            raise RuntimeError(
                f"rank {comm.Get_rank()} of a node's communicator cannot reach {unreachable}'s "
                "doorbell (an abstract unix socket): the two are in different network "
                "namespaces, though MPI placed them on one node. Run a node's ranks in one "
                "network namespace (one container per node, not per rank)") from None
        return bell

    def _name(self, rank: int) -> str:
        return f"\0hpcvla-{self._token}-{rank}"

    def reach(self, peers: Iterable[int]) -> None:
        """A socket of this rank's own connected to each peer's bell (all bound by now);
        ConnectionRefusedError('rank P') where one is not there."""
        for peer in peers:
            bell = self._bells[peer] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            bell.setblocking(False)
            try:
                bell.connect(self._name(peer))
            except (ConnectionRefusedError, FileNotFoundError):
                raise ConnectionRefusedError(f"rank {peer}") from None

    def ring(self, peer: int) -> None:
        """Wake `peer` (a rank given as a peer); a peer that has gone is not woken. A ring is
        a hint (the polled flags are the truth, a waiter's sleep is capped), so one the kernel
        refuses (ENOBUFS, a security module) costs the peer a later wake-up, said once, and
        never the rank."""
        try:
            self._bells[peer].send(b"\0")
        except BlockingIOError:  # rings to it unread: it has them to wake it
            pass
        except ConnectionRefusedError:  # it has closed its bell (its rank ended)
            pass
        except OSError as err:
            if not self._warned:
                self._warned = True
                print(f"hpcvla doorbell: rank {self._rank} could not ring rank {peer} ({err}); "
                      "a peer not rung wakes at its next poll (its back-off cap)",
                      file=sys.stderr, flush=True)

    def wait(self, seconds: float) -> float:
        """Sleep until rung or `seconds` have passed; the seconds slept."""
        start = time.monotonic()
        whole_ms = int(seconds * 1e3) if seconds > 0 else 0
        if whole_ms and self._poll.poll(whole_ms):
            self._take_rings()
        else:
            rest = seconds - (time.monotonic() - start)
            if rest > 0:
                time.sleep(rest)
        return time.monotonic() - start

    def _take_rings(self) -> None:
        """Every ring so far: one wake-up answers them all."""
        try:
            while self._socket.recv(64):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for bell in (self._socket, *self._bells.values()):
            bell.close()
