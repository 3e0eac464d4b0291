"""Run under MPI, 2 ranks of one node: a simulator asks for actions that the inference rank
gives 25 ms later (asleep); prints, with the exchange's doorbells and without, how long
after each answer the simulator noticed it and its CPU per answer (bench transport's `wake`
pair). A simulator sleeps up to 10 ms at a time with the doorbells: without a ring it would
notice an answer ~5 ms late on average.

    mpiexec -n 2 python -m mpi4py tests/mpi/exchange_wakes.py
"""

import json

from mpi4py import MPI

from hpcvla.bench.transport import bench_wake

measured = bench_wake(MPI.COMM_WORLD, 25e-3, 12, 1)
if MPI.COMM_WORLD.Get_rank() == 0:
    print("wakes:", json.dumps(measured), flush=True)
