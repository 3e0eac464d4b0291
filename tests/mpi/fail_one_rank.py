"""Run under MPI: rank FAIL raises while every other rank waits in a collective forever.
The job must end quickly with a message naming the failing rank and its role.

    mpiexec -n 4 python -m mpi4py tests/mpi/fail_one_rank.py CONFIG FAIL
"""

import sys
import time

from hpcvla.config import load_config
from hpcvla.job.runtime import run_ranks


def main(cfg, plan, comms):
    if comms.world.Get_rank() == int(sys.argv[2]):
        time.sleep(0.5)
        raise RuntimeError("injected failure")
    comms.world.Barrier()  # never completes: the failing rank does not join


if __name__ == "__main__":
    sys.exit(run_ranks(load_config(sys.argv[1]), main))
