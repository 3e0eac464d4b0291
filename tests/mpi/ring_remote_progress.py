"""Run under MPI on 2+ hosts: do producers' puts complete while the learner computes?

Rank 0 hosts the ring and then computes for COMPUTE_S seconds without calling MPI (numpy
matrix products, as a training step would). Every other rank waits until that compute has
begun, then puts RECORDS records 50 ms apart, timing each put (payload, publish, all
flushed: the record is in the learner's memory when `put` returns). After its compute rank 0
counts what is already in its memory, takes the rest, checks every record arrived exactly
once, gathers the producers' timings and prints, per producer host, the slowest and median
put and how many completed before its compute ended. The last line is JSON.

    mpiexec ... python -m mpi4py tests/mpi/ring_remote_progress.py RECORDS COMPUTE_S [PROGRESS]

PROGRESS is the ring's progress mode (auto, thread, poll).
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcvla.transport.ring import TrajectoryRing


def main():
    comm = MPI.COMM_WORLD
    n_records, compute_s = int(sys.argv[1]), float(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "auto"
    rank, host = comm.Get_rank(), MPI.Get_processor_name()
    producers = comm.Get_size() - 1
    ring = TrajectoryRing(comm, n_slots=producers * n_records + producers, slot_bytes=4096,
                          progress=mode)
    start = comm.bcast(time.time(), root=0)
    timings = []
    if rank == 0:
        a = np.random.default_rng(0).standard_normal((256, 256))
        while time.time() - start < compute_s:  # no MPI call in here
            a = np.tanh(a @ a / 256)
        end = time.time()
        got = [(r.producer, r.seq) for r in ring.reader.poll()]
        in_memory_at_end = len(got)
        while len(ring.reader.stats.closed) < producers:
            got += [(r.producer, r.seq) for r in ring.reader.get(timeout=60)]
        assert sorted(got) == [(p, s) for p in range(1, producers + 1)
                               for s in range(n_records)], got
    else:
        time.sleep(max(0.0, start + 0.3 - time.time()))  # well inside the compute
        for seq in range(n_records):
            t0 = time.time()
            ring.writer.put(np.full(512, seq, np.uint8), timeout=120)
            timings.append((t0, time.time()))
            time.sleep(0.05)
        ring.writer.close()
    everything = comm.gather((host, timings), root=0)
    if rank == 0:
        result = {"mode": mode, "spans_hosts": ring.spans_hosts,
                  "agent_thread": ring.progress.running, "compute_s": compute_s,
                  "in_memory_at_compute_end": in_memory_at_end, "consumer_host": host,
                  "producer_hosts": {}}
        by_host: dict = {}
        for phost, times in everything[1:]:
            by_host.setdefault(phost, []).extend(times)
        for phost, times in sorted(by_host.items()):
            put_ms = [(done - t0) * 1e3 for t0, done in times]
            result["producer_hosts"][phost] = {
                "remote": phost != host, "puts": len(times),
                "max_put_ms": round(max(put_ms), 2),
                "median_put_ms": round(float(np.median(put_ms)), 2),
                "done_during_compute": sum(done < end for _, done in times)}
        print(json.dumps(result), flush=True)
    ring.free()


if __name__ == "__main__":
    main()
