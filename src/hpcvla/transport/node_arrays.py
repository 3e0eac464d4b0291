"""Arrays that every rank of a node reads from one copy: one rank of the node holds them in an
MPI shared-memory window (`Win.Allocate_shared`) and the others map it.

What `hpcvla sft` keeps its demonstrations in. Each learner holding its own copy would multiply
them by the node's learners: LeRobot's LIBERO datasets at 224 px are ~80 GB, 640 GB for the 8
learners of an 8-GPU node, where one copy fits.

    shared = NodeArrays(node, arrays if node.Get_rank() == 0 else None)   # collective on node
    shared.arrays["image"][index]    # read-only views into the window, on every rank of node
    shared.free()                    # collective, after the last read

The window is in MPI's unified memory model (windows.unified); the holder's stores are made
visible to the others by `Win.Sync` on both sides of a barrier (MPI-3.1 11.7's shared-memory
synchronization).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hpcvla.transport.records import aligned
from hpcvla.transport.windows import unified, window_bytes

if TYPE_CHECKING:
    from mpi4py import MPI


class NodeArrays:
    """`arrays` (given on the node's rank 0 only, None elsewhere), one copy per node."""

    def __init__(self, node: MPI.Intracomm, arrays: dict[str, np.ndarray] | None):
        from mpi4py import MPI
        holder = node.Get_rank() == 0
        layout = node.bcast([(k, a.shape, a.dtype.str) for k, a in arrays.items()]  # [dist]
                            if holder and arrays is not None else None, root=0)
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for _, shape, dtype in layout]
        offsets = np.cumsum([0] + [aligned(n) for n in sizes])
        window = MPI.Win.Allocate_shared(int(offsets[-1]) if holder else 0, 1,  # [dist]
                                         comm=node)
        self.win = unified(window, "the node's shared arrays")
        self.win.Lock_all(MPI.MODE_NOCHECK)
        memory = window_bytes(self.win.Shared_query(0)[0])
        self.arrays: dict[str, np.ndarray] = {}
        for (key, shape, dtype), at, n in zip(layout, offsets, sizes):
            view = memory[at:at + n].view(dtype).reshape(shape)
            if holder:
                view[...] = arrays[key]  # type: ignore[index]
            view.flags.writeable = False
            self.arrays[key] = view
        self.nbytes = int(offsets[-1])
        self.win.Sync()
        node.Barrier()  # [dist] the holder's copy is complete
        self.win.Sync()

    def free(self) -> None:
        """Collective on the node: after every rank's last read of `arrays`."""
        self.arrays.clear()
        self.win.Unlock_all()
        self.win.Free()  # [dist]
