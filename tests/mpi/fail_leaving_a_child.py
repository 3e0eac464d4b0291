"""Run under MPI: rank 1 forks a child that sleeps 2 s in a session of its own (it inherits
the rank's mappings of MPICH's shared-memory segments, and the abort's kill of the rank's
process group misses it), then rank 0 fails. The launcher must wait for that child too,
which outlives mpiexec, before it removes the aborted world's segments.

    hpcvla launch -n 2 -- tests/mpi/fail_leaving_a_child.py
"""

import os
import time

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
MPI.COMM_WORLD.Barrier()  # every rank has mapped the node's segments
if rank == 1 and os.fork() == 0:
    os.setsid()
    time.sleep(2)
    os._exit(0)  # leave MPI to the parent
if rank == 0:
    time.sleep(0.5)
    raise RuntimeError("injected failure")
MPI.COMM_WORLD.Barrier()  # never completes
