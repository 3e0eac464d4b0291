"""The learner's side of the trajectory ring (ring.py has the protocol): per lane the next
fragment to read and the freed word as last stored, the records being reassembled, and what
was delivered, dropped and lost."""

from __future__ import annotations

import sys
import time
import zlib
from collections.abc import Callable, Iterable

import numpy as np

from hpcvla.transport.backoff import DATA_SPIN, Backoff
from hpcvla.transport.ring_window import RingWindow
from hpcvla.transport.slots import (MASK, PACKED, SLOT_HEADER, Packed, Record, RingStats,
                                    SlotHeader, checksum64, unpack)
from hpcvla.transport.windows import window_bytes


class RingDamaged(RuntimeError):
    """Records written into the ring did not arrive whole (RingReader.check_intact)."""


class RingReader:
    """Reads every lane of `ring` from the root's own memory, in order, and frees slots."""

    def __init__(self, ring: RingWindow, report: Callable[[str], None] | None = None):
        self.ring = ring
        lanes = len(ring.producers)
        memory = window_bytes(ring.win.tomemory())
        control = memory[:16 * lanes].view(np.int64)
        self.freed_words, self.started_words = control[0::2], control[1::2]
        self.slots = memory[ring.control_bytes:].reshape(ring.n_slots, ring.slot_bytes)
        self.states = self.slots[:, :8].view(np.int64)[:, 0]
        self.words = self.slots[:, :SLOT_HEADER.itemsize].view("<u8")  # (n_slots, 8)
        self._slot_lane = np.repeat(np.arange(lanes), ring.lane_size)
        self.spin = DATA_SPIN  # get() yields rather than sleeps this long first (backoff.py)
        self.next = [0] * lanes     # per lane, the next fragment to read
        self._handed = [0] * lanes  # per lane, the freed word as last stored
        self._partial: dict[int, tuple[np.ndarray, int, int]] = {}  # producer -> (buf, seq, parts)
        self._expected_seq: dict[int, int] = {}
        self._held: list[tuple[int, int]] = []  # (lane, fragment) of records handed out by poll()
        self.stats = RingStats()
        self.report = report or (lambda msg: print(f"hpcvla ring: {msg}", file=sys.stderr,
                                                   flush=True))

    def poll(self, limit: int | None = None) -> list[Record]:
        """Records completed since the last call (never blocks).

        Zero copy: a record that fits one slot is a view into the window, valid until the next
        `poll`/`get`/`release`, which hand its slot back to the producers. Copy what you keep.
        """
        ring = self.ring
        self._held.clear()  # handed back with the freed words below
        out: list[Record] = []
        ring.progress.poke()  # completes what remote producers have in flight
        ring.win.Sync()
        runs = []  # per lane, the run of consecutive published fragments
        for lane, first in enumerate(self.next):
            size, base, f = ring.lane_size[lane], ring.lane_first[lane], first
            while f - first < size and int(self.states[base + f % size]) == f + 1:
                f += 1
            if f > first:
                runs.append((lane, first, f))
        if runs:
            ring.win.Sync()  # read the payloads only after seeing their states
        for lane, first, end in runs:
            for f in range(first, end):
                if limit is not None and len(out) >= limit:
                    break
                self.next[lane] = f + 1
                out += self._consume(lane, f)
        self._hand_back()
        return out

    def get(self, timeout: float | None = None) -> list[Record]:
        """At least one record, waiting with back-off (WaitTimeout past `timeout`); or none if
        a producer closed meanwhile, so a consumer waiting for the last close never waits for
        a record that will not come."""
        backoff = Backoff(timeout=timeout, cap=self.ring.poll_cap, spin=self.spin,
                          what="a record in the trajectory ring")
        closed = len(self.stats.closed)
        while True:
            records = self.poll()
            if records or len(self.stats.closed) > closed:
                return records
            backoff.wait()

    def release(self) -> None:
        """Hand the slots of the records returned by the last poll back to the producers."""
        self._held.clear()
        self._hand_back()

    def check_intact(self) -> None:
        """Raise RingDamaged if a slot failed its check or a record went missing. A consumer
        that needs every record (a learner's batch takes an exact quota from each producer)
        calls it after each poll: a batch missing one can never complete, so its wait would
        end only at the stall timeout, with a diagnosis that misses the cause."""
        s = self.stats
        if s.bad_slots or s.dropped_records or s.lost_records:
            raise RingDamaged(f"the trajectory ring dropped {s.bad_slots} slot(s) that failed "
                              f"their check, {s.dropped_records} partly received record(s), "
                              f"and lost {s.lost_records} record(s) (reported above): a "
                              "batch missing a record can never complete, and one-sided "
                              "transfers into this rank did not deliver what was written "
                              "(check this MPI and network with `hpcvla bench transport`)")

    def occupancy(self) -> tuple[int, int]:
        """(slots holding published records not yet freed, lanes that are full: their
        producers wait for the learner). The first is at most n_slots: memory is bounded."""
        self.ring.win.Sync()
        used = self.states > np.asarray(self._handed)[self._slot_lane]  # f + 1 with f >= W
        per_lane = np.bincount(self._slot_lane[used], minlength=len(self.ring.producers))
        return int(used.sum()), int(np.count_nonzero(per_lane == np.asarray(self.ring.lane_size)))

    def diagnose(self, producers: Iterable[int] = ()) -> str:
        """Why nothing arrives, for a stall message: what each producer delivered and when,
        and whether fragments were started but never published (their payloads are stuck in
        transit: a progress or network problem; producers mark them started only when the ring
        spans hosts) or nothing was even started (the producers are stuck upstream)."""
        ring, stats = self.ring, self.stats
        ring.win.Sync()
        now = time.monotonic()
        seen = sorted(set(producers) | set(stats.delivered))
        per = "; ".join(
            f"producer rank {p}: {n} records, last {now - t:.0f} s ago" if n else
            f"producer rank {p}: nothing" for p, (n, t) in
            ((p, stats.delivered.get(p, (0, 0.0))) for p in seen)) or "no producer yet"
        closed = f"; closed: {sorted(stats.closed)}" if stats.closed else ""
        stuck = [(ring.producers[lane], int(started) - self.next[lane])
                 for lane, started in enumerate(self.started_words)
                 if started > self.next[lane]]
        if stuck:
            cause = (f"{sum(n for _, n in stuck)} fragment(s) started but not published ("
                     + ", ".join(f"{n} in the lane of comm rank {r}" for r, n in stuck)
                     + "): writes into this ring are in flight and not completing, a "
                     "progress or network problem between producer and learner hosts")
        else:
            cause = (f"all {sum(self.next)} fragment(s) started were delivered and no "
                     f"producer has tried to write since (stuck upstream: simulators — an "
                     f"inference rank names above any that stopped asking —, inference, "
                     f"the layout), or their first request never reached this "
                     f"host (network)")
        agent = ring.progress
        how = "thread" if agent.running else f"on poll, its thread failed: {agent.error!r}" \
            if agent.error else "on poll"
        return f"ring ({'spans hosts' if ring.spans_hosts else 'one host'}, progress " \
               f"{how}): {cause}. {per}{closed}"

    def _hand_back(self) -> None:
        """Per lane, store the oldest fragment still held (or the next unread) into the freed
        word: one store frees every slot of the lane consumed since the last one."""
        freed = list(self.next)
        for lane, f in self._held:
            freed[lane] = min(freed[lane], f)
        changed = [(lane, w) for lane, w in enumerate(freed) if w > self._handed[lane]]
        if changed:
            self.ring.win.Sync()  # done reading those slots before producers may overwrite them
            for lane, w in changed:
                self.freed_words[lane] = self._handed[lane] = w
            self.ring.win.Sync()

    def _consume(self, lane: int, f: int) -> list[Record]:
        slot_index = self.ring.slot_index(lane, f)
        slot = self.slots[slot_index]
        h = SlotHeader.read(slot)
        payload = slot[SLOT_HEADER.itemsize:SLOT_HEADER.itemsize + h.length]
        packed = unpack(payload, h.record_length) if h.schema == PACKED else None
        problem = packed if isinstance(packed, str) else self._check(h, f, slot, packed)
        if problem:
            self.stats.bad_slots += 1
            self.report(f"dropped slot {slot_index} (lane of comm rank "
                        f"{self.ring.producers[lane]}, fragment {f}; claims producer "
                        f"{h.producer}, seq {h.seq}): {problem}")
            return []
        if isinstance(packed, Packed):  # (a str is a problem, returned above)
            records = self._unpacked(h, payload, packed)
        else:
            record = self._assemble(h, payload)
            records = [] if record is None else [record]
        if records and h.nparts == 1:
            self._held.append((lane, f))  # views of this slot: freed by the next poll
        return records

    def _check(self, h: SlotHeader, fragment: int, slot: np.ndarray,
               packed: Packed | None) -> str | None:
        length, part, nparts, capacity = h.length, h.part, h.nparts, self.ring.capacity
        if h.fragment != fragment:
            return f"holds fragment {h.fragment} (stale or torn)"
        if length > capacity:
            return f"length {length} exceeds the slot payload {capacity}"
        if packed is not None and (part, nparts) != (0, 1):
            return f"a packed slot claims fragment {part}/{nparts}"
        if packed is None and nparts and (part >= nparts or length != min(
                capacity, h.record_length - part * capacity)):
            return f"fragment {part}/{nparts} of length {length} does not fit its record"
        checked = 0
        if self.ring.checks_payload:
            payload = slot[SLOT_HEADER.itemsize:SLOT_HEADER.itemsize + length]
            checked = sum(map(checksum64, [payload] if packed is None else [
                payload[:16 * h.record_length]] + [payload[at:at + n]
                                                   for at, n, _ in packed.records]))
        # numpy's stub gives ndarray the buffer protocol (__buffer__) on Python 3.12+ only
        if (checked + zlib.crc32(slot[8:56])) & MASK != h.checksum:  # type: ignore[arg-type]
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
        capacity = self.ring.capacity
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
        buf[part * capacity:part * capacity + fragment.nbytes] = fragment
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
