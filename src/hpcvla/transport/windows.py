"""The windows of the trajectory ring, the observation/action exchange and the weight plane:
their memory model checked, their memory as a numpy array."""

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


def unified(win: MPI.Win, what: str) -> MPI.Win:
    """`win`, checked to be in MPI's unified memory model. The ring's learner and the shared
    windows' ranks load and store their window's memory directly, with `Win.Sync` between,
    while other ranks' RMA calls target it: in the separate model MPI forbids that (MPI-3.1
    11.7) and a store could be lost. MPICH's ch4 and Open MPI's osc sm/ucx/rdma are unified."""
    from mpi4py import MPI
    if win.Get_attr(MPI.WIN_MODEL) != MPI.WIN_UNIFIED:
        raise RuntimeError(f"{what}'s MPI window is in the separate memory model, and hpcvla "
                           "reads and writes its windows beside RMA calls, which needs the "
                           "unified one: use MPICH (ch4), or Open MPI with OMPI_MCA_osc=sm,ucx "
                           "(or sm,rdma)")
    return win
