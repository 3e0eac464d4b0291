"""Run under MPI: arrays given on a node's first rank are read by every rank of the node from
that one copy (transport/node_arrays.py): equal to the given ones, read-only, and a store the
holder makes into its window afterwards is seen by the others (the memory is shared, not
copied). Prints one line per rank."""

import numpy as np
from mpi4py import MPI

from hpcvla.transport.node_arrays import NodeArrays
from hpcvla.transport.windows import window_bytes

world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
rng = np.random.default_rng(7)
given = {"obs.image": rng.integers(0, 255, (5, 4, 4, 3), dtype=np.uint8),
         "actions": rng.normal(size=(5, 2, 7)).astype(np.float32),
         "pad": rng.random((5, 2)) < 0.5, "episode": np.arange(5, dtype=np.int64),
         "empty": np.zeros((0, 3), np.float64)}
shared = NodeArrays(node, given if node.Get_rank() == 0 else None)
for key, value in given.items():
    got = shared.arrays[key]
    assert got.dtype == value.dtype and got.shape == value.shape, (key, got.dtype, got.shape)
    assert np.array_equal(got, value) and not got.flags.writeable, key
node.Barrier()
if node.Get_rank() == 0:  # a store into the one copy, after the others have read it
    window_bytes(shared.win.Shared_query(0)[0])[0] ^= 0xFF
shared.win.Sync()
node.Barrier()
shared.win.Sync()
seen = shared.arrays["obs.image"].reshape(-1)[0] == (given["obs.image"].reshape(-1)[0] ^ 0xFF)
print(f"rank {world.Get_rank()} of node of {node.Get_size()}: {shared.nbytes} bytes, "
      f"the holder's store {'seen' if seen else 'NOT seen'}", flush=True)
shared.free()
node.Free()
