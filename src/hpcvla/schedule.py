"""The five execution modes as schedules of the same roles, and the rules a layout must meet.

Each mode only changes *when* things happen; the env, policy, the algorithm's loss and transport
are the same. `MODE_TRAITS` is the one place a mode's traits are spelled; the roles, the scale
model, the planner, the config checks and the benches all read them from here:

| mode               | shards | batcher (B_max, T_max) | max staleness | learner         |
|--------------------|--------|------------------------|---------------|-----------------|
| sync-colocated     | 1      | none (own loop)        | 0             | after rollout   |
| sync-disaggregated | 1      | all envs, wait for all | 0             | whole batch     |
| train-async        | 1      | all envs, wait for all | config        | whole batch     |
| rollout-async      | config | config                 | config        | whole batch     |
| streamer           | config | config                 | config        | per micro-batch |

Staleness is enforced by a per-producer quota: a producer that feeds learner L gets
`quota = segments per learner batch / producers of L` segments per policy version, and may
start segment number c only while `c < (v + 1 + max_staleness) * quota`, v being the policy
version it acts with; the segment is tagged for learner batch b = c // quota. The learner
trains batch b at version b, whatever order segments arrive in, so every sample of batch b
was started at version >= b - max_staleness: the bound holds by construction, and
max_staleness = 0 makes rollout and training take turns. `eligible` is that rule, used by
the inference rank (roles/inference.py) and replayed by the scale model (scale/model.py).

Pure: no MPI, no torch, no envs or devices (preflight.py adds the checks that need them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, TypeVar

from hpcvla.topology.plan import PlanError, RankPlan, build_plan

T = TypeVar("T")


@dataclass(frozen=True)
class ModeTraits:
    colocated: bool           # every rank simulates, infers and trains in lock-step
    sharded: bool             # a simulator's envs are split into env.shards shards
    dynamic_batcher: bool     # forward passes fire on rollout.batch_max / wait_max_ms
    bounded_staleness: bool   # pipeline.max_staleness applies (otherwise 0)
    streamed: bool            # the learner trains each micro-batch as soon as it arrives


MODE_TRAITS = {
    "sync-colocated": ModeTraits(True, False, False, False, False),
    "sync-disaggregated": ModeTraits(False, False, False, False, False),
    "train-async": ModeTraits(False, False, False, True, False),
    "rollout-async": ModeTraits(False, True, True, True, False),
    "streamer": ModeTraits(False, True, True, True, True),
}
MODES = tuple(MODE_TRAITS)


def traits(mode: str) -> ModeTraits:
    return MODE_TRAITS[mode]


@dataclass(frozen=True)
class Schedule:
    mode: str
    shards: int
    batch_max: int         # envs per forward pass
    wait_max_s: float      # seconds the oldest request may wait
    max_staleness: int
    stream_micro_batches: bool


# ------------------------------------------------------------------ what a config gives
# The settings read here, as protocols that the run's Config (config/schema.py) meets: the
# config imports this module (its MODES), so this module cannot import the config.
class _PipelineSettings(Protocol):
    mode: str
    max_staleness: int


class _EnvSettings(Protocol):
    envs_per_simulator: int
    shards: int
    chunk_len: int


class _RolloutSettings(Protocol):
    segment_len: int
    batch_max: int
    wait_max_ms: float


class _LearnerSettings(Protocol):
    micro_batch: int
    micro_batches: int
    epochs: int


class _PlacementSettings(Protocol):
    per_node: dict[str, int]


class _AlgorithmTraits(Protocol):
    @property
    def advantage(self) -> str: ...


class _AlgorithmSettings(Protocol):
    name: str
    group_size: int

    @property
    def traits(self) -> _AlgorithmTraits: ...


class ScheduleSettings(Protocol):
    """What the schedule reads of a run's Config."""

    @property
    def pipeline(self) -> _PipelineSettings: ...
    @property
    def env(self) -> _EnvSettings: ...
    @property
    def rollout(self) -> _RolloutSettings: ...
    @property
    def learner(self) -> _LearnerSettings: ...
    @property
    def placement(self) -> _PlacementSettings: ...
    @property
    def algorithm(self) -> _AlgorithmSettings: ...


def schedule_of(cfg: ScheduleSettings, envs_per_cell: int) -> Schedule:
    mode = cfg.pipeline.mode
    t = traits(mode)
    return Schedule(
        mode=mode,
        shards=cfg.env.shards if t.sharded else 1,
        batch_max=(cfg.rollout.batch_max or envs_per_cell) if t.dynamic_batcher
        else envs_per_cell,
        wait_max_s=cfg.rollout.wait_max_ms / 1e3 if t.dynamic_batcher else math.inf,
        max_staleness=cfg.pipeline.max_staleness if t.bounded_staleness else 0,
        stream_micro_batches=t.streamed)


def shards_problem(envs: int, shards: int) -> tuple[str, int, str] | None:
    """A simulator's envs split evenly among its shards, or why not (field, value, fix)."""
    if envs % shards:
        return ("env.shards", shards, f"a divisor of env.envs_per_simulator ({envs})")
    return None


def shards_of(cfg: ScheduleSettings) -> int:
    """Env shards per simulator rank in the config's mode."""
    return schedule_of(cfg, 1).shards


# ------------------------------------------------------------------ the staleness quota
def staleness_allowance(version: int, max_staleness: int, quota: int, started: int) -> int:
    """Envs' segments a producer may still start acting with `version` (module docstring)."""
    return (version + 1 + max_staleness) * quota - started


def eligible(queued: Iterable[T], starts_segment: Callable[[T], bool], envs: int,
             version: int, max_staleness: int, quota: int, started: int) -> set[T]:
    """The queued requests (in arrival order) that may be served now: those mid-segment, plus
    those starting a segment of `envs` envs while the staleness quota lasts."""
    allowance = staleness_allowance(version, max_staleness, quota, started)
    ok: set[T] = set()
    for item in queued:
        if starts_segment(item):
            if allowance < envs:
                continue
            allowance -= envs
        ok.add(item)
    return ok


def micro_batches_for(segments: int, learners: int, micro_batch: int) -> int | None:
    """The learner.micro_batches with which `learners` train `segments` a version together
    (each learner micro_batch x micro_batches); None where no whole number does."""
    share, rest = divmod(segments, learners * micro_batch)
    return share if share and not rest else None


def producer_quota(cfg: ScheduleSettings, plan: RankPlan, producer: int) -> int:
    """Segments per policy version a producer contributes to its learner's batch."""
    batch = cfg.learner.micro_batch * cfg.learner.micro_batches
    return batch // len(plan.producers_of(plan.feeds[producer]))


def envs_of_cell(cfg: ScheduleSettings, plan: RankPlan, cell: int) -> int:
    return len(plan.cells[cell].simulators) * cfg.env.envs_per_simulator


# ------------------------------------------------------------------ layouts
@dataclass(frozen=True)
class Layout:
    """What a config decides: mode, rank roles and the schedule's knobs."""
    mode: str = "streamer"            # pipeline.mode
    world: int = 4
    ranks_per_node: int = 4
    per_node: dict[str, int] = field(default_factory=lambda: {"simulator": 2, "inference": 1,
                                                    "learner": 1})
    envs: int = 16                    # env.envs_per_simulator
    shards: int = 2                   # env.shards
    batch_max: int = 0                # rollout.batch_max (0: the envs of a cell)
    wait_max_s: float = 0.005         # rollout.wait_max_ms / 1e3
    chunk_len: int = 4                # H
    segment_len: int = 8              # T
    micro_batch: int = 16
    micro_batches: int = 2
    epochs: int = 1
    max_staleness: int = 1

    @classmethod
    def from_config(cls, cfg: ScheduleSettings, world: int, ranks_per_node: int) -> "Layout":
        return cls(cfg.pipeline.mode, world, ranks_per_node, dict(cfg.placement.per_node),
                   cfg.env.envs_per_simulator, cfg.env.shards, cfg.rollout.batch_max,
                   cfg.rollout.wait_max_ms / 1e3, cfg.env.chunk_len, cfg.rollout.segment_len,
                   cfg.learner.micro_batch, cfg.learner.micro_batches, cfg.learner.epochs,
                   cfg.pipeline.max_staleness)

    @property
    def traits(self) -> ModeTraits:
        return traits(self.mode)

    @property
    def effective_shards(self) -> int:
        return self.shards if self.traits.sharded else 1

    @property
    def envs_per_shard(self) -> int:
        return self.envs // self.effective_shards

    def to_overrides(self) -> list[str]:
        """The layout as `hpcvla train` overrides."""
        t = self.traits
        out = [f"pipeline.mode={self.mode}", f"placement.ranks_per_node={self.ranks_per_node}",
               f"env.envs_per_simulator={self.envs}", f"env.chunk_len={self.chunk_len}",
               f"rollout.segment_len={self.segment_len}",
               f"learner.micro_batch={self.micro_batch}",
               f"learner.micro_batches={self.micro_batches}", f"learner.epochs={self.epochs}"]
        if t.colocated:
            return ["placement.mode=colocated"] + out
        pn = ", ".join(f"{k}: {v}" for k, v in self.per_node.items())
        # the layout's learners sit beside the cells, per_node says how many: none on nodes
        # of their own, no cap
        out = ["placement.mode=disaggregated", f"placement.per_node={{{pn}}}",
               "placement.learner_nodes=0", "placement.learners=0"] + out
        if t.sharded:
            out.append(f"env.shards={self.shards}")
        if t.dynamic_batcher:
            out += [f"rollout.batch_max={self.batch_max}",
                    f"rollout.wait_max_ms={self.wait_max_s * 1e3:g}"]
        if t.bounded_staleness:
            out.append(f"pipeline.max_staleness={self.max_staleness}")
        return out


def layout_problems(mode: str, envs: int, shards: int, micro_batch: int, micro_batches: int,
                    plan: RankPlan | None, group_size: int = 0) -> list[tuple[str, object, str]]:
    """Why the pipeline would refuse to run `mode` on `plan`, as (field, value, what would be
    valid); empty when it runs. `shards`: env.shards (ignored by the unsharded modes);
    `group_size`: GRPO's group size (0: not GRPO); `plan`: the rank plan (colocated or
    disaggregated)."""
    t = traits(mode)
    problems: list[tuple[str, object, str]] = []
    if plan is not None:
        if t.colocated != (plan.mode == "colocated"):
            problems.append(("placement.mode", plan.mode,
                             "colocated (sync-colocated runs every stage on every rank)"
                             if t.colocated else f"disaggregated for pipeline.mode={mode} "
                                                 "(or pipeline.mode=sync-colocated)"))
        if plan.mode == "hybrid":
            problems.append(("placement.mode", "hybrid",
                             "colocated or disaggregated: hybrid is plan-only (`hpcvla plan` "
                             "and the transport tests), not a training mode"))
    shards = shards if t.sharded else 1
    uneven = shards_problem(envs, shards)
    if uneven:
        problems.append(uneven)
        return problems
    per_shard = envs // shards
    if micro_batch % per_shard:
        problems.append(("learner.micro_batch", micro_batch,
                         f"a multiple of the envs per shard ({per_shard} = "
                         f"env.envs_per_simulator / {shards} shard(s) in this mode)"))
    if group_size and per_shard % group_size:
        problems.append(("algorithm.group_size", group_size,
                         f"a divisor of the envs per shard ({per_shard}): a group's "
                         "episodes restart together"))
    if not t.colocated and not problems and plan is not None:
        batch = micro_batch * micro_batches
        for learner in plan.learners:
            producers = len(plan.producers_of(learner))
            if batch % producers or (batch // producers) % per_shard:
                problems.append(("learner.micro_batches", micro_batches,
                                 f"a value making the learner batch ({batch} segments) split "
                                 f"into equal parts for its {producers} producer(s), each a "
                                 f"multiple of {per_shard} envs per shard"))
                break
    return problems


def config_layout_problems(cfg: ScheduleSettings, plan: RankPlan) -> list[tuple[str, object, str]]:
    """layout_problems of a config on `plan`, and a dynamic batcher's B_max that no cell
    can fill (every forward pass would wait out T_max)."""
    problems = layout_problems(cfg.pipeline.mode, cfg.env.envs_per_simulator,
                               cfg.env.shards, cfg.learner.micro_batch,
                               cfg.learner.micro_batches, plan,
                               cfg.algorithm.group_size
                               if cfg.algorithm.traits.advantage == "group" else 0)
    smallest = min((envs_of_cell(cfg, plan, c) for c in range(len(plan.cells))), default=0)
    if traits(cfg.pipeline.mode).dynamic_batcher and smallest and \
            cfg.rollout.batch_max > smallest:
        problems.append(("rollout.batch_max", cfg.rollout.batch_max,
                         f"at most the envs of every cell (the smallest holds {smallest}: its "
                         "simulators' env.envs_per_simulator), or 0 for each cell's all: a "
                         "forward pass fires once that many envs wait, which none can there, "
                         "so each would wait out rollout.wait_max_ms"))
    return problems


def layout_problem(lay: Layout) -> str | None:
    """Why the pipeline would refuse `lay` (None: it runs), in one line."""
    plan = None
    if not lay.traits.colocated:
        try:
            plan = build_plan(lay.world, lay.ranks_per_node, "disaggregated", lay.per_node)
        except PlanError as err:
            first = layout_problems(lay.mode, lay.envs, lay.shards, lay.micro_batch,
                                    lay.micro_batches, None)
            return _one_line(first[0]) if first else str(err)
    problems = layout_problems(lay.mode, lay.envs, lay.shards, lay.micro_batch,
                               lay.micro_batches, plan)
    return _one_line(problems[0]) if problems else None


def _one_line(problem: tuple[str, object, str]) -> str:
    name, value, valid = problem
    return f"{name}={value}: expected {valid}"
