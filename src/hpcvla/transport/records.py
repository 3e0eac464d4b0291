"""The binary layout of a record: a named set of numpy arrays, self-describing, never pickled.

A record (e.g. one trajectory segment) is encoded into one contiguous little-endian byte
buffer:

    offset 0   RecordHeader   magic "HVR1" (u4), field count (u4), schema (u4),
                              metadata CRC-32 (u4), total length in bytes (u8)
    offset 24  FieldEntry[n]  name (32 bytes, UTF-8, NUL padded), dtype (8 bytes, numpy
                              `dtype.str`, e.g. "<f4", "|u1"), ndim (u4), pad (u4),
                              shape (6 x u8), offset of the data from the record start (u8),
                              nbytes (u8)
    then       field data     each field C-contiguous, starting at a multiple of 64 bytes

`schema` is a CRC-32 of the field names, dtypes and trailing shapes (everything but each
field's leading dimension), so a consumer can tell records of the same kind apart from others
without decoding them. The metadata CRC-32 covers the header and the field table, so damaged
metadata is refused instead of read as wrong shapes or offsets (the payload is guarded where
it travels: the trajectory ring checksums every slot's header, and its payload where the ring
spans hosts or learner.ring_checksum=always). Only plain numeric/bool dtypes are
accepted: object arrays (which would need pickle) are refused.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

MAGIC = 0x31525648  # b"HVR1" read as little-endian u4
MAX_DIMS = 6
ALIGN = 64

RECORD_HEADER = np.dtype([("magic", "<u4"), ("n_fields", "<u4"), ("schema", "<u4"),
                          ("meta_crc", "<u4"), ("length", "<u8")])
FIELD_ENTRY = np.dtype([("name", "S32"), ("dtype", "S8"), ("ndim", "<u4"), ("pad", "<u4"),
                        ("shape", "<u8", (MAX_DIMS,)), ("offset", "<u8"), ("nbytes", "<u8")])


class RecordError(ValueError):
    """A buffer that is not a valid record, or arrays that cannot be encoded as one."""


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of 64 bytes (a cache line; the alignment of every field,
    slot and weight tensor in the transport)."""
    return -(-n // ALIGN) * ALIGN


def schema_of(arrays: dict[str, np.ndarray]) -> int:
    """CRC-32 of names, dtypes and trailing shapes: equal for records of the same kind."""
    text = ";".join(f"{name}:{np.asarray(a).dtype.str}:{np.shape(a)[1:]}"
                    for name, a in arrays.items())
    return zlib.crc32(text.encode())


def encoded_size(arrays: dict[str, np.ndarray]) -> int:
    size = aligned(RECORD_HEADER.itemsize + FIELD_ENTRY.itemsize * len(arrays))
    for a in arrays.values():
        size += aligned(np.asarray(a).nbytes)
    return size


def encode(arrays: dict[str, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """Encode into `out` (a uint8 buffer at least `encoded_size` long) or a new buffer;
    returns the uint8 view of exactly the record's bytes."""
    size = encoded_size(arrays)
    if out is None:
        out = np.empty(size, np.uint8)
    if out.nbytes < size:
        raise RecordError(f"output buffer of {out.nbytes} bytes, record needs {size}")
    buf = out[:size]
    header = buf[:RECORD_HEADER.itemsize].view(RECORD_HEADER)[0]
    table = buf[RECORD_HEADER.itemsize:RECORD_HEADER.itemsize + FIELD_ENTRY.itemsize
                * len(arrays)].view(FIELD_ENTRY)
    offset = aligned(RECORD_HEADER.itemsize + FIELD_ENTRY.itemsize * len(arrays))
    buf[RECORD_HEADER.itemsize + table.nbytes:offset] = 0
    for entry, (name, value) in zip(table, arrays.items()):
        a = np.asarray(value)
        if a.dtype.hasobject or a.dtype.kind not in "biufc" or a.ndim > MAX_DIMS:
            raise RecordError(f"field {name!r}: dtype {a.dtype} with {a.ndim} dims cannot be "
                              f"encoded (numeric or bool, at most {MAX_DIMS} dims)")
        raw_name = name.encode()
        if len(raw_name) > 32:
            raise RecordError(f"field name {name!r} is longer than 32 bytes")
        entry["name"], entry["dtype"], entry["ndim"], entry["pad"] = (
            raw_name, a.dtype.str.encode(), a.ndim, 0)
        entry["shape"] = list(a.shape) + [0] * (MAX_DIMS - a.ndim)
        entry["offset"], entry["nbytes"] = offset, a.nbytes
        buf[offset:offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        offset += aligned(a.nbytes)
    header["magic"], header["n_fields"], header["length"] = MAGIC, len(arrays), size
    header["schema"] = schema_of(arrays)
    header["meta_crc"] = _meta_crc(buf, len(arrays))
    return buf


def _meta_crc(buf: np.ndarray, n_fields: int) -> int:
    """CRC-32 of the header (but its own field) and the field table."""
    fields = RECORD_HEADER.fields
    assert fields is not None  # always, for a structured dtype (numpy's type allows None)
    crc_at = fields["meta_crc"][1]
    crc = zlib.crc32(buf[:crc_at].tobytes())
    return zlib.crc32(buf[crc_at + 4:RECORD_HEADER.itemsize + FIELD_ENTRY.itemsize
                          * n_fields].tobytes(), crc)


def decode(buf: np.ndarray, copy: bool = True) -> dict[str, np.ndarray]:
    """Arrays of an encoded record (copies by default; views into `buf` with copy=False)."""
    buf = np.asarray(buf).view(np.uint8).reshape(-1)
    if buf.nbytes < RECORD_HEADER.itemsize:
        raise RecordError(f"{buf.nbytes} bytes is shorter than a record header")
    header = buf[:RECORD_HEADER.itemsize].view(RECORD_HEADER)[0]
    if header["magic"] != MAGIC:
        raise RecordError(f"bad magic {int(header['magic']):#x}, expected {MAGIC:#x}")
    n, length = int(header["n_fields"]), int(header["length"])
    table_end = RECORD_HEADER.itemsize + FIELD_ENTRY.itemsize * n
    if length > buf.nbytes or table_end > length:
        raise RecordError(f"record claims {length} bytes and {n} fields; buffer has "
                          f"{buf.nbytes} bytes")
    if int(header["meta_crc"]) != _meta_crc(buf, n):
        raise RecordError("metadata checksum mismatch: the header or field table is damaged")
    out = {}
    for entry in buf[RECORD_HEADER.itemsize:table_end].view(FIELD_ENTRY):
        ndim = int(entry["ndim"])
        if ndim > MAX_DIMS:
            raise RecordError(f"field with {ndim} dims")
        shape = tuple(int(s) for s in entry["shape"][:ndim])
        try:  # numpy parses dtype strings with a small grammar that can raise almost anything
            dtype = np.dtype(entry["dtype"].decode())
            name = entry["name"].decode()
        except Exception as err:  # noqa: BLE001
            raise RecordError(f"unreadable field entry: {err!r}") from None
        start, nbytes = int(entry["offset"]), int(entry["nbytes"])
        if dtype.kind not in "biufc" or start + nbytes > length or \
                nbytes != dtype.itemsize * math.prod(shape):
            raise RecordError(f"field {name!r}: {nbytes} bytes at {start} do not fit "
                              f"dtype {dtype} shape {shape} in a {length}-byte record")
        try:
            a = buf[start:start + nbytes].view(dtype).reshape(shape)
        except ValueError as err:  # e.g. a zero-size field with an absurd shape
            raise RecordError(f"field {name!r}: {err}") from None
        out[name] = a.copy() if copy else a
    if int(header["schema"]) != schema_of(out):
        raise RecordError("schema id does not match the field table")
    return out
