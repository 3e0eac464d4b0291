"""Run under MPI on 3 ranks: what a learner's stall message says about its ring.

Rank 1 delivers 3 records; rank 2 starts a record and never publishes its slot (a write stuck
in flight, as when nothing progresses the learner's window). Before rank 2 starts, rank 0
must report nothing under way; after it, one fragment started but not published, with what
each producer delivered. Prints both messages.

    mpiexec -n 3 python -m mpi4py tests/mpi/ring_stall.py
"""

import numpy as np
from mpi4py import MPI

from hpcvla.transport.ring import TrajectoryRing

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
ring = TrajectoryRing(comm, 6, 4096)  # 3 slots per producer: rank 1 never waits
if rank == 1:
    for seq in range(3):
        ring.writer.put(np.full(100, seq, np.uint8))
comm.Barrier()
if rank == 0:
    got = []
    while len(got) < 3:
        got += [r.seq for r in ring.reader.get(timeout=30)]
    quiet = ring.reader.diagnose(producers=(1, 2))
    assert "all 3 fragment(s) started were delivered" in quiet, quiet
    assert "producer rank 1: 3 records, last" in quiet, quiet
    assert "producer rank 2: nothing" in quiet, quiet
    print(f"before: {quiet}", flush=True)
comm.Barrier()
if rank == 2:  # the first step of a put, then nothing: its slot is never published
    ring.win.Put([np.ones(1, np.int64), MPI.INT64_T], 0,
                 (16 * ring.writer.lane + 8, 1, MPI.INT64_T))
    ring.win.Flush(0)
comm.Barrier()
if rank == 0:
    assert ring.reader.poll() == []
    stuck = ring.reader.diagnose(producers=(1, 2))
    assert "1 fragment(s) started but not published (1 in the lane of comm rank 2)" in stuck, \
        stuck
    assert "progress or network problem" in stuck, stuck
    print(f"after: {stuck}", flush=True)
comm.Barrier()
ring.free()
