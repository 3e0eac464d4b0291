"""Run under MPI: build the communicators of a config and check them rank by rank against the
plan. Expected memberships are derived here from the plan's fields, not from hpcvla's code.

    mpiexec -n 8 python -m mpi4py tests/mpi/check_comms.py CONFIG [key=value ...]
"""

import sys

import numpy as np
from mpi4py import MPI

from hpcvla.config import load_config
from hpcvla.job.runtime import run_ranks
from hpcvla.topology.comms import members


def expected(plan, rank):
    info, rpn = plan.ranks[rank], plan.ranks_per_node
    want = {"node": tuple(range(info.node * rpn, (info.node + 1) * rpn))}
    for name, role in (("simulators", "simulator"), ("inference", "inference")):
        want[name] = plan.with_role(role) if role in info.roles else ()
    want["learners"] = plan.learners if "learner" in info.roles else ()
    want["cell"] = ()
    if info.cell is not None:
        cell = plan.cells[info.cell]
        want["cell"] = (cell.inference, *cell.simulators) if plan.mode != "colocated" else (rank,)
    learner = plan.feeds.get(rank, rank if "learner" in info.roles else None)
    want["feed"] = () if learner is None else (
        (learner,) + tuple(sorted(p for p, dst in plan.feeds.items() if dst == learner
                                  and p != learner)))
    want["control"] = plan.control_plane if rank in plan.control_plane else ()
    return want


def check(cfg, plan, comms):
    rank = comms.world.Get_rank()
    got = {name: members(getattr(comms, name)) for name in expected(plan, rank)}
    mismatches = {k: (got[k], v) for k, v in expected(plan, rank).items() if got[k] != v}
    assert not mismatches, f"rank {rank}: got vs expected {mismatches}"

    # The node communicator must really share memory: every rank writes its rank into a
    # shared window, everyone reads all of them back.
    size = comms.node.Get_size()
    win = MPI.Win.Allocate_shared(8 * size if comms.node.Get_rank() == 0 else 0, 8,
                                  comm=comms.node)
    buf, _ = win.Shared_query(0)
    table = np.ndarray(buffer=buf, dtype=np.int64, shape=(size,))
    win.Fence()
    table[comms.node.Get_rank()] = rank
    win.Fence()
    assert tuple(table) == got["node"], (tuple(table), got["node"])
    win.Free()

    checked = comms.world.reduce(len(got), root=0)
    if rank == 0:
        print(f"communicators match the plan on all {plan.world_size} ranks "
              f"({checked} memberships, {plan.num_nodes} nodes, mode {plan.mode})", flush=True)


if __name__ == "__main__":
    sys.exit(run_ranks(load_config(sys.argv[1], sys.argv[2:]), check))
