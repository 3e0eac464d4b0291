"""Arrays that every rank of a node reads from one copy: an MPI shared-memory window
(`Win.Allocate_shared`, held by the node's first rank) that all of them map and fill.

What `hpcvla sft` keeps its demonstrations in, and RLPD's learners their prior data. Each
learner holding its own copy would multiply them by the node's learners: LeRobot's LIBERO
datasets at 224 px are ~80 GB, 640 GB for the 8 learners of an 8-GPU node, where one copy
fits; and the node's ranks read their shares of the files at once into it
(`NodeArrays.gathered`: each rank's rows, in rank order).

    shared = NodeArrays(node, {"image": ((n, 224, 224, 3), "|u1"), ...})   # collective
    shared.arrays["image"][first:stop] = mine     # each rank its own rows, no two the same
    shared.seal()                                 # collective: every rank's rows are in
    shared.arrays["image"][index]                 # read-only from here, on every rank
    shared.free()                                 # collective, after the last read

The window is in MPI's unified memory model (windows.unified); the ranks' stores are made
visible to the others by `Win.Sync` on both sides of a barrier (MPI-3.1 11.7's shared-memory
synchronization).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import DTypeLike

from hpcvla.transport.records import aligned
from hpcvla.transport.windows import allocate_shared, window_bytes

if TYPE_CHECKING:
    from mpi4py import MPI


class NodeArrays:
    """Arrays of `layout` (name -> (shape, dtype), the same on every rank of `node`), one
    copy per node, writable until `seal`."""

    def __init__(self, node: MPI.Intracomm,
                 layout: Mapping[str, tuple[tuple[int, ...], DTypeLike]]):
        from mpi4py import MPI
        self.node = node
        sizes = {k: int(np.prod(shape)) * np.dtype(dtype).itemsize
                 for k, (shape, dtype) in layout.items()}
        offsets = dict(zip(layout, np.cumsum([0] + [aligned(n) for n in sizes.values()])))
        self.nbytes = int(sum(aligned(n) for n in sizes.values()))
        self.win = allocate_shared(self.nbytes if node.Get_rank() == 0 else 0, node,  # [dist]
                                   "the node's one copy of the demonstrations")
        self.win.Lock_all(MPI.MODE_NOCHECK)
        memory = window_bytes(self.win.Shared_query(0)[0])
        self.arrays: dict[str, np.ndarray] = {
            k: memory[offsets[k]:offsets[k] + sizes[k]].view(dtype).reshape(shape)
            for k, (shape, dtype) in layout.items()}

    @classmethod
    def gathered(cls, node: MPI.Intracomm, rows: Mapping[str, np.ndarray],
                 layout: Mapping[str, tuple[tuple[int, ...], DTypeLike]]) -> NodeArrays:
        """Collective: every rank's `rows` ({name: (n, *shape)}, n its own, maybe 0) one after
        the other in rank order, as arrays of `layout` (name -> (per-row shape, dtype)), sealed."""
        count = len(next(iter(rows.values())))
        first = node.exscan(count) or 0  # [dist]
        total = node.allreduce(count)  # [dist]
        shared = cls(node, {k: ((total, *shape), dtype) for k, (shape, dtype) in layout.items()})
        for key, array in shared.arrays.items():
            array[first:first + count] = rows[key]
        shared.seal()  # [dist]
        return shared

    def seal(self) -> None:
        """Collective: every rank's stores are in and seen by all; the arrays read-only."""
        self.win.Sync()
        self.node.Barrier()  # [dist]
        self.win.Sync()
        for array in self.arrays.values():
            array.flags.writeable = False

    def free(self) -> None:
        """Collective: after every rank's last read of `arrays`."""
        self.arrays.clear()
        self.win.Unlock_all()
        self.win.Free()  # [dist]
