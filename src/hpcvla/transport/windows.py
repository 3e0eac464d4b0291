"""The windows of the trajectory ring, the observation/action exchange and the weight plane:
their memory model checked, their memory as a numpy array, a node's shared ones allocated
where /dev/shm has room for them."""

from __future__ import annotations

import ctypes
import errno
import mmap
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mpi4py import MPI

SHM = "/dev/shm"  # where MPICH and Open MPI (osc_sm_backing_directory) back shared windows
MIB = 2 ** 20
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in writable, or fail where SIGBUS would


def allocate_shared(nbytes: int, comm: MPI.Comm, what: str) -> MPI.Win:
    """Collective on `comm` (one node's ranks): `Win.Allocate_shared` of `nbytes` from this
    rank, given its pages (`with_room`) and checked for the unified model."""
    from mpi4py import MPI
    # mpi4py's stub types Split's communicators Comm; they are Intracomm
    return with_room(nbytes, comm, what, lambda: MPI.Win.Allocate_shared(  # [dist]
        nbytes, 1, comm=comm),  # type: ignore[arg-type]
        lambda win: win.Shared_query(comm.Get_rank())[0])


def allocate(nbytes: int, comm: MPI.Comm, what: str) -> MPI.Win:
    """Collective on `comm`: `Win.Allocate` of `nbytes` from this rank (MPICH backs it with
    /dev/shm for its host's peers to load and store), as allocate_shared's."""
    from mpi4py import MPI
    return with_room(nbytes, comm, what, lambda: MPI.Win.Allocate(  # [dist]
        nbytes, 1, comm=comm),  # type: ignore[arg-type]
        lambda win: win.tomemory())


def with_room(nbytes: int, comm: MPI.Comm, what: str, make: Callable[[], MPI.Win],
              own: Callable[[MPI.Win], MPI.buffer]) -> MPI.Win:
    """Collective on `comm`: the window `make()` allocates, each rank's `nbytes` of it (`own`:
    its memory) in pages of its own, else an error on every rank naming the window, the host,
    the room and the fix. MPI maps its segments in /dev/shm sparse: a window larger than the
    room left is allocated without a word, and the first rank to write past the room dies of
    SIGBUS (no message), seconds or minutes into the run. So the room is checked before, and
    the pages are faulted in right after (MADV_POPULATE_WRITE), which fails instead of a
    SIGBUS where the windows of a node together outgrow it (each one's check alone would not
    see the others, sparse as they are) and makes the next window's check see them."""
    free = shared_memory_free() if nbytes else None
    short = free is not None and free < nbytes
    _agree(comm, short, nbytes, free, what)  # [dist]
    win = unified(make(), what)  # [dist]
    short = bool(nbytes) and not _populate(window_bytes(own(win)))
    if any(comm.allgather(short)):  # [dist]
        win.Free()  # [dist]
        _agree(comm, short, nbytes, shared_memory_free(), what)  # [dist]
    return win


def _agree(comm: MPI.Comm, short: bool, nbytes: int, free: int | None, what: str) -> None:
    """Collective: raise on every rank where a rank found no room."""
    from mpi4py import MPI
    problem = (f"host {MPI.Get_processor_name()}: {what} needs {nbytes / MIB:,.0f} MiB of "
               f"the node's shared memory and {SHM} has {(free or 0) / MIB:,.0f} MiB free: a "
               f"larger {SHM} (containers: --shm-size; `mount -o remount,size=... /dev/shm`), "
               "or remove what ended jobs left there (`hpcvla doctor` checks a node's room "
               "before a job)") if short else None
    problems = [p for p in comm.allgather(problem) if p]  # [dist]
    if problems:
        raise RuntimeError(problems[0])


# What the MPI library's own shared memory (its intra-node channels) takes in /dev/shm beside
# the windows a job makes: the room the checks before a job leave it
MPI_OWN_SHM = 64 << 20


def shared_memory_free() -> int | None:
    """Free bytes in this machine's /dev/shm, where MPI's shared-memory windows live; None
    where there is none to read (the MPI library says what it uses instead)."""
    try:
        return shutil.disk_usage(SHM).free
    except OSError:
        return None


def shared_memory_room() -> int | None:
    """The bytes in this machine's /dev/shm a job's windows may take: the free ones less
    MPI_OWN_SHM (negative where not even that is free); None as shared_memory_free."""
    free = shared_memory_free()
    return None if free is None else free - MPI_OWN_SHM


def _populate(memory: np.ndarray) -> bool:
    """Whether every page of `memory` could be faulted in writable (its contents untouched);
    True where the kernel has no MADV_POPULATE_WRITE (before Linux 5.14: the check before
    the allocation is all there is)."""
    if not memory.nbytes:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    start = memory.ctypes.data - memory.ctypes.data % mmap.PAGESIZE
    length = memory.ctypes.data + memory.nbytes - start
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_POPULATE_WRITE) == 0:
        return True
    return ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS)  # an older kernel: not known


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
