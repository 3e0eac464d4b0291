"""The workloads of the benchmarks and the scale model: the emulated stage-cost presets,
the rendered real-simulator workloads, the overrides that set them, and the ideal bound of
an emulated run.

An emulated cost is a calibrated delay: a simulator shard step waits for the slowest of its
envs' lognormal latencies (shards in flight together), an inference forward costs a + b *
batch ms, a learner micro-batch costs a fixed time per epoch. The model is tiny (32 px
images), so the delays, not the machine's cores, set the pace. `bench modes`, `bench scale
--validate` and `plan --auto --costs balanced|table3` (scale/probe.py) all read them here.
"""

from __future__ import annotations

import math

from hpcvla.schedule import traits

# Stage costs (ms) and sizes. An emulated cost is a stage's whole duration (the tiny real
# compute runs inside it). `envs` are per accelerator rank (colocated) = per simulator rank.
# `balanced`: with 32 envs per simulator, 2 simulators per cell, chunks of 4, segments of 8,
# micro-batches of 16, every stage of a cell can do ~3000 env steps/s when half the cell's
# envs step while the other half is served: inference 32 x 4 / (10.7 + 1.0 x 32) ms, learner
# 16 x 8 x 4 / 170 ms, and the 64 envs in their closed loop, each stepping (mean
# 37.7 x e^(0.5^2/2) = 42.7 ms) then waiting for a forward pass of 32 (42.7 ms):
# 64 x 4 / 85.4 ms.
# `table3`: RL-VLA³ Table 3 (pi0 on LIBERO, 8 GPUs, colocated) spends rollout:actor =
# 1950 s : 860 s = 2.27. Here a colocated update rolls out 2 x 8 chunk-steps of 16 envs at
# (60 ms x e^(0.8^2/2) + 10 + 0.6 x 16 ms) = 102 ms each = 1.63 s, and trains 2 micro-batches
# of 360 ms = 0.72 s: the same 2.27.
# The learner's cost is per segment trained (a micro-batch of 16 costs 16x that).
PRESETS = {
    "balanced": {"sim_ms": 37.7, "sigma": 0.5, "inf_a_ms": 10.7, "inf_b_ms": 1.0,
                 "learn_ms_per_segment": 170.0 / 16, "envs": 32},
    "table3": {"sim_ms": 60.0, "sigma": 0.8, "inf_a_ms": 10.0, "inf_b_ms": 0.6,
               "learn_ms_per_segment": 360.0 / 16, "envs": 16},
}
# What `hpcvla plan --auto --costs` (and HPCVLA_AUTOPLAN) name: scale/probe.named_costs
COST_NAMES = ("config", *PRESETS, "pi0-libero")


# Real simulators: rendered observations, a tiny policy, batches small enough that a few
# updates take seconds on CPU (a LIBERO env-chunk costs ~0.2-0.5 s here). The learner batch
# (4 x 2 segments) equals the envs of a cell (2 x 4): the synchronous modes stall on less.
SIM_COMMON = ["env.image_size=64", "policy.hidden=32", "learner.micro_batch=4",
              "learner.micro_batches=2", "learner.epochs=1", "rollout.segment_len=4"]
SIM_WORKLOADS = {
    "maniskill": ["env.name=maniskill", "env.task=PickCube-v1", "env.reward=dense",
                  "env.chunk_len=5", "env.max_episode_chunks=16", *SIM_COMMON],
    "libero": ["env.name=libero", "env.suite=libero_spatial", "env.suite_task=0",
               "env.chunk_len=10", "env.max_episode_chunks=48", *SIM_COMMON],
}


def ranks_for(mode: str, gpus: int) -> int:
    """Ranks of a benchmark world on `gpus` accelerators: colocated, a rank per accelerator;
    otherwise as many CPU simulator ranks again."""
    return gpus if traits(mode).colocated else 3 if gpus == 1 else 2 * gpus


def learner_delay(preset: dict, micro_batch: int) -> str:
    """The emulated learner's delay per micro-batch of `micro_batch` segments."""
    return f"emulate.learner_ms_per_micro_batch={preset['learn_ms_per_segment'] * micro_batch}"


def emulated_cost_overrides(preset: dict, micro_batch: int) -> list[str]:
    """The overrides that make a run cost what `preset` says (a tiny model, delays)."""
    return ["env.image_size=32", "policy.hidden=32",
            f"env.latency_median_ms={preset['sim_ms']}", f"env.latency_sigma={preset['sigma']}",
            f"emulate.inference_ms={preset['inf_a_ms']}",
            f"emulate.inference_ms_per_env={preset['inf_b_ms']}",
            learner_delay(preset, micro_batch)]


def emulated_workload(preset: dict, envs: int, micro_batch: int, staleness: int,
                      mode: str) -> list[str]:
    """The emulated workload of `bench modes` in `mode`: the preset's costs, one epoch, and
    the async modes' knobs where the mode reads them: every env its own shard (a shard waits
    for its slowest env), a forward pass serves up to one simulator's envs (half a cell) and
    waits at most 2 ms to fill, producers may run `staleness` versions ahead. Shards of one
    env and 2 ms beat shards of 4 envs and 20 ms on both presets, most on table3's long tail
    (sigma 0.8), which made larger shards wait."""
    t = traits(mode)
    return [*([f"rollout.batch_max={envs}", "rollout.wait_max_ms=2"] if t.dynamic_batcher
              else []), f"env.shards={envs}",
            *([f"pipeline.max_staleness={staleness}"] if t.bounded_staleness else []),
            "learner.epochs=1", *emulated_cost_overrides(preset, micro_batch)]


def ideal_bound(mode, cfg, preset, gpus) -> float:
    """Env steps/s no schedule can beat, from the emulated costs. Capacities (env steps/s)
    from mean costs, no tail: simulators n_sim * E * H / L_mean; inference
    n_inf * B * H / (a + b B) with B the envs of a cell; learners
    n_learn * micro * T * H / (epochs * c). Colocated is bounded by its serial sum per rank."""
    E, H, T = cfg.env.envs_per_simulator, cfg.env.chunk_len, cfg.rollout.segment_len
    latency = preset["sim_ms"] * math.exp(preset["sigma"] ** 2 / 2) / 1e3  # lognormal mean
    micro, epochs = cfg.learner.micro_batch, cfg.learner.epochs
    learn_s = preset["learn_ms_per_segment"] * micro / 1e3 * epochs  # per micro-batch
    if traits(mode).colocated:  # per rank: roll out a batch, then train it, one at a time
        batch = micro * cfg.learner.micro_batches
        infer_s = (preset["inf_a_ms"] + preset["inf_b_ms"] * E) / 1e3
        rollout_s = batch / E * T * (latency + infer_s)
        return gpus * batch * T * H / (rollout_s + cfg.learner.micro_batches * learn_s)
    per_node = cfg.placement.per_node
    nodes = ranks_for(mode, gpus) // cfg.placement.ranks_per_node
    n_sim, n_inf, n_learn = (nodes * per_node[r] for r in ("simulator", "inference", "learner"))
    cell = E * n_sim // n_inf
    a, b = preset["inf_a_ms"] / 1e3, preset["inf_b_ms"] / 1e3
    # closed loop: each env step is a simulator step plus at least a forward pass of one env
    c_sim = n_sim * E * H / (latency + a + b)
    c_inf = n_inf * cell * H / (a + b * cell)
    c_learn = n_learn * micro * T * H / learn_s
    return min(c_sim, c_inf, c_learn)
