"""Run under MPI on 3 ranks: ranks 1 and 2 write 300 records each with `put_many`, in batches
of mixed sizes (most small enough to share a slot, some larger than a slot: fragmented),
into rank 0's ring of small slots. Every record must arrive once, in its producer's order,
byte-exact with its schema; packed slots must have been used. Then rank 1 writes a packed
slot that rank 0 damages in its own memory (with CHECKSUM=always): all its records are
dropped, counted as lost and reported, and the producer's next record still arrives.

    mpiexec -n 3 python -m mpi4py tests/mpi/ring_packed.py CHECKSUM   # auto or always
"""

import sys

import numpy as np
from mpi4py import MPI

from hpcvla.transport.ring import TrajectoryRing
from hpcvla.transport.slots import PACKED, SLOT_HEADER

N, SLOT_BYTES = 300, 4096


def record(producer, seq):
    size = int(np.random.default_rng([producer, seq]).choice([40, 300, 1000, 6000]))
    return np.full(size, (producer * 7 + seq) % 251, np.uint8), seq % 5


comm, checksum = MPI.COMM_WORLD, sys.argv[1]
rank, reports = comm.Get_rank(), []
ring = TrajectoryRing(comm, 12, SLOT_BYTES, report=reports.append, checksum=checksum)
if rank:
    rng = np.random.default_rng(rank)
    seq = 0
    while seq < N:
        batch = int(rng.integers(1, 9))
        ring.writer.put_many([record(rank, s) for s in range(seq, min(N, seq + batch))], timeout=60)
        seq += batch
else:
    got, packed_slots = {1: [], 2: []}, 0
    while sum(map(len, got.values())) < 2 * N:
        packed_slots += int(np.count_nonzero(ring.reader.words[:, 2] >> np.uint64(32) == PACKED))
        for r in ring.reader.get(timeout=60):
            data, schema = record(r.producer, r.seq)
            assert r.schema == schema and np.array_equal(r.data, data), (r.producer, r.seq)
            got[r.producer].append(r.seq)
    assert got == {1: list(range(N)), 2: list(range(N))}
    assert packed_slots > 0 and ring.reader.stats.bad_slots == 0
    print(f"ring packed ({checksum}): 2 x {N} records in order and exact, {packed_slots} "
          f"packed slot sightings", flush=True)
comm.Barrier()
if checksum == "always":  # (auto, on one host, does not check payloads: ring.py)
    if rank == 1:  # three records packed into one slot, then one more
        ring.writer.put_many([(np.full(500, s % 251, np.uint8), 0) for s in range(3)], timeout=60)
        comm.Barrier()
        comm.Barrier()  # rank 0 damaged it
        ring.writer.put_many([(np.full(500, 3, np.uint8), 0)], timeout=60)
    elif rank == 0:
        comm.Barrier()
        while ring.reader.occupancy()[0] < 1:
            pass
        slot = ring.slot_index(0, ring.reader.next[0])
        ring.reader.slots[slot, SLOT_HEADER.itemsize + 100] ^= 0x01  # in the table or a record
        comm.Barrier()
        late = []
        while not late:
            late = ring.reader.get(timeout=60)
        assert [(r.producer, r.seq) for r in late] == [(1, N + 3)], late
        s, text = ring.reader.stats, "\n".join(reports)
        caught = "checksum mismatch" in text or "packed" in text
        assert (s.bad_slots, s.lost_records) == (1, 3) and caught, (s, text)
        assert f"records {N}..{N + 2} lost" in text, text
        print(f"damaged packed slot: bad_slots {s.bad_slots}, lost {s.lost_records}, "
              f"reported", flush=True)
    else:
        comm.Barrier()
        comm.Barrier()
comm.Barrier()
ring.free()
