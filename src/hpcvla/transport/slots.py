"""The trajectory ring's slot format (ring.py): a 64-byte header of eight little-endian words
before each slot's payload, and the checksums that guard them.

Slot checksum word = checksum64(payload) + crc32(header bytes 8..56), mod 2**64; a ring that
does not check payloads (`learner.ring_checksum=auto` on one host) stores the crc32 alone.
"""

from __future__ import annotations

import zlib

import numpy as np

SLOT_HEADER = np.dtype([
    ("state", "<i8"),          # publish word: f + 1 once fragment f is in, 0 never used
    ("ticket", "<i8"),         # lane fragment number f of this content (stale/torn slots)
    ("producer", "<i4"),       # producer id (its world rank)
    ("schema", "<u4"),         # record schema id (see records.schema_of), 0 = raw bytes
    ("seq", "<i8"),            # per-producer record sequence number, from 0
    ("part", "<u4"),           # fragment index
    ("nparts", "<u4"),         # fragments in the record; 0 = producer closed
    ("length", "<u8"),         # payload bytes in this slot
    ("record_length", "<u8"),  # bytes of the whole record
    ("checksum", "<u8"),       # checksum64(payload) + crc32(header bytes 8..56), mod 2**64
])                             # (without payload checks: the crc32 alone)
CHECKSUMS = ("auto", "always")
# Both sides handle the header as its 8 little-endian words (a structured-array assignment
# costs more than the rest of a small put): state, ticket, producer | schema << 32, seq,
# part | nparts << 32, length, record_length, checksum.
assert SLOT_HEADER.itemsize == 64
MASK, LOW = (1 << 64) - 1, (1 << 32) - 1


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


def slot_checksum(header: np.ndarray, payload: np.ndarray) -> int:
    """The checksum word of a slot holding `header` (a SLOT_HEADER item) and `payload`."""
    return (checksum64(payload) + zlib.crc32(header.view(np.uint8)[8:56])) & MASK


def signed64(word: int) -> int:
    return word - (1 << 64) if word >> 63 else word


def signed32(word: int) -> int:
    return word - (1 << 32) if word >> 31 else word
