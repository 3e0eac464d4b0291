"""Run under MPI, 2 ranks, the second in a network namespace of its own (`unshare -n`): MPI
still puts both on one node, so they build one cell's exchange, whose doorbells cannot reach
across namespaces: it must refuse, naming why, not wait for rings that never come.

    mpiexec -n 1 python -m mpi4py E : -n 1 unshare -n python -m mpi4py E
"""

import numpy as np
from mpi4py import MPI

from hpcvla.transport.exchange import ObsActionExchange

ONE = np.dtype([("x", "<f4")])
ObsActionExchange(MPI.COMM_WORLD, 1, ONE, ONE)
print(f"rank {MPI.COMM_WORLD.Get_rank()}: the exchange was built", flush=True)
