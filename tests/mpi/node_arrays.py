"""Run under MPI: arrays every rank of a node fills a share of (transport/node_arrays.py),
read by all of them from one copy once sealed: equal to the whole, read-only, and a store one
rank makes into the window afterwards is seen by the others (the memory is shared, not
copied); and `NodeArrays.gathered`: each rank's rows, some none, one after the other in rank
order. Prints two lines per rank."""

import numpy as np
from mpi4py import MPI

from hpcvla.transport.node_arrays import NodeArrays
from hpcvla.transport.windows import window_bytes

world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
rank, size = node.Get_rank(), node.Get_size()
rng = np.random.default_rng(7)
whole = {"obs.image": rng.integers(0, 255, (5, 4, 4, 3), dtype=np.uint8),
         "actions": rng.normal(size=(5, 2, 7)).astype(np.float32),
         "pad": rng.random((5, 2)) < 0.5, "episode": np.arange(5, dtype=np.int64),
         "empty": np.zeros((0, 3), np.float64)}
shared = NodeArrays(node, {k: (v.shape, v.dtype.str) for k, v in whole.items()})
for key, value in whole.items():  # rank r fills rows r, r + size, ...
    shared.arrays[key][rank::size] = value[rank::size]
shared.seal()
for key, value in whole.items():
    got = shared.arrays[key]
    assert got.dtype == value.dtype and got.shape == value.shape, (key, got.dtype, got.shape)
    assert np.array_equal(got, value) and not got.flags.writeable, key
node.Barrier()
if rank == size - 1:  # a store into the one copy, after every rank has read it
    window_bytes(shared.win.Shared_query(0)[0])[0] ^= 0xFF
shared.win.Sync()
node.Barrier()
shared.win.Sync()
seen = shared.arrays["obs.image"].reshape(-1)[0] == (whole["obs.image"].reshape(-1)[0] ^ 0xFF)
print(f"rank {world.Get_rank()} of node of {size}: {shared.nbytes} bytes, "
      f"the store {'seen' if seen else 'NOT seen'}", flush=True)
shared.free()

# rank r holds r * 2 rows (rank 0 none), each row its rank and index, as float64
mine = {"x": np.array([[rank, i] for i in range(2 * rank)], np.float64).reshape(-1, 2),
        "flag": np.full(2 * rank, rank % 2 == 1)}
gathered = NodeArrays.gathered(node, mine, {"x": ((2,), "<f4"), "flag": ((), "|b1")})
want = np.array([[r, i] for r in range(size) for i in range(2 * r)], np.float32).reshape(-1, 2)
assert gathered.arrays["x"].dtype == np.float32 and np.array_equal(gathered.arrays["x"], want)
assert np.array_equal(gathered.arrays["flag"], want[:, 0] % 2 == 1)
print(f"rank {world.Get_rank()}: gathered {len(want)} rows in rank order", flush=True)
gathered.free()
node.Free()
