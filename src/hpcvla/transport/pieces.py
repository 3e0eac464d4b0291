"""Messages of any size through MPI libraries that count in C ints.

MPI-3 libraries take at most 2^31 - 1 elements per call, and some refuse less: Open MPI 4.1
(what Debian 12, Ubuntu 24.04 and most clusters' modules ship; no MPI-4 large-count calls)
fails an `Ibcast` of 2^31 + 1024 bytes with MPI_ERR_ARG, and a full-size π0 version is 6.5 GB.
So every transfer that can pass MAX_MESSAGE bytes goes as several calls of at most that
much: the weight plane's versions (whole, and the indexed datatypes of the trainable places)
and the ring's puts (a slot may be larger). Nonblocking collectives posted in the same order
on every rank match in that order, so a broadcast in pieces is still one pipelined transfer
(all pieces posted, then waited for).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

MAX_MESSAGE = 1 << 30  # bytes per MPI call: half the int limit, so any element type fits


def pieces(nbytes: int, limit: int = MAX_MESSAGE) -> list[tuple[int, int]]:
    """(offset, bytes) of consecutive pieces of at most `limit` bytes covering `nbytes`."""
    return [(start, min(limit, nbytes - start)) for start in range(0, nbytes, limit)]


def batches(regions: list[tuple[int, int]], limit: int = MAX_MESSAGE
            ) -> list[list[tuple[int, int]]]:
    """(offset, bytes) regions regrouped, in order, into batches of at most `limit` bytes
    each; a region that does not fit the batch being filled is split across batches."""
    out: list[list[tuple[int, int]]] = [[]]
    room = limit
    for offset, n in regions:
        while n:
            if room == 0:
                out.append([])
                room = limit
            take = min(n, room)
            out[-1].append((offset, take))
            offset, n, room = offset + take, n - take, room - take
    return out if out[0] else []


def indexed_types(regions: list[tuple[int, int]], limit: int = MAX_MESSAGE
                  ) -> list[MPI.Datatype]:
    """One committed byte datatype per batch of `regions` (their places in a buffer), each
    at most `limit` bytes: a broadcast of the regions is one call per type. Free them."""
    return [MPI.BYTE.Create_hindexed([n for _, n in batch], [o for o, _ in batch]).Commit()
            for batch in batches(regions, limit)]


def ibcast(comm: MPI.Comm, buf: np.ndarray, root: int = 0, types=None,
           limit: int = MAX_MESSAGE) -> list[MPI.Request]:
    """Post the broadcast of `buf` (uint8) in pieces of at most `limit` bytes, or, with
    `types` (indexed_types), of the places they select; wait for the requests."""
    if types is not None:
        return [comm.Ibcast([buf, 1, t], root=root) for t in types]  # [dist]
    return [comm.Ibcast(buf[start:start + n], root=root)  # [dist]
            for start, n in pieces(buf.nbytes, limit)]

