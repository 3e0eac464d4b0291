"""Trajectory ring: many producers write records into one learner's memory, one-sidedly.

The learner (rank `root` of the ring's communicator, usually its feed communicator) hosts a
window from `Win.Allocate`. Producers on the learner's host write it through shared memory and
complete while the learner computes without calling MPI. Producers on other hosts need the
learner's MPI progress engine to run (over TCP, and for atomics on many fabrics, the target
completes one-sided operations): every `poll` drives it once, and when the ring spans hosts a
`ProgressAgent` thread (transport/progress.py) drives it every millisecond between polls, so
a remote put completes in milliseconds even while the learner is inside a long training step
(`progress`: auto = the thread only when the ring spans hosts; thread; poll = never a thread).

Layout (byte displacements): one lane per producing rank (every rank of `comm` but `root`;
a one-rank ring's root produces itself), n_slots split between lanes as evenly as they go:

    0                      control: per lane, freed (i8, written by the learner) and started
                           (i8, by the producer), padded to a multiple of 64 bytes
    control + i * slot     slot i: SLOT_HEADER (64 bytes) + payload (slot_bytes - 64); lane
                           l owns slots first[l] .. first[l] + size[l] - 1

A producer writes its f-th fragment into slot first + f % size of its own lane. Lanes rather
than one shared counter of slots: an MPI atomic costs several `Put`s in shared memory, and
with one order for all a descheduled producer would hold back everyone's records. The lane's
freed word W (its fragments below W were consumed and their slots handed back) only grows, so
the value last read is a safe lower bound: the producer re-reads it (`Get`, back-off) only
while f - size >= W, so a lane that is not full costs no round trip. Per fragment: `Put`
header fields and payload (and, per record, the started word, for stall reports, when the
ring spans hosts), `Flush`, then publish with a `Put` of f + 1 into the slot's state word,
`Flush`. Every word has one writer and is an aligned 8-byte store, read whole. The learner
reads each lane in order from its own memory: a slot is ready when its state is f + 1; it
checks the header (lane fragment number, lengths, checksum over the header and, where
checked, the payload), hands the payload out, and frees slots in batches: once per
`poll`/`release` it stores, per lane, W = the oldest fragment it still holds. So a full lane
makes its producer wait, memory stays bounded, and nothing is overwritten before it was read.
The price of lanes: a producer cannot borrow another's idle slots.

A record larger than a slot's payload is split into fragments (`part`/`nparts`), reassembled
per producer; each producer's records arrive in the order it wrote them. A slot that fails a
check is dropped, counted and reported; the record it belonged to is never delivered and the
gap in that producer's sequence is counted as lost. A fragment with nparts = 0 announces that
its producer closed. Small records handed over together (`put_many`) share slots: one `Put`
of header and table, one `Flush` and publish per slot and one `Put` per record (slots.py has
the packed layout, which both sides cache per shape of records); the learner gets each as its
own view.

Payload checksums (`checksum`): `auto` checks payloads only when the ring spans hosts, where
a transport that reorders a publish before its payload would otherwise go unseen; between
ranks of one host a Put is a store into the same memory, completed by the Flush before the
publish, and two passes over every payload would cost more than the copy itself. `always`
checks them everywhere. The header (fragment number, lengths, identity) is checksummed always.

The window and its layout (ring_window.py) are created and freed collectively; each side's
state is its own object, which `TrajectoryRing` makes where the rank plays that side: a producing rank's `ring.writer` (ring_writer.py: its
lane, next fragment and the freed word as last read) and the learner's `ring.reader`
(ring_reader.py: per lane the next fragment and the freed word, the records being
reassembled, the counts).
"""

from __future__ import annotations

from collections.abc import Callable

from mpi4py import MPI

from hpcvla.transport.backoff import DATA_POLL_CAP
from hpcvla.transport.ring_reader import RingReader
from hpcvla.transport.ring_window import RingWindow
from hpcvla.transport.ring_writer import RingWriter


class TrajectoryRing(RingWindow):
    """Create collectively on `comm`; rank `root` reads (`reader`), every other rank may write
    (`writer`; on a one-rank ring the root does both). `producer_id` names this rank's records
    (its world rank by default); `report` takes the reader's messages about dropped slots."""

    writer: RingWriter | None
    reader: RingReader | None

    def __init__(self, comm: MPI.Comm, n_slots: int, slot_bytes: int, root: int = 0,
                 producer_id: int | None = None, report: Callable[[str], None] | None = None,
                 poll_cap: float = DATA_POLL_CAP, progress: str = "auto",
                 start_progress: bool = True, checksum: str = "auto"):
        super().__init__(comm, n_slots, slot_bytes, root, poll_cap, progress,  # [dist]
                         start_progress, checksum)
        rank = comm.Get_rank()
        self.writer = RingWriter(self, self.producers.index(rank),
                                 MPI.COMM_WORLD.Get_rank() if producer_id is None
                                 else producer_id) if rank in self.producers else None
        self.reader = RingReader(self, report) if self.is_root else None
