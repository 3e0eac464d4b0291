"""Two node-shared windows of 40 MiB each, allocated one after the other (transport/windows.py):
each fits the room left alone, not both. Prints what happened to the second on rank 0."""

from mpi4py import MPI

from hpcvla.transport.windows import allocate_shared

node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
size = 40 * 2 ** 20 if node.Get_rank() == 0 else 0
first = allocate_shared(size, node, "the first window")
try:
    second = allocate_shared(size, node, "the second window")
    said = "allocated"
except RuntimeError as err:
    said = f"refused: {err}"
if node.Get_rank() == 0:
    print(said, flush=True)
