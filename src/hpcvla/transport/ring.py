"""Trajectory ring: many producers write records into one learner's memory, one-sidedly.

The learner (rank `root` of the ring's communicator, usually its feed communicator) hosts a
window from `Win.Allocate`. Producers on the learner's host write it through shared memory and
complete while the learner computes without calling MPI. Producers on other hosts need the
learner's MPI progress engine to run (over TCP, and for atomics on many fabrics, the target
completes one-sided operations): every `poll` drives it once, and when the ring spans hosts a
`ProgressAgent` thread (transport/progress.py) drives it every millisecond between polls, so
a remote put completes in milliseconds even while the learner is inside a long training step
(`progress`: auto = the thread only when the ring spans hosts; thread; poll = never a thread).
Layout (byte displacements):

    0                      control: ticket counter (i8), 56 bytes reserved
    64 + i * slot_bytes    slot i: SLOT_HEADER (64 bytes) + payload (slot_bytes - 64)

Producer, per fragment: take a ticket t with an atomic fetch-and-add on the counter; slot
t % n_slots; wait (back-off) until the slot's state word says ticket t - n_slots was consumed;
`Put` header fields and payload; `Flush`; then publish by atomically replacing the state word
with t + 1 and flushing. The learner reads tickets in order from its own memory: a slot is
ready when its state is t + 1; it checks the header (ticket, lengths, checksum over header and
payload), copies the payload out, and frees the slot by writing -(t + 1). So a full ring makes
producers wait, memory stays bounded, and nothing is overwritten before it was read.

A record larger than a slot's payload is split into fragments (`part`/`nparts`), reassembled
per producer; each producer's records arrive in the order it wrote them. A slot that fails a
check is dropped, counted and reported; the record it belonged to is never delivered and the
gap in that producer's sequence is counted as lost. A fragment with nparts = 0 announces that
its producer closed.
"""

from __future__ import annotations

import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from hpcvla.transport.backoff import DATA_POLL_CAP, Backoff, wait_until
from hpcvla.transport.progress import MODES, ProgressAgent, spans_hosts

CONTROL_BYTES = 64
SLOT_HEADER = np.dtype([
    ("state", "<i8"),          # publish word: t + 1 published, -(t + 1) consumed, 0 never used
    ("ticket", "<i8"),         # ticket this content belongs to (detects stale/torn slots)
    ("producer", "<i4"),       # producer id (its world rank)
    ("schema", "<u4"),         # record schema id (see records.schema_of), 0 = raw bytes
    ("seq", "<i8"),            # per-producer record sequence number, from 0
    ("part", "<u4"),           # fragment index
    ("nparts", "<u4"),         # fragments in the record; 0 = producer closed
    ("length", "<u8"),         # payload bytes in this slot
    ("record_length", "<u8"),  # bytes of the whole record
    ("checksum", "<u8"),       # checksum64(payload) + crc32(header bytes 8..56), mod 2**64
])
assert SLOT_HEADER.itemsize == 64
_MASK = (1 << 64) - 1


def checksum64(payload: np.ndarray) -> int:
    """Sum of the payload's little-endian 64-bit words, plus its length, mod 2**64. Any single
    changed word or bit, a torn (half old, half new) or truncated payload changes it; it is not
    cryptographic. One pass at memory bandwidth, so it costs a fraction of the Put it guards."""
    n = payload.nbytes
    words = payload[: n - n % 8].view(np.uint64)
    tail = int.from_bytes(payload[n - n % 8:].tobytes(), "little")
    return (int(words.sum(dtype=np.uint64)) + tail + n) & _MASK


class Record(NamedTuple):
    producer: int
    seq: int
    schema: int
    data: np.ndarray  # uint8, the record's bytes


@dataclass
class RingStats:
    records: int = 0            # delivered
    bytes: int = 0              # delivered payload bytes
    bad_slots: int = 0          # slots dropped by a failed check
    dropped_records: int = 0    # partially received records discarded
    lost_records: int = 0       # gaps in producers' sequences (records never delivered)
    closed: set = field(default_factory=set)
    # per producer: (records delivered, time.monotonic() of the last one), for stall reports
    delivered: dict = field(default_factory=dict)


class TrajectoryRing:
    """Create collectively on `comm`; rank `root` consumes, any rank may produce."""

    def __init__(self, comm: MPI.Comm, n_slots: int, slot_bytes: int, root: int = 0,
                 producer_id: int | None = None, report=None,
                 poll_cap: float = DATA_POLL_CAP, progress: str = "auto",
                 start_progress: bool = True):
        if slot_bytes % 64 or slot_bytes <= SLOT_HEADER.itemsize or n_slots < 1:
            raise ValueError(f"ring of {n_slots} slots of {slot_bytes} bytes: need >= 1 slot "
                             "and a slot size that is a multiple of 64 and > 64")
        if progress not in MODES:
            raise ValueError(f"ring progress {progress!r}: one of {', '.join(MODES)}")
        self.comm, self.root, self.n_slots, self.slot_bytes = comm, root, n_slots, slot_bytes
        self.poll_cap = poll_cap  # longest sleep between polls (see backoff.DATA_POLL_CAP)
        self.capacity = slot_bytes - SLOT_HEADER.itemsize
        self.is_root = comm.Get_rank() == root
        self.producer_id = MPI.COMM_WORLD.Get_rank() if producer_id is None else producer_id
        size = CONTROL_BYTES + n_slots * slot_bytes if self.is_root else 0
        self.win = MPI.Win.Allocate(size, 1, comm=comm)
        if self.is_root:
            memory = np.frombuffer(self.win.tomemory(), np.uint8)
            memory[:] = 0
            self._ticket_counter = memory[:8].view(np.int64)
            self._slots = memory[CONTROL_BYTES:].reshape(n_slots, slot_bytes)
            self._states = self._slots[:, :8].view(np.int64)[:, 0]
        # collective: whether producers sit on other hosts, and the progress communicator
        self.spans_hosts = spans_hosts(comm)
        self.progress = ProgressAgent(comm)
        self._wants_thread = self.is_root and (
            progress == "thread" or (progress == "auto" and self.spans_hosts))
        if start_progress:
            self.start_progress()
        comm.Barrier()  # zeroed before anyone writes
        self.win.Lock_all(MPI.MODE_NOCHECK)
        # producer state
        self._seq = 0
        self._header = np.zeros(1, SLOT_HEADER)
        self._one = np.ones(1, np.int64)
        self._fetched = np.zeros(1, np.int64)
        # consumer state
        self._next_ticket = 0
        self._partial: dict[int, tuple[np.ndarray, int, int]] = {}  # producer -> (buf, seq, parts)
        self._expected_seq: dict[int, int] = {}
        self._held: list[int] = []  # tickets whose slots back records handed out by poll()
        self.stats = RingStats()
        self.report = report or (lambda msg: print(f"hpcvla ring: {msg}", file=sys.stderr,
                                                   flush=True))

    # ---------------------------------------------------------------- producer side
    def put(self, record, schema: int = 0, timeout: float | None = None) -> None:
        """Write one record (bytes-like or uint8 array); blocks while the ring is full."""
        data = np.frombuffer(record, np.uint8) if not isinstance(record, np.ndarray) \
            else record.reshape(-1).view(np.uint8)
        nparts = max(1, -(-data.nbytes // self.capacity))
        for part in range(nparts):
            fragment = data[part * self.capacity:(part + 1) * self.capacity]
            self._put_fragment(fragment, schema, part, nparts, data.nbytes, timeout)
        self._seq += 1

    def start_progress(self) -> None:
        """Start the progress thread where this ring needs one. A caller that creates more
        windows afterwards starts it after them (`start_progress=False`): MPICH's PMI client
        is not thread-safe, and a thread in MPI while `Win.Allocate_shared` exchanges its
        segment through Slurm's pmi2 interleaves their messages ("mpi/pmi2: value not
        properly terminated in client request" on the 3-host Slurm test)."""
        if self._wants_thread:
            self.progress.start()

    def close(self) -> None:
        """Tell the consumer this producer is done (after all its records)."""
        self._put_fragment(np.zeros(0, np.uint8), 0, 0, 0, 0, None)

    def _put_fragment(self, fragment, schema, part, nparts, record_length, timeout) -> None:
        win, root = self.win, self.root
        win.Fetch_and_op([self._one, MPI.INT64_T], [self._fetched, MPI.INT64_T], root, 0,
                         MPI.SUM)
        win.Flush(root)
        ticket = int(self._fetched[0])
        disp = CONTROL_BYTES + (ticket % self.n_slots) * self.slot_bytes
        freed = -(ticket - self.n_slots + 1)  # state once ticket - n_slots was consumed
        if ticket >= self.n_slots:
            wait_until(lambda: self._state(disp) == freed,
                       f"ring slot {ticket % self.n_slots} to be freed", timeout,
                       cap=self.poll_cap)
        self._header[0] = (0, ticket, self.producer_id, schema, self._seq, part, nparts,
                           fragment.nbytes, record_length, 0)
        self._header[0]["checksum"] = _slot_checksum(self._header, fragment)
        raw = self._header.view(np.uint8)
        win.Put(raw[8:], root, (disp + 8, 56, MPI.BYTE))
        if fragment.nbytes:
            win.Put(fragment, root, (disp + SLOT_HEADER.itemsize, fragment.nbytes, MPI.BYTE))
        win.Flush(root)  # payload complete at the target before it is published
        win.Accumulate([np.array([ticket + 1], np.int64), MPI.INT64_T], root,
                       (disp, 1, MPI.INT64_T), MPI.REPLACE)
        win.Flush(root)

    def _state(self, disp: int) -> int:
        self.win.Fetch_and_op([self._one, MPI.INT64_T], [self._fetched, MPI.INT64_T],
                              self.root, disp, MPI.NO_OP)
        self.win.Flush(self.root)
        return int(self._fetched[0])

    # ---------------------------------------------------------------- consumer side
    def poll(self, limit: int | None = None) -> list[Record]:
        """Records completed since the last call (never blocks).

        Zero copy: a record that fits one slot is a view into the window, valid until the next
        `poll`/`get`/`release`, which hand its slot back to the producers. Copy what you keep.
        """
        self.release()
        out: list[Record] = []
        self.progress.poke()  # completes what remote producers have in flight
        self.win.Sync()
        while limit is None or len(out) < limit:
            ticket = self._next_ticket
            slot = self._slots[ticket % self.n_slots]
            state = int(slot[:8].view(np.int64)[0])
            if state != ticket + 1:
                break
            self.win.Sync()  # read the payload only after seeing the state
            header = slot[:SLOT_HEADER.itemsize].copy().view(SLOT_HEADER)
            problem = self._check(header, ticket, slot)
            fragment = None if problem else \
                slot[SLOT_HEADER.itemsize:SLOT_HEADER.itemsize + int(header[0]["length"])]
            record = None
            if problem:
                self.stats.bad_slots += 1
                self.report(f"dropped slot of ticket {ticket} (claims producer "
                            f"{int(header[0]['producer'])}, seq {int(header[0]['seq'])}): "
                            f"{problem}")
            else:
                record = self._assemble(header[0], fragment)
            self._next_ticket += 1
            if record is not None and int(header[0]["nparts"]) == 1:
                self._held.append(ticket)  # a view of this slot: freed by the next poll
            else:
                self._free_slot(ticket)
            if record is not None:
                out.append(record)
        return out

    def release(self) -> None:
        """Hand the slots of the records returned by the last poll back to the producers."""
        for ticket in self._held:
            self._free_slot(ticket)
        self._held.clear()

    def _free_slot(self, ticket: int) -> None:
        self.win.Accumulate([np.array([-(ticket + 1)], np.int64), MPI.INT64_T], self.root,
                            (CONTROL_BYTES + (ticket % self.n_slots) * self.slot_bytes, 1,
                             MPI.INT64_T), MPI.REPLACE)
        self.win.Flush(self.root)

    def get(self, timeout: float | None = None) -> list[Record]:
        """At least one record, waiting with back-off (WaitTimeout past `timeout`); or none if
        a producer closed meanwhile, so a consumer waiting for the last close never waits for
        a record that will not come."""
        backoff = Backoff(timeout=timeout, cap=self.poll_cap,
                          what="a record in the trajectory ring")
        closed = len(self.stats.closed)
        while True:
            records = self.poll()
            if records or len(self.stats.closed) > closed:
                return records
            backoff.wait()

    def occupancy(self) -> tuple[int, int]:
        """(slots holding published records not yet consumed, producers' tickets waiting for
        a slot). The first is at most n_slots: memory is bounded, a full ring makes producers
        wait."""
        self.win.Sync()
        published = int(np.count_nonzero(self._states > 0))
        taken = int(self._ticket_counter[0]) - self._next_ticket
        return published, max(0, taken - self.n_slots)

    def diagnose(self, producers=()) -> str:
        """Why nothing arrives, for a stall message: what each producer delivered and when,
        and whether tickets were taken but never published (their payloads are stuck in
        transit: a progress or network problem) or nothing was even claimed (the producers
        are stuck upstream)."""
        self.win.Sync()
        now = time.monotonic()
        taken = int(self._ticket_counter[0])
        seen = sorted(set(producers) | set(self.stats.delivered))
        per = "; ".join(
            f"producer rank {p}: {n} records, last {now - t:.0f} s ago" if n else
            f"producer rank {p}: nothing" for p, (n, t) in
            ((p, self.stats.delivered.get(p, (0, 0.0))) for p in seen)) or "no producer yet"
        closed = f"; closed: {sorted(self.stats.closed)}" if self.stats.closed else ""
        if taken > self._next_ticket:
            state = int(self._states[self._next_ticket % self.n_slots])
            cause = (f"{taken - self._next_ticket} ticket(s) taken but not published (next "
                     f"ticket {self._next_ticket}, its slot state {state}): writes into this "
                     f"ring are in flight and not completing, a progress or network problem "
                     f"between producer and learner hosts")
        else:
            cause = (f"all {taken} ticket(s) taken were delivered and no producer has tried "
                     f"to write since (stuck upstream: simulators, inference, the layout), or "
                     f"their first request never reached this host (network)")
        return f"ring ({'spans hosts' if self.spans_hosts else 'one host'}, progress " \
               f"{'thread' if self.progress.running else 'on poll'}): {cause}. {per}{closed}"

    def _check(self, header: np.ndarray, ticket: int, slot: np.ndarray) -> str | None:
        h = header[0]
        length, nparts, part = int(h["length"]), int(h["nparts"]), int(h["part"])
        if int(h["ticket"]) != ticket:
            return f"holds ticket {int(h['ticket'])} (stale or torn)"
        if length > self.capacity:
            return f"length {length} exceeds the slot payload {self.capacity}"
        if nparts and (part >= nparts or length != min(self.capacity, int(h["record_length"])
                                                      - part * self.capacity)):
            return f"fragment {part}/{nparts} of length {length} does not fit its record"
        payload = slot[SLOT_HEADER.itemsize:SLOT_HEADER.itemsize + length]
        if _slot_checksum(header, payload) != int(h["checksum"]):
            return "checksum mismatch (corrupted or torn)"
        return None

    def _assemble(self, h, fragment: np.ndarray) -> Record | None:
        producer, seq, part, nparts = int(h["producer"]), int(h["seq"]), int(h["part"]), \
            int(h["nparts"])
        if nparts == 0:
            self.stats.closed.add(producer)
            return None
        partial = self._partial.pop(producer, None)
        if nparts == 1 and partial is None:  # zero copy: a view of the slot
            return self._deliver(producer, seq, int(h["schema"]), fragment)
        if partial is not None and (partial[1] != seq or partial[2] != part):
            self.stats.dropped_records += 1
            self.report(f"discarded incomplete record {partial[1]} of producer {producer}")
            partial = None
        if partial is None:
            if part != 0:
                return None  # the start of this record was dropped; already reported
            partial = (np.empty(int(h["record_length"]), np.uint8), seq, 0)
        buf = partial[0]
        buf[part * self.capacity:part * self.capacity + fragment.nbytes] = fragment
        if part + 1 < nparts:
            self._partial[producer] = (buf, seq, part + 1)
            return None
        return self._deliver(producer, seq, int(h["schema"]), buf)

    def _deliver(self, producer: int, seq: int, schema: int, buf: np.ndarray) -> Record:
        expected = self._expected_seq.get(producer, 0)
        if seq != expected:
            self.stats.lost_records += seq - expected
            self.report(f"producer {producer}: records {expected}..{seq - 1} lost")
        self._expected_seq[producer] = seq + 1
        count = self.stats.delivered.get(producer, (0, 0.0))[0]
        self.stats.delivered[producer] = (count + 1, time.monotonic())
        self.stats.records += 1
        self.stats.bytes += buf.nbytes
        return Record(producer, seq, schema, buf)

    # ---------------------------------------------------------------- both
    def free(self) -> None:
        """Collective: release the window."""
        if self.win != MPI.WIN_NULL:
            self.progress.free()
            self.win.Unlock_all()
            self.win.Free()


def _slot_checksum(header: np.ndarray, payload: np.ndarray) -> int:
    meta = zlib.crc32(header.view(np.uint8)[8:56].tobytes())
    return (checksum64(payload) + meta) & _MASK
