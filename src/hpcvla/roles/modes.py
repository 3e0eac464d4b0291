"""The five execution modes as schedules of the same roles (DESIGN.md section 4).

Each mode only changes *when* things happen; the env, policy, PPO loss and transport are the
same. `schedule_of(cfg)` turns `pipeline.mode` into the knobs the roles read:

| mode               | shards | batcher (B_max, T_max)  | max staleness | learner         |
|--------------------|--------|-------------------------|---------------|-----------------|
| sync-colocated     | 1      | all envs, wait for all  | 0             | after rollout   |
| sync-disaggregated | 1      | all envs, wait for all  | 0             | whole batch     |
| train-async        | 1      | all envs, wait for all  | config        | whole batch     |
| rollout-async      | config | config                  | config        | whole batch     |
| streamer           | config | config                  | config        | per micro-batch |

Staleness is enforced by a per-producer quota: a producer that feeds learner L gets
`quota = segments per learner batch / producers of L` segments per policy version, and may
start segment number c only while `c < (v + 1 + max_staleness) * quota`, v being the policy
version it acts with; the segment is tagged for learner batch b = c // quota. The learner
trains batch b at version b, whatever order segments arrive in, so every sample of batch b
was started at version >= b - max_staleness: the bound holds by construction, and
max_staleness = 0 makes rollout and training take turns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpcvla.config.loader import ConfigError
from hpcvla.envs import check_env, env_uses_gpu
from hpcvla.topology.plan import PlanError, RankPlan


@dataclass(frozen=True)
class Schedule:
    mode: str
    shards: int
    batch_max: float       # envs per forward pass
    wait_max_s: float      # seconds the oldest request may wait
    max_staleness: int
    stream_micro_batches: bool


def schedule_of(cfg, envs_per_cell: int) -> Schedule:
    mode = cfg.pipeline.mode
    overlap_rollout = mode in ("rollout-async", "streamer")
    batch_max = (cfg.rollout.batch_max or envs_per_cell) if overlap_rollout else envs_per_cell
    return Schedule(
        mode=mode,
        shards=cfg.env.shards if overlap_rollout else 1,
        batch_max=batch_max,
        wait_max_s=cfg.rollout.wait_max_ms / 1e3 if overlap_rollout else math.inf,
        max_staleness=cfg.pipeline.max_staleness if mode not in (
            "sync-colocated", "sync-disaggregated") else 0,
        stream_micro_batches=mode == "streamer")


def check_pipeline(cfg, plan: RankPlan) -> None:
    """Problems of running `cfg`'s pipeline on `plan`, as one ConfigError (before ranks start)."""
    problems = []
    colocated = cfg.pipeline.mode == "sync-colocated"
    if colocated != (plan.mode == "colocated"):
        problems.append(("placement.mode", plan.mode,
                         "colocated (sync-colocated runs every stage on every rank)" if colocated
                         else f"disaggregated for pipeline.mode={cfg.pipeline.mode} "
                              "(or pipeline.mode=sync-colocated)"))
    if plan.mode == "hybrid":
        problems.append(("placement.mode", "hybrid",
                         "colocated or disaggregated: hybrid layouts cannot run the pipeline yet"))
    shards = schedule_of(cfg, 1).shards
    envs_per_shard = cfg.env.envs_per_simulator // shards
    if cfg.learner.micro_batch % envs_per_shard:
        problems.append(("learner.micro_batch", cfg.learner.micro_batch,
                         f"a multiple of the envs per shard ({envs_per_shard} = "
                         f"env.envs_per_simulator / {shards} shard(s) in this mode)"))
    if cfg.algorithm.name == "grpo" and envs_per_shard % cfg.algorithm.group_size:
        problems.append(("algorithm.group_size", cfg.algorithm.group_size,
                         f"a divisor of the envs per shard ({envs_per_shard}): a group's "
                         "episodes restart together"))
    if not colocated and not problems:
        batch = cfg.learner.micro_batch * cfg.learner.micro_batches
        for learner in plan.learners:
            producers = len(plan.producers_of(learner))
            quota = batch // producers
            if batch % producers or quota % envs_per_shard:
                problems.append(("learner.micro_batches", cfg.learner.micro_batches,
                                 f"a value making the learner batch ({batch} segments) split "
                                 f"into equal parts for its {producers} producer(s), each a "
                                 f"multiple of {envs_per_shard} envs per shard"))
                break
    if cfg.placement.gpus_per_node > 0:  # a GPU count given: the device map must work
        from hpcvla.devices import plan_devices
        try:
            plan_devices(plan, cfg.placement.gpus_per_node, env_uses_gpu(cfg.env))
        except PlanError as err:
            problems.append(("placement.gpus_per_node", cfg.placement.gpus_per_node, str(err)))
    if problems:
        raise ConfigError(problems, "pipeline configuration")
    check_env(cfg)  # the simulator is installed and can run the task


def producer_quota(cfg, plan: RankPlan, producer: int) -> int:
    """Segments per policy version a producer contributes to its learner's batch."""
    batch = cfg.learner.micro_batch * cfg.learner.micro_batches
    return batch // len(plan.producers_of(plan.feeds[producer]))


def envs_of_cell(cfg, plan: RankPlan, cell: int) -> int:
    return len(plan.cells[cell].simulators) * cfg.env.envs_per_simulator
