"""Run under MPI (2 ranks, `hpcvla launch -n 2 -- ...`): `hpcvla eval`'s guard of a world's
rank (job/runtime.or_abort_the_world) around a start in which rank 1 fails before MPI is
initialised, with an error that is no verdict every rank reaches (not a ConfigError), while
rank 0 goes on into MPI_Init and a barrier, where it would wait for rank 1 forever."""

import sys

from hpcvla.job.runtime import or_abort_the_world
from hpcvla.process.mpi_select import launcher_rank


def start() -> int:
    if launcher_rank() == 1:
        raise OSError("the node's scratch file system is gone")
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()
    return 0


sys.exit(or_abort_the_world("eval", start))
