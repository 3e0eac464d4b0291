"""Run under MPI (2 ranks): after its last version a learner drains its ring until every
producer closed its lane (roles/policy_ranks._drain), counting what came for no version; a
producer late to close (here: 2.5 s) is named each patience_s (1 s), not waited for silently.

    mpiexec -n 2 python -m mpi4py tests/mpi/ring_drain.py
"""

import time

from mpi4py import MPI

from hpcvla.roles.policy_ranks import _drain
from hpcvla.transport.ring import TrajectoryRing


def main():
    comm = MPI.COMM_WORLD
    ring = TrajectoryRing(comm, 4, 4096)
    if comm.Get_rank() == 0:
        unused = _drain(ring.reader, (1,), 0, 1.0)
        print(f"drained {unused} record(s) that came after the last version", flush=True)
    else:
        ring.writer.put(b"x" * 100)
        time.sleep(2.5)
        ring.writer.close()
    ring.free()


if __name__ == "__main__":
    main()
