"""Every setting hpcvla reads, with what it does and what it trades off.

A section is a dataclass; a setting is a field declared with `setting(...)`, whose `doc` says
what the value means and what raising or lowering it costs (the style of Sample Factory's
flags). `hpcvla config --doc` prints this file's documentation as a table.

Fields are checked by `hpcvla.config.loader`: types from the annotations, `choices`, and the
numeric bounds `ge`/`le`. Checks that involve several fields live in `Config.check`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def setting(default: Any, doc: str, *, choices: tuple | None = None,
            ge: float | None = None, le: float | None = None) -> Any:
    """A documented config field. Mutable defaults (dicts) are copied per instance."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "le": le}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


ROLES = ("simulator", "inference", "learner")
PLACEMENT_MODES = ("colocated", "disaggregated", "hybrid")


@dataclass
class RunConfig:
    name: str = setting(
        "default", "Run name; the run directory is `<root>/<name>-<timestamp>`.")
    root: str = setting(
        "runs", "Directory under which run directories are created. Put it on a shared "
        "file system on a cluster so every node's rank 0 sees the same path.")
    seed: int = setting(
        0, "Base random seed; each rank derives its own from it and its rank.", ge=0)


@dataclass
class PlacementConfig:
    mode: str = setting(
        "disaggregated",
        "How ranks get roles. `colocated`: every rank simulates, infers and learns in turn "
        "(no extra ranks, but stages cannot overlap on one rank). `disaggregated`: each rank "
        "has one role (stages overlap; needs enough ranks per stage). `hybrid`: simulators "
        "have their own ranks, every inference rank also learns (RLinf's hybrid: the GPU is "
        "shared by inference and training, simulator CPU work overlaps both).",
        choices=PLACEMENT_MODES)
    ranks_per_node: int = setting(
        0, "Ranks per node. 0 = the real node size (ranks sharing memory, as MPI reports). "
        "A positive value splits each real node into emulated nodes of this many ranks, to "
        "test multi-node layouts on one machine; it must divide the real node size.", ge=0)
    per_node: dict[str, int] = setting(
        {"simulator": 2, "inference": 1, "learner": 1},
        "Rank count per role on every rollout node (disaggregated, hybrid; ignored when "
        "colocated); must sum to ranks_per_node. Simulators of a node are split evenly among "
        "its inference ranks into cells, so inference <= simulator. More simulator ranks "
        "per inference rank give bigger inference batches but longer action waits. In "
        "hybrid mode learner must be 0 (inference ranks learn). The rollout:learner ratio "
        "of the papers (1:1, 2:1, 3:1) is inference ranks : learner ranks.")
    learner_nodes: int = setting(
        0, "Disaggregated only: this many nodes at the end of the allocation hold only "
        "learners (every rank a learner), keeping gradient traffic off the rollout nodes. "
        "0 = learners live on the rollout nodes as per_node says.", ge=0)


@dataclass
class LearnerConfig:
    backend: str = setting(
        "deepspeed", "Data-parallel engine of the learner group. `horovod` only where the "
        "site provides it.", choices=("deepspeed", "horovod"))
    zero_stage: int = setting(
        1, "DeepSpeed ZeRO stage. 0: plain data parallel (fastest, every learner holds "
        "everything). 1: shard optimizer state. 2: + gradients. 3: + parameters (least "
        "memory per learner, most communication).", ge=0, le=3)


@dataclass
class LaunchConfig:
    mpiexec: str = setting(
        "auto", "mpiexec used by `hpcvla launch`/`train --ranks`. `auto`: the one installed "
        "beside this Python (the MPI mpi4py runs on), else the first on PATH.")
    check_scheduler: bool = setting(
        True, "Stop at start-up unless the MPI world size equals what Slurm (SLURM_NTASKS) "
        "or PBS (PBS_NODEFILE) allocated: a wrong PMI silently starts N one-rank worlds.")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def check(self) -> list[tuple[str, Any, str]]:
        """Cross-field problems as (field, value, what would be valid); empty when fine."""
        problems = []
        per_node = self.placement.per_node
        unknown = sorted(set(per_node) - set(ROLES))
        if unknown:
            problems.append(("placement.per_node", per_node,
                             f"keys among {', '.join(ROLES)} (got {', '.join(unknown)})"))
        for role, count in per_node.items():
            if role in ROLES and count < 0:
                problems.append((f"placement.per_node.{role}", count, "a count >= 0"))
        if self.placement.learner_nodes and self.placement.mode != "disaggregated":
            problems.append(("placement.learner_nodes", self.placement.learner_nodes,
                             "0 unless placement.mode is disaggregated"))
        return problems
