"""A producing rank's side of the trajectory ring (ring.py has the protocol): its lane, its
next fragment and record, and the lane's freed word as last read from the learner."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import numpy as np
from mpi4py import MPI

from hpcvla.transport.backoff import Reminder, wait_until
from hpcvla.transport.pieces import pieces as message_pieces
from hpcvla.transport.ring_window import RingWindow
from hpcvla.transport.slots import (LOW, MASK, PACKED, SLOT_HEADER, RecordData, as_bytes,
                                    checksum64, header_struct, packed_plan)


class RingWriter:
    """Writes this rank's records into its lane of `ring`, in order; blocks while it is full."""

    def __init__(self, ring: RingWindow, lane: int, producer_id: int):
        self.ring, self.lane, self.producer_id = ring, lane, producer_id
        self.size = ring.lane_size[lane]
        self._seq = 0       # the next record's number
        self._fragment = 0  # the next fragment's number in this lane
        self._freed = 0     # the lane's freed word, as last read
        self._stage = bytearray(SLOT_HEADER.itemsize)  # header (+ packed table) as sent
        self._word = np.zeros(1, np.int64)     # the state word being written
        self._started = np.zeros(1, np.int64)  # the started word being written
        self._read = np.zeros(1, np.int64)     # the freed word, as read
        self.remind: Reminder | None = None  # said while a full lane holds a put up
        # the context a wait for a full lane runs in (the rank's timeline span)
        self.waiting: Callable[[], AbstractContextManager[object]] = nullcontext

    def put(self, record: RecordData, schema: int = 0, timeout: float | None = None) -> None:
        """Write one record (bytes-like or uint8 array); blocks while this lane is full."""
        data = as_bytes(record)
        capacity = self.ring.capacity
        nparts = max(1, -(-data.nbytes // capacity))
        for part in range(nparts):
            fragment = data[part * capacity:(part + 1) * capacity]
            self._put_fragment([(0, fragment)], schema, part, nparts, data.nbytes,
                               fragment.nbytes, timeout)
        self._seq += 1

    def put_many(self, records: Iterable[tuple[RecordData, int]],
                 timeout: float | None = None) -> None:
        """Write [(record, schema)] in order, small ones packed together: one header, `Flush`
        and publish per slot, one `Put` per record (those too large to share go as `put`)."""
        pairs = [(as_bytes(record), schema) for record, schema in records]
        for first, end, offsets, used, table in packed_plan(
                tuple([data.nbytes for data, _ in pairs]),
                tuple([schema for _, schema in pairs]), self.ring.capacity):
            if offsets is None:  # nothing to share the slot with: the plain format
                self.put(*pairs[first], timeout=timeout)
                continue
            self._put_fragment(list(zip(offsets, [data for data, _ in pairs[first:end]])),
                               PACKED, 0, 1, end - first, used, timeout, table)
            self._seq += end - first

    def close(self) -> None:
        """Tell the consumer this producer is done (after all its records)."""
        self._put_fragment([], 0, 0, 0, 0, 0, None)

    def _read_freed(self) -> int:
        win, root = self.ring.win, self.ring.root
        win.Get([self._read, MPI.INT64_T], root, (16 * self.lane, 1, MPI.INT64_T))
        win.Flush(root)
        # The learner stores the word while this Get reads it: aligned 8-byte accesses are
        # whole on the fabrics and CPUs hpcvla runs on, but MPI does not promise it, and a torn
        # value above what this rank wrote would free slots not yet read. Never believed.
        read = int(self._read[0])
        if read <= self._fragment:
            self._freed = max(self._freed, read)
        return self._freed

    def _put_fragment(self, pieces: list[tuple[int, np.ndarray]], schema: int, part: int,
                      nparts: int, record_length: int, length: int, timeout: float | None,
                      table: tuple[int, ...] = ()) -> None:
        """Write one slot: `pieces` [(payload offset, uint8 array)] and `table` (a packed
        slot's u64 words at the payload's start, sent with the header), `length` bytes."""
        ring, f, size = self.ring, self._fragment, self.size
        win, root = ring.win, ring.root
        # the slot's previous fragment not known to be freed, nor freed now: a wait
        if f - size >= self._freed and self._read_freed() <= f - size:
            with self.waiting():
                wait_until(lambda: self._read_freed() > f - size,
                           f"ring lane {self.lane} slot {f % size} to be freed", timeout,
                           cap=ring.poll_cap, remind=self.remind)
        disp = ring.slot_disp(self.lane, f)
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
            if ring.checks_payload else 0
        struct.pack_into("<Q", stage, 56, (checked + zlib.crc32(stage[8:56])) & MASK)
        if part == 0 and ring.spans_hosts:  # for stall reports: these fragments are under
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
