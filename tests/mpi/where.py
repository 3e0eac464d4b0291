"""Run under MPI: where each rank runs, as MPI sees it (host name, shared-memory node size,
library), gathered on rank 0 and printed as one JSON line."""

import json

from mpi4py import MPI

world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED)
seen = world.gather((MPI.Get_processor_name(), node.Get_size()), root=0)
node.Free()
if world.Get_rank() == 0:
    print(json.dumps({"hosts": [h for h, _ in seen], "node_sizes": [n for _, n in seen],
                      "library": MPI.Get_library_version().splitlines()[0]}), flush=True)
