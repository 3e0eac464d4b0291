"""MPI communicators built from a RankPlan, and the checks that the real world matches it.

Every `Split` below is collective over COMM_WORLD and runs on every rank, whatever its role
(a collective inside a role-only branch is the classic deadlock). A rank outside a group gets
MPI.COMM_NULL for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from mpi4py import MPI

from hpcvla.topology.plan import INF, LEARN, SIM, PlanError, RankPlan


@dataclass
class Communicators:
    world: MPI.Comm
    node: MPI.Comm          # ranks of this (possibly emulated) node; shared-memory capable
    simulators: MPI.Comm    # all simulator ranks
    inference: MPI.Comm     # all inference ranks
    learners: MPI.Comm      # the data-parallel learner group, in plan.learners order
    cell: MPI.Comm          # this cell; its inference rank is rank 0
    feed: MPI.Comm          # a learner (rank 0) and the producers streaming to it
    control: MPI.Comm       # weight root (rank 0) and the node leaders

    def free(self) -> None:
        for f in fields(self):
            comm = getattr(self, f.name)
            if comm is not self.world and comm != MPI.COMM_NULL:
                comm.Free()
            setattr(self, f.name, MPI.COMM_NULL)


def members(comm: MPI.Comm) -> tuple[int, ...]:
    """World ranks of `comm`'s members in `comm` rank order (() for COMM_NULL)."""
    if comm == MPI.COMM_NULL:
        return ()
    group, world_group = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(group.Translate_ranks(list(range(comm.Get_size())), world_group))
    finally:
        group.Free()
        world_group.Free()


def real_ranks_per_node(world: MPI.Comm = MPI.COMM_WORLD) -> int:
    """Ranks per real (shared-memory) node; raises PlanError if nodes differ in rank count."""
    shared = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    sizes = world.allgather(shared.Get_size())
    shared.Free()
    if len(set(sizes)) != 1:
        raise PlanError(f"nodes hold different numbers of ranks ({sorted(set(sizes))}): ask the "
                        "scheduler for the same number of tasks on every node")
    return sizes[0]


def build_communicators(plan: RankPlan, world: MPI.Comm = MPI.COMM_WORLD) -> Communicators:
    rank = world.Get_rank()
    if world.Get_size() != plan.world_size:
        raise PlanError(f"plan is for {plan.world_size} ranks, the MPI world has "
                        f"{world.Get_size()}")
    info = plan.ranks[rank]

    # Node: the real shared-memory node, cut into the plan's (possibly emulated) nodes. Every
    # plan node must lie inside one real node, or shared-memory windows could not span it.
    shared = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    real_node_of = world.allgather(min(members(shared)))
    for node in range(plan.num_nodes):
        lo, hi = node * plan.ranks_per_node, (node + 1) * plan.ranks_per_node
        if len(set(real_node_of[lo:hi])) != 1:
            shared.Free()
            raise PlanError(f"plan node {node} (ranks {lo}-{hi - 1}) spans several real nodes: "
                            "launch ranks in blocks (srun --distribution=block, mpiexec "
                            "-ppn/--map-by) or set placement.ranks_per_node to the real size")
    node = shared.Split(color=info.node, key=rank)
    shared.Free()

    def group(is_member: bool, key: int = rank) -> MPI.Comm:
        return world.Split(MPI.UNDEFINED if not is_member else 0, key)

    learner_key = plan.learners.index(rank) if rank in plan.learners else rank
    # A feed is keyed by its learner's world rank; the learner itself takes key 0 (comm rank 0).
    feed_color = plan.feeds.get(rank, rank if LEARN in info.roles else MPI.UNDEFINED)
    control = plan.control_plane
    return Communicators(
        world=world,
        node=node,
        simulators=group(SIM in info.roles),
        inference=group(INF in info.roles),
        learners=group(LEARN in info.roles, learner_key),
        cell=world.Split(MPI.UNDEFINED if info.cell is None else info.cell,
                         0 if INF in info.roles else rank + 1),
        feed=world.Split(feed_color, 0 if LEARN in info.roles else rank + 1),
        control=group(rank in control, control.index(rank) if rank in control else rank),
    )


# Set in a world a command's `--ranks` started on purpose (job/launch.run_local_world): its
# ranks are not the allocation's tasks, though inside a job
LOCAL_WORLD = "HPCVLA_LOCAL_WORLD"


def scheduler_world_size(environ=os.environ) -> tuple[str, int] | None:
    """(where it came from, ranks the batch scheduler allocated), or None outside a job or
    in a world `hpcvla train --ranks` started on purpose inside one."""
    if environ.get(LOCAL_WORLD):
        return None
    if environ.get("HPCVLA_JOB_RANKS"):
        return "the job's allocation (HPCVLA_JOB_RANKS, jobs/launch.sh)", \
            int(environ["HPCVLA_JOB_RANKS"])
    if environ.get("SLURM_JOB_ID") and environ.get("SLURM_NTASKS"):
        return "SLURM_NTASKS", int(environ["SLURM_NTASKS"])
    nodefile = environ.get("PBS_NODEFILE")
    if environ.get("PBS_JOBID") and nodefile and os.path.exists(nodefile):
        with open(nodefile) as handle:
            return f"PBS_NODEFILE ({nodefile})", sum(1 for line in handle if line.strip())
    return None


def check_scheduler_world(world_size: int, environ=os.environ) -> None:
    """Stop if the MPI world is not what the scheduler allocated (e.g. N singletons)."""
    expected = scheduler_world_size(environ)
    if expected is None or expected[1] == world_size:
        return
    source, count = expected
    hint = (" Every rank started as its own 1-rank world: the launcher and MPI disagree on "
            "PMI (e.g. MPICH's mpiexec or srun --mpi=pmi2, Open MPI's mpirun or "
            "srun --mpi=pmix)."
            if world_size == 1 else "")
    raise PlanError(f"MPI world has {world_size} ranks but {source} says {count}.{hint} "
                    "Launch as many ranks as allocated, or set launch.check_scheduler=false "
                    "to run a smaller world on purpose.")
