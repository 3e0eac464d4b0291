"""Messages of any size through MPI libraries that count in C ints.

MPI-3 libraries take at most 2^31 - 1 elements per call, and some refuse less: Open MPI 4.1
(what Debian 12, Ubuntu 24.04 and most clusters' modules ship; no MPI-4 large-count calls)
fails an `Ibcast` of 2^31 + 1024 bytes with MPI_ERR_ARG, and a full-size π0 version is 6.5 GB.
So every transfer that can pass MAX_MESSAGE bytes goes as several calls of at most that
much: the weight plane's versions (whole, or its trainable places packed), the ring's puts
(a slot may be larger) and a resumed replicated optimizer state (π0's embedding alone is
2.1 GB in fp32). Nonblocking collectives posted in the same order on every rank
match in that order, so a broadcast in pieces is still one pipelined transfer (all pieces
posted, then waited for).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

MAX_MESSAGE = 1 << 30  # bytes per MPI call: half the int limit, so any element type fits


def pieces(nbytes: int, limit: int = MAX_MESSAGE) -> list[tuple[int, int]]:
    """(offset, bytes) of consecutive pieces of at most `limit` bytes covering `nbytes`."""
    return [(start, min(limit, nbytes - start)) for start in range(0, nbytes, limit)]


def ibcast(comm: MPI.Comm, buf: np.ndarray, root: int = 0,
           limit: int = MAX_MESSAGE) -> list[MPI.Request]:
    """Post the broadcast of `buf` (uint8) in pieces of at most `limit` bytes; returns the
    requests, which the caller waits for."""
    return [comm.Ibcast(buf[start:start + n], root=root)  # [dist]
            for start, n in pieces(buf.nbytes, limit)]


def bcast(comm: MPI.Comm, buf: np.ndarray, root: int = 0, limit: int = MAX_MESSAGE) -> None:
    """Broadcast `buf` (uint8) in pieces of at most `limit` bytes, returning when it is here."""
    MPI.Request.Waitall(ibcast(comm, buf, root, limit))  # [dist]
