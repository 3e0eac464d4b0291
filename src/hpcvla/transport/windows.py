"""The windows of the trajectory ring, the observation/action exchange and the weight plane:
their memory model checked, their memory as a numpy array, a node's shared ones allocated
where /dev/shm has room for them."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

import numpy as np


if TYPE_CHECKING:
    from mpi4py import MPI

SHM = "/dev/shm"  # where MPICH and Open MPI (osc_sm_backing_directory) back shared windows
MIB = 2 ** 20


def allocate_shared(nbytes: int, comm: MPI.Comm, what: str) -> MPI.Win:
    """Collective on `comm` (one node's ranks): `Win.Allocate_shared` of `nbytes` from this
    rank, checked for room (`require_room`) and for the unified model."""
    from mpi4py import MPI
    require_room(nbytes, comm, what)  # [dist]
    # mpi4py's stub types Split's communicators Comm; they are Intracomm
    window = MPI.Win.Allocate_shared(nbytes, 1, comm=comm)  # type: ignore[arg-type]  # [dist]
    return unified(window, what)


def allocate(nbytes: int, comm: MPI.Comm, what: str) -> MPI.Win:
    """Collective on `comm`: `Win.Allocate` of `nbytes` from this rank (MPICH backs it with
    /dev/shm for its host's peers to load and store), checked as allocate_shared's."""
    from mpi4py import MPI
    require_room(nbytes, comm, what)  # [dist]
    window = MPI.Win.Allocate(nbytes, 1, comm=comm)  # type: ignore[arg-type]  # [dist]
    return unified(window, what)


def require_room(nbytes: int, comm: MPI.Comm, what: str) -> None:
    """Collective on `comm`: raise on every rank where a rank's `nbytes` (each node's windows
    have one rank that allocates) exceed its host's free /dev/shm. MPI maps its segments
    there sparse, so a window larger than the room left is allocated without a word and the
    first rank to write past the room dies of SIGBUS (no message), seconds or minutes into
    the run; a short /dev/shm (a container's 64 MiB default, what other jobs left) is named
    here instead, with the fix."""
    from mpi4py import MPI
    problem = None
    if nbytes:
        try:
            free = shutil.disk_usage(SHM).free
        except OSError:  # no /dev/shm here: the MPI library says what it uses instead
            free = nbytes
        if free < nbytes:
            problem = (f"host {MPI.Get_processor_name()}: {what} needs {nbytes / MIB:,.0f} MiB "
                       f"of the node's shared memory and {SHM} has {free / MIB:,.0f} MiB free: a "
                       f"larger {SHM} "
                       "(containers: --shm-size; `mount -o remount,size=... /dev/shm`), or "
                       "remove what ended jobs left there (`hpcvla doctor` checks a node's "
                       "room before a job)")
    problems = [p for p in comm.allgather(problem) if p]  # [dist]
    if problems:
        raise RuntimeError(problems[0])


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
