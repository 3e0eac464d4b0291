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
"""

from __future__ import annotations

import struct
import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

from hpcvla.transport.backoff import DATA_POLL_CAP, DATA_SPIN, Backoff, wait_until
from hpcvla.transport.pieces import pieces as message_pieces
from hpcvla.transport.progress import MODES, ProgressAgent, spans_hosts
from hpcvla.transport.ring_stall import describe_stall
from hpcvla.transport.slots import (CHECKSUMS, LOW, MASK, PACKED, SLOT_HEADER, Packed,
                                    Record, RingStats, SlotHeader, checksum64, header_struct,
                                    as_bytes, packed_plan, unpack)


class TrajectoryRing:
    """Create collectively on `comm`; rank `root` consumes, every other rank may produce."""

    def __init__(self, comm: MPI.Comm, n_slots: int, slot_bytes: int, root: int = 0,
                 producer_id: int | None = None, report=None,
                 poll_cap: float = DATA_POLL_CAP, progress: str = "auto",
                 start_progress: bool = True, checksum: str = "auto"):
        if slot_bytes % 64 or slot_bytes <= SLOT_HEADER.itemsize or n_slots < 1:
            raise ValueError(f"ring of {n_slots} slots of {slot_bytes} bytes: need >= 1 slot "
                             "and a slot size that is a multiple of 64 and > 64")
        if progress not in MODES:
            raise ValueError(f"ring progress {progress!r}: one of {', '.join(MODES)}")
        if checksum not in CHECKSUMS:
            raise ValueError(f"ring checksum {checksum!r}: one of {', '.join(CHECKSUMS)}")
        size = comm.Get_size()
        self.producers = [r for r in range(size) if r != root] or [root]  # lane l's comm rank
        lanes = len(self.producers)
        self.lane_size = [max(1, n_slots // lanes + (lane < n_slots % lanes))
                          for lane in range(lanes)]
        self.lane_first = np.cumsum([0] + self.lane_size[:-1]).tolist()
        n_slots = sum(self.lane_size)  # more than asked only with fewer slots than lanes
        self.comm, self.root, self.n_slots, self.slot_bytes = comm, root, n_slots, slot_bytes
        self.poll_cap = poll_cap  # longest sleep between polls (see backoff.DATA_POLL_CAP)
        self.spin = DATA_SPIN  # get() yields rather than sleeps this long first (backoff.py)
        self.capacity = slot_bytes - SLOT_HEADER.itemsize
        self.is_root = comm.Get_rank() == root
        self.producer_id = MPI.COMM_WORLD.Get_rank() if producer_id is None else producer_id
        self.control_bytes = -(-16 * lanes // 64) * 64
        nbytes = self.control_bytes + n_slots * slot_bytes if self.is_root else 0
        self.win = MPI.Win.Allocate(nbytes, 1, comm=comm)  # [dist]
        if self.is_root:
            memory = np.frombuffer(self.win.tomemory(), np.uint8)
            memory[:] = 0
            control = memory[:16 * lanes].view(np.int64)
            self._freed_words, self._started_words = control[0::2], control[1::2]
            self._slots = memory[self.control_bytes:].reshape(n_slots, slot_bytes)
            self._states = self._slots[:, :8].view(np.int64)[:, 0]
            self._words = self._slots[:, :SLOT_HEADER.itemsize].view("<u8")  # (n_slots, 8)
            self._slot_lane = np.repeat(np.arange(lanes), self.lane_size)
        # collective: whether producers sit on other hosts, and the progress communicator
        self.spans_hosts = spans_hosts(comm)  # [dist]
        self.checks_payload = checksum == "always" or self.spans_hosts  # the same everywhere
        self.progress = ProgressAgent(comm)  # [dist]
        self._wants_thread = self.is_root and (
            progress == "thread" or (progress == "auto" and self.spans_hosts))
        if start_progress:
            self.start_progress()
        comm.Barrier()  # [dist] zeroed before anyone writes
        self.win.Lock_all(MPI.MODE_NOCHECK)
        # producer state: this rank's lane, its next fragment, the freed word as last read
        rank = comm.Get_rank()
        self.lane = self.producers.index(rank) if rank in self.producers else None
        self._seq = 0
        self._fragment = 0
        self._freed = 0
        self._stage = bytearray(SLOT_HEADER.itemsize)  # header (+ packed table) as sent
        self._word = np.zeros(1, np.int64)     # the state word being written
        self._started = np.zeros(1, np.int64)  # the started word being written
        self._read = np.zeros(1, np.int64)     # the freed word, as read
        # consumer state, per lane: next fragment, fragments handed back (the freed word)
        self._next = [0] * lanes
        self._handed = [0] * lanes
        self._partial: dict[int, tuple[np.ndarray, int, int]] = {}  # producer -> (buf, seq, parts)
        self._expected_seq: dict[int, int] = {}
        self._held: list[tuple[int, int]] = []  # (lane, fragment) of records handed out by poll()
        self.stats = RingStats()
        self.report = report or (lambda msg: print(f"hpcvla ring: {msg}", file=sys.stderr,
                                                   flush=True))

    # ---------------------------------------------------------------- producer side
    def put(self, record, schema: int = 0, timeout: float | None = None) -> None:
        """Write one record (bytes-like or uint8 array); blocks while this lane is full."""
        data = as_bytes(record)
        nparts = max(1, -(-data.nbytes // self.capacity))
        for part in range(nparts):
            fragment = data[part * self.capacity:(part + 1) * self.capacity]
            self._put_fragment([(0, fragment)], schema, part, nparts, data.nbytes,
                               fragment.nbytes, timeout)
        self._seq += 1

    def put_many(self, records, timeout: float | None = None) -> None:
        """Write [(record, schema)] in order, small ones packed together: one header, `Flush`
        and publish per slot, one `Put` per record (those too large to share go as `put`)."""
        records = [(as_bytes(record), schema) for record, schema in records]
        for first, end, offsets, used, table in packed_plan(
                tuple([data.nbytes for data, _ in records]),
                tuple([schema for _, schema in records]), self.capacity):
            if offsets is None:  # nothing to share the slot with: the plain format
                self.put(*records[first], timeout=timeout)
                continue
            self._put_fragment(list(zip(offsets, [data for data, _ in records[first:end]])),
                               PACKED, 0, 1, end - first, used, timeout, table)
            self._seq += end - first

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
        self._put_fragment([], 0, 0, 0, 0, 0, None)

    def slot_disp(self, lane: int, fragment: int) -> int:
        """Window displacement of the slot that lane `lane`'s fragment `fragment` goes to."""
        slot = self.lane_first[lane] + fragment % self.lane_size[lane]
        return self.control_bytes + slot * self.slot_bytes

    def _read_freed(self) -> int:
        self.win.Get([self._read, MPI.INT64_T], self.root, (16 * self.lane, 1, MPI.INT64_T))
        self.win.Flush(self.root)
        self._freed = max(self._freed, int(self._read[0]))
        return self._freed

    def _put_fragment(self, pieces, schema, part, nparts, record_length, length,
                      timeout, table=()) -> None:
        """Write one slot: `pieces` [(payload offset, uint8 array)] and `table` (a packed
        slot's u64 words at the payload's start, sent with the header), `length` bytes."""
        if self.lane is None:
            raise RuntimeError("the ring's consumer cannot write into its own ring")
        win, root, f = self.win, self.root, self._fragment
        size = self.lane_size[self.lane]
        if f - size >= self._freed:  # the slot's previous fragment not known to be freed
            wait_until(lambda: self._read_freed() > f - size,
                       f"ring lane {self.lane} slot {f % size} to be freed", timeout,
                       cap=self.poll_cap)
        disp = self.slot_disp(self.lane, f)
        # header words 1..6, the checksum word, then the table: one Put from header byte 8 on
        head = SLOT_HEADER.itemsize + 8 * len(table)
        if len(self._stage) < head:
            self._stage = bytearray(head)
        stage = self._stage
        header_struct(len(table)).pack_into(
            stage, 8, f, (self.producer_id & LOW) | (schema << 32), self._seq,
            part | (nparts << 32), length, record_length, *table)
        checked = sum(map(checksum64, ([np.frombuffer(stage, np.uint8, 8 * len(table), 64)]
                                       if table else []) + [piece for _, piece in pieces])) \
            if self.checks_payload else 0
        struct.pack_into("<Q", stage, 56, (checked + zlib.crc32(stage[8:56])) & MASK)
        if part == 0 and self.spans_hosts:  # for stall reports: these fragments are under
            # way (a Put to a ring on this host completes before the publish, never lingers)
            self._started[0] = f + max(nparts, 1)
            win.Put([self._started, MPI.INT64_T], root, (16 * self.lane + 8, 1, MPI.INT64_T))
        win.Put(memoryview(stage)[8:head], root, (disp + 8, head - 8, MPI.BYTE))
        for at, piece in pieces:  # a slot may pass what one MPI call moves (pieces.py)
            for start, n in message_pieces(piece.nbytes):
                win.Put(piece[start:start + n], root,
                        (disp + SLOT_HEADER.itemsize + at + start, n, MPI.BYTE))
        win.Flush(root)  # payload complete at the target before it is published
        self._word[0] = f + 1
        win.Put([self._word, MPI.INT64_T], root, (disp, 1, MPI.INT64_T))
        win.Flush(root)
        self._fragment = f + 1

    # ---------------------------------------------------------------- consumer side
    def poll(self, limit: int | None = None) -> list[Record]:
        """Records completed since the last call (never blocks).

        Zero copy: a record that fits one slot is a view into the window, valid until the next
        `poll`/`get`/`release`, which hand its slot back to the producers. Copy what you keep.
        """
        self._held.clear()  # handed back with the freed words below
        out: list[Record] = []
        self.progress.poke()  # completes what remote producers have in flight
        self.win.Sync()
        runs = []  # per lane, the run of consecutive published fragments
        for lane, first in enumerate(self._next):
            size, base, f = self.lane_size[lane], self.lane_first[lane], first
            while f - first < size and int(self._states[base + f % size]) == f + 1:
                f += 1
            if f > first:
                runs.append((lane, first, f))
        if runs:
            self.win.Sync()  # read the payloads only after seeing their states
        for lane, first, end in runs:
            for f in range(first, end):
                if limit is not None and len(out) >= limit:
                    break
                self._next[lane] = f + 1
                out += self._consume(lane, f)
        self._hand_back()
        return out

    def _consume(self, lane: int, f: int) -> list[Record]:
        slot_index = self.lane_first[lane] + f % self.lane_size[lane]
        slot = self._slots[slot_index]
        h = SlotHeader.read(slot)
        payload = slot[SLOT_HEADER.itemsize:SLOT_HEADER.itemsize + h.length]
        packed = unpack(payload, h.record_length) if h.schema == PACKED else None
        problem = packed if isinstance(packed, str) else self._check(h, f, slot, packed)
        if problem:
            self.stats.bad_slots += 1
            self.report(f"dropped slot {slot_index} (lane of comm rank {self.producers[lane]}, "
                        f"fragment {f}; claims producer {h.producer}, seq {h.seq}): {problem}")
            return []
        if packed is not None:
            records = self._unpacked(h, payload, packed)
        else:
            record = self._assemble(h, payload)
            records = [] if record is None else [record]
        if records and h.nparts == 1:
            self._held.append((lane, f))  # views of this slot: freed by the next poll
        return records

    def release(self) -> None:
        """Hand the slots of the records returned by the last poll back to the producers."""
        self._held.clear()
        self._hand_back()

    def _hand_back(self) -> None:
        """Per lane, store the oldest fragment still held (or the next unread) into the freed
        word: one store frees every slot of the lane consumed since the last one."""
        freed = list(self._next)
        for lane, f in self._held:
            freed[lane] = min(freed[lane], f)
        changed = [(lane, w) for lane, w in enumerate(freed) if w > self._handed[lane]]
        if changed:
            self.win.Sync()  # done reading those slots before producers may overwrite them
            for lane, w in changed:
                self._freed_words[lane] = self._handed[lane] = w
            self.win.Sync()

    def get(self, timeout: float | None = None) -> list[Record]:
        """At least one record, waiting with back-off (WaitTimeout past `timeout`); or none if
        a producer closed meanwhile, so a consumer waiting for the last close never waits for
        a record that will not come."""
        backoff = Backoff(timeout=timeout, cap=self.poll_cap, spin=self.spin,
                          what="a record in the trajectory ring")
        closed = len(self.stats.closed)
        while True:
            records = self.poll()
            if records or len(self.stats.closed) > closed:
                return records
            backoff.wait()

    def occupancy(self) -> tuple[int, int]:
        """(slots holding published records not yet freed, lanes that are full: their
        producers wait for the learner). The first is at most n_slots: memory is bounded."""
        self.win.Sync()
        used = self._states > np.asarray(self._handed)[self._slot_lane]  # f + 1 with f >= W
        per_lane = np.bincount(self._slot_lane[used], minlength=len(self.producers))
        return int(used.sum()), int(np.count_nonzero(per_lane == np.asarray(self.lane_size)))

    def diagnose(self, producers=()) -> str:
        """Why nothing arrives, for a stall message (ring_stall.py)."""
        return describe_stall(self, producers)

    def _check(self, h: SlotHeader, fragment: int, slot: np.ndarray, packed) -> str | None:
        length, part, nparts = h.length, h.part, h.nparts
        if h.fragment != fragment:
            return f"holds fragment {h.fragment} (stale or torn)"
        if length > self.capacity:
            return f"length {length} exceeds the slot payload {self.capacity}"
        if packed is not None and (part, nparts) != (0, 1):
            return f"a packed slot claims fragment {part}/{nparts}"
        if packed is None and nparts and (part >= nparts or length != min(
                self.capacity, h.record_length - part * self.capacity)):
            return f"fragment {part}/{nparts} of length {length} does not fit its record"
        checked = 0
        if self.checks_payload:
            payload = slot[SLOT_HEADER.itemsize:SLOT_HEADER.itemsize + length]
            checked = sum(map(checksum64, [payload] if packed is None else [
                payload[:16 * h.record_length]] + [payload[at:at + n]
                                                   for at, n, _ in packed.records]))
        if (checked + zlib.crc32(slot[8:56])) & MASK != h.checksum:
            return "checksum mismatch (corrupted or torn)"
        return None

    def _unpacked(self, h: SlotHeader, payload: np.ndarray, packed: Packed) -> list[Record]:
        producer, seq = h.producer, h.seq
        partial = self._partial.pop(producer, None)
        if partial is not None:
            self.stats.dropped_records += 1
            self.report(f"discarded incomplete record {partial[1]} of producer {producer}")
        self._count(producer, seq, len(packed.records), packed.nbytes)
        new = tuple.__new__  # NamedTuple's own __new__ is Python, a call per record
        return [new(Record, (producer, seq + i, schema, payload[at:at + n]))
                for i, (at, n, schema) in enumerate(packed.records)]

    def _assemble(self, h: SlotHeader, fragment: np.ndarray) -> Record | None:
        producer, schema, seq, part, nparts = h.producer, h.schema, h.seq, h.part, h.nparts
        if nparts == 0:
            self.stats.closed.add(producer)
            return None
        partial = self._partial.pop(producer, None)
        if nparts == 1 and partial is None:  # zero copy: a view of the slot
            return self._deliver(producer, seq, schema, fragment)
        if partial is not None and (partial[1] != seq or partial[2] != part):
            self.stats.dropped_records += 1
            self.report(f"discarded incomplete record {partial[1]} of producer {producer}")
            partial = None
        if partial is None:
            if part != 0:
                return None  # the start of this record was dropped; already reported
            partial = (np.empty(h.record_length, np.uint8), seq, 0)
        buf = partial[0]
        buf[part * self.capacity:part * self.capacity + fragment.nbytes] = fragment
        if part + 1 < nparts:
            self._partial[producer] = (buf, seq, part + 1)
            return None
        return self._deliver(producer, seq, schema, buf)

    def _deliver(self, producer: int, seq: int, schema: int, buf: np.ndarray) -> Record:
        self._count(producer, seq, 1, buf.nbytes)
        return Record(producer, seq, schema, buf)

    def _count(self, producer: int, seq: int, records: int, nbytes: int) -> None:
        """Account for `records` records of `producer` from `seq` on (a packed slot's at
        once): a gap before `seq` is counted as lost."""
        expected = self._expected_seq.get(producer, 0)
        if seq != expected:
            self.stats.lost_records += seq - expected
            self.report(f"producer {producer}: records {expected}..{seq - 1} lost")
        self._expected_seq[producer] = seq + records
        count = self.stats.delivered.get(producer, (0, 0.0))[0]
        self.stats.delivered[producer] = (count + records, time.monotonic())
        self.stats.records += records
        self.stats.bytes += nbytes

    # ---------------------------------------------------------------- both
    def free(self) -> None:
        """Collective: release the window."""
        if self.win != MPI.WIN_NULL:
            self.progress.free()  # [dist]
            self.win.Unlock_all()
            self.win.Free()  # [dist]

