"""The trajectory ring's slot format (ring.py): a 64-byte header of eight little-endian words
before each slot's payload, the checksums that guard them, packed slots, and what the ring
hands out (Record) and counts (RingStats).

Slot checksum word = checksum64(payload) + crc32(header bytes 8..56), mod 2**64 (a packed
slot: the sum of checksum64 over its table and over each record); a ring that does not check
payloads (`learner.ring_checksum=auto` on one host) stores the crc32 alone.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple, TypeAlias

import numpy as np
from hpcvla.transport.records import aligned

SLOT_HEADER = np.dtype([
    ("state", "<i8"),          # publish word: f + 1 once fragment f is in, 0 never used
    ("fragment", "<i8"),       # lane fragment number f of this content (stale/torn slots)
    ("producer", "<i4"),       # producer id (its world rank)
    ("schema", "<u4"),         # record schema id (see records.schema_of), 0 = raw bytes
    ("seq", "<i8"),            # per-producer record sequence number, from 0
    ("part", "<u4"),           # fragment index
    ("nparts", "<u4"),         # fragments in the record; 0 = producer closed
    ("length", "<u8"),         # payload bytes in this slot
    ("record_length", "<u8"),  # bytes of the whole record (packed slot: records in it)
    ("checksum", "<u8"),       # checksum64(payload) + crc32(header bytes 8..56), mod 2**64
])                             # (without payload checks: the crc32 alone)
# Both sides handle the header with struct (a structured-array assignment costs more than the
# rest of a small put): a producer packs words 1..6 (header_struct: fragment, producer |
# schema << 32, seq, part | nparts << 32, length, record_length), the learner reads the
# header by name (SlotHeader.read, one unpack).
assert SLOT_HEADER.itemsize == 64
MASK, LOW = (1 << 64) - 1, (1 << 32) - 1
_HEADER = struct.Struct("<qqiIqIIQQQ")  # SLOT_HEADER's fields, in order
assert _HEADER.size == SLOT_HEADER.itemsize


class SlotHeader(NamedTuple):
    """A slot header's fields (SLOT_HEADER)."""
    state: int
    fragment: int
    producer: int
    schema: int
    seq: int
    part: int
    nparts: int
    length: int
    record_length: int
    checksum: int

    @staticmethod
    def read(slot: np.ndarray) -> "SlotHeader":
        """The header at the start of `slot` (a buffer: the slot's bytes)."""
        # tuple.__new__: NamedTuple's own __new__ is Python, and this runs once per slot.
        # (numpy's stub gives ndarray the buffer protocol, __buffer__, on Python 3.12+ only)
        return tuple.__new__(SlotHeader, _HEADER.unpack_from(slot))  # type: ignore[arg-type]


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
    closed: set[int] = field(default_factory=set)
    # per producer: (records delivered, time.monotonic() of the last one), for stall reports
    delivered: dict[int, tuple[int, float]] = field(default_factory=dict)


@lru_cache(maxsize=64)
def header_struct(table_words: int) -> struct.Struct:
    """How a producer writes header words 1..6, the checksum word's gap, then a packed slot's
    table of `table_words` words (struct, not numpy: a numpy assignment costs more than the
    Put that sends it)."""
    return struct.Struct(f"<6Q8x{table_words}Q")


def checksum64(payload: np.ndarray) -> int:
    """Sum of the payload's little-endian 64-bit words, plus its length, mod 2**64. Any single
    changed word or bit, a torn (half old, half new) or truncated payload changes it; it is not
    cryptographic. One pass at memory bandwidth, so it costs a fraction of the Put it guards."""
    n = payload.nbytes
    cut = n - n % 8
    total = int(np.add.reduce(payload[:cut].view(np.uint64))) + n
    if cut < n:
        total += int.from_bytes(payload[cut:].tobytes(), "little")
    return total & MASK


# A slot may pack several small records (RingWriter.put_many): its header's schema is
# PACKED, seq the first record's, record_length their count; its payload is a table of
# (length, schema) u64 pairs, then each record at the next 64-byte aligned offset.
PACKED = LOW


def packed_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where records of these sizes start in a packed slot's payload, and the payload bytes
    they use: the table first, then each record at the next 64-byte aligned offset."""
    offsets, at, end = [], table_bytes(len(sizes)), 0
    for n in sizes:  # (aligned() inlined: this runs per record on both sides)
        offsets.append(at)
        end = at + n
        at = (end + 63) & -64
    return offsets, end if sizes else at


def table_bytes(count: int) -> int:
    """Bytes a packed slot's table of `count` records takes, padding to the first record."""
    return aligned(16 * count)


def packed_groups(sizes: list[int], capacity: int) -> list[tuple[int, int]]:
    """Split records of these sizes, in order, into runs [first, end) that share a slot of
    `capacity` payload bytes (packed_offsets' layout, kept as it goes); a record too large to
    share one is a run of its own (sent in the plain format, fragmented if need be)."""
    groups, first, end = [], 0, 0  # end: where the run's records end, past its table
    for i, n in enumerate(sizes):
        if i > first and table_bytes(i - first + 1) + ((end + 63) & -64) + n > capacity:
            groups.append((first, i))
            first = i
        end = n if i == first else ((end + 63) & -64) + n
        if i == first and table_bytes(1) + n > capacity:
            groups.append((i, i + 1))
            first = i + 1
    if first < len(sizes):
        groups.append((first, len(sizes)))
    return groups


# put_many's plan for one slot: (first, end, offsets or None, payload bytes used, table words)
PackedSlot: TypeAlias = tuple[int, int, tuple[int, ...] | None, int, tuple[int, ...]]


@lru_cache(maxsize=256)
def packed_plan(sizes: tuple[int, ...], schemas: tuple[int, ...],
                capacity: int) -> tuple[PackedSlot, ...]:
    """put_many's slots for records of these sizes and schemas, in order: per slot (first,
    end, offsets, payload bytes used, table words), offsets None for a record that goes alone
    in the plain format. Cached: a producer hands over records of the same shapes again and
    again, and working this out in Python cost as much as a slot's MPI calls."""
    plan: list[PackedSlot] = []
    for first, end in packed_groups(list(sizes), capacity):
        if end - first == 1:
            plan.append((first, end, None, 0, ()))
            continue
        offsets, used = packed_offsets(list(sizes[first:end]))
        table = tuple(w for pair in zip(sizes[first:end], schemas[first:end]) for w in pair)
        plan.append((first, end, tuple(offsets), used, table))
    return tuple(plan)


class Packed(NamedTuple):
    # ((offset, length, schema), ...) of the records in a packed payload
    records: tuple[tuple[int, int, int], ...]
    nbytes: int     # their lengths' sum


def unpack(payload: np.ndarray, count: int) -> Packed | str:
    """Where the records packed in `payload` are, or what is wrong."""
    if count < 1 or table_bytes(count) > payload.nbytes:
        return f"a table of {count} packed records does not fit {payload.nbytes} bytes"
    return _layout(payload[:16 * count].tobytes(), payload.nbytes)


@lru_cache(maxsize=256)  # the consumer's side of packed_plan's cache: same tables, same answer
def _layout(table: bytes, nbytes: int) -> Packed | str:
    words = struct.unpack(f"<{len(table) // 8}Q", table)  # length, schema, length, ...
    lengths = words[0::2]
    offsets, used = packed_offsets(lengths)
    if used != nbytes:
        return f"packed records end at {used}, the slot says {nbytes}"
    return Packed(tuple(zip(offsets, lengths, words[1::2])), sum(lengths))


# A record as the ring takes it: bytes-like, or an array (records.encode gives uint8)
RecordData: TypeAlias = np.ndarray | bytes | bytearray | memoryview


def as_bytes(record: RecordData) -> np.ndarray:
    """A record (bytes-like or array) as a flat uint8 array, without a copy."""
    if type(record) is np.ndarray and record.dtype == np.uint8 and record.ndim == 1:
        return record  # what encode() gives: no view to make
    return np.frombuffer(record, np.uint8) if not isinstance(record, np.ndarray) \
        else record.reshape(-1).view(np.uint8)
