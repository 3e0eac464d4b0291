"""A window's memory as a numpy array: the trajectory ring's, the observation/action
exchange's and the weight plane's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mpi4py import MPI


def window_bytes(buf: MPI.buffer) -> np.ndarray:
    """`buf` (from `Win.tomemory` or `Win.Shared_query`) as a flat uint8 array, no copy."""
    # mpi4py's stub gives `buffer` the buffer protocol (__buffer__) on Python 3.12+ only; the
    # object has it on every Python
    memory: np.ndarray = np.frombuffer(buf, np.uint8)  # type: ignore[call-overload]
    return memory
