"""The trajectory ring's window and its layout: lanes, slots, control words (ring.py has the
protocol)."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from hpcvla.transport.backoff import DATA_POLL_CAP
from hpcvla.transport.windows import allocate, window_bytes
from hpcvla.config.schema import RING_CHECKSUMS, RING_PROGRESS
from hpcvla.transport.progress import ProgressAgent, spans_hosts
from hpcvla.transport.slots import SLOT_HEADER


class RingWindow:
    """The ring's window and layout; create collectively on `comm`, rank `root` hosts it."""

    def __init__(self, comm: MPI.Comm, n_slots: int, slot_bytes: int, root: int = 0,
                 poll_cap: float = DATA_POLL_CAP, progress: str = "auto",
                 start_progress: bool = True, checksum: str = "auto"):
        if slot_bytes % 64 or slot_bytes <= SLOT_HEADER.itemsize or n_slots < 1:
            raise ValueError(f"ring of {n_slots} slots of {slot_bytes} bytes: need >= 1 slot "
                             "and a slot size that is a multiple of 64 and > 64")
        if progress not in RING_PROGRESS:
            raise ValueError(f"ring progress {progress!r}: one of {', '.join(RING_PROGRESS)}")
        if checksum not in RING_CHECKSUMS:
            raise ValueError(f"ring checksum {checksum!r}: one of {', '.join(RING_CHECKSUMS)}")
        size = comm.Get_size()
        self.producers = [r for r in range(size) if r != root] or [root]  # lane l's comm rank
        lanes = len(self.producers)
        self.lane_size = [max(1, n_slots // lanes + (lane < n_slots % lanes))
                          for lane in range(lanes)]
        self.lane_first: list[int] = np.cumsum([0] + self.lane_size[:-1]).tolist()
        n_slots = sum(self.lane_size)  # more than asked only with fewer slots than lanes
        self.comm, self.root, self.n_slots, self.slot_bytes = comm, root, n_slots, slot_bytes
        self.poll_cap = poll_cap  # longest sleep between polls (see backoff.DATA_POLL_CAP)
        self.capacity = slot_bytes - SLOT_HEADER.itemsize
        self.is_root = comm.Get_rank() == root
        self.control_bytes = -(-16 * lanes // 64) * 64
        nbytes = self.control_bytes + n_slots * slot_bytes if self.is_root else 0
        self.win = allocate(nbytes, comm, "the learner's trajectory ring")  # [dist]
        if self.is_root:
            window_bytes(self.win.tomemory())[:] = 0
        # collective: whether producers sit on other hosts, and the progress communicator
        self.spans_hosts = spans_hosts(comm)  # [dist]
        self.checks_payload = checksum == "always" or self.spans_hosts  # the same everywhere
        self.progress = ProgressAgent(comm)  # [dist]
        self._wants_thread = self.is_root and progress != "poll" and (
            progress == "thread" or self.spans_hosts)  # auto: where producers are remote
        if start_progress:
            self.start_progress()
        self.win.Lock_all(MPI.MODE_NOCHECK)
        if self.is_root:  # the zeros before the barrier, for the producers' first reads
            self.win.Sync()  # (MPI-3.1 11.7: store, Win_sync, barrier, then the reads)
        comm.Barrier()  # [dist] zeroed before anyone writes

    def start_progress(self) -> None:
        """Start the progress thread where this ring needs one. A caller that creates more
        windows afterwards starts it after them (`start_progress=False`): MPICH's PMI client
        is not thread-safe, and a thread in MPI while `Win.Allocate_shared` exchanges its
        segment through Slurm's pmi2 interleaves their messages ("mpi/pmi2: value not
        properly terminated in client request" on the 3-host Slurm test)."""
        if self._wants_thread:
            self.progress.start()

    def slot_index(self, lane: int, fragment: int) -> int:
        """The slot that lane `lane`'s fragment `fragment` goes to."""
        return self.lane_first[lane] + fragment % self.lane_size[lane]

    def slot_disp(self, lane: int, fragment: int) -> int:
        """Window displacement of the slot that lane `lane`'s fragment `fragment` goes to."""
        return self.control_bytes + self.slot_index(lane, fragment) * self.slot_bytes

    def free(self) -> None:
        """Collective: release the window."""
        if self.win != MPI.WIN_NULL:
            self.progress.free()  # [dist]
            self.win.Unlock_all()
            self.win.Free()  # [dist]
