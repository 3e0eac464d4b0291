"""`hpcvla bench modes`: the five execution modes on one workload, in one invocation.

Every mode runs the real pipeline (`hpcvla train`, one MPI world per mode) on the same
accelerators: `gpus` GPU ranks (colocated: `gpus` ranks doing everything; otherwise half
inference, half learners) and, outside colocated, `gpus` simulator ranks on CPU, with the same
total number of envs. Reported per mode: throughput (env steps/s, RL-VLA³ Eq. 2), the ideal
bound min(stage capacities), efficiency = throughput / bound, and busy fractions per stage.

Workloads:
* `emulated`: stage costs are calibrated delays (DESIGN.md section 8): a simulator shard step
  waits for the slowest of its envs' lognormal latencies (shards in flight together), an
  inference forward costs a + b * batch ms, a learner micro-batch costs a fixed time per
  epoch. The model is tiny (32 px images), so the delays, not the 2 cores, set the pace.
  Capacities (env steps/s) from mean costs, no tail: simulators n_sim * E * H / L_mean;
  inference n_inf * B * H / (a + b B) with B the envs of a cell; learners
  n_learn * micro * T * H / (epochs * c). Colocated is bounded by its serial sum per rank.
* `real`: the reach env, the default policy and DeepSpeed as configured; the bound comes from
  the measured busy time of each stage (capacity = steps / mean busy seconds of its ranks).
* `maniskill`, `libero`: the same with a real simulator (ManiSkill3 PickCube-v1, LIBERO-Spatial
  task 0) rendering 64 px cameras on CPU, a tiny default policy and small learner batches
  (SIM_WORKLOADS); 4 envs per simulator rank unless told otherwise.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("sync-colocated", "sync-disaggregated", "train-async", "rollout-async", "streamer")

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


def _layout(mode: str, gpus: int) -> list[str]:
    if mode == "sync-colocated":
        return ["placement.mode=colocated"]
    if gpus == 1:  # one GPU: its inference rank and its learner share it (devices.py)
        return ["placement.mode=disaggregated", "placement.ranks_per_node=3",
                "placement.per_node={simulator: 1, inference: 1, learner: 1}"]
    return ["placement.mode=disaggregated", "placement.ranks_per_node=4",  # a cell per node
            "placement.per_node={simulator: 2, inference: 1, learner: 1}"]


def _ranks(mode: str, gpus: int) -> int:
    """Colocated: a rank per accelerator; otherwise as many CPU simulator ranks again."""
    return gpus if mode == "sync-colocated" else 3 if gpus == 1 else 2 * gpus


def _workload(workload: str, preset: dict, envs_per_gpu: int, updates: int,
              mode: str, staleness: int = 2) -> list[str]:
    # Learner batch: 32 segments per learner and version in micro-batches of 16, where a
    # micro-batch may be smaller than a whole unsharded simulator (the sharded modes).
    micro = 16 if mode in ("rollout-async", "streamer") else math.lcm(16, envs_per_gpu)
    common = [f"pipeline.total_updates={updates}", f"env.envs_per_simulator={envs_per_gpu}",
              f"learner.micro_batch={micro}", f"learner.micro_batches={max(1, 32 // micro)}",
              "pipeline.progress_every_s=1000"]
    if workload == "real":
        return common
    if workload in SIM_WORKLOADS:
        return common + SIM_WORKLOADS[workload]
    # The async modes' knobs (the sync modes ignore them): every env its own shard (a shard
    # waits for its slowest env), a forward pass serves up to one simulator's envs (half a
    # cell) and waits at most 2 ms to fill, producers may run `staleness` (2) versions ahead.
    # Against shards of 4 envs and 20 ms, the streamer went 1,900 -> 2,313 env steps/s on
    # balanced and 653 -> 1,196 on table3 (its long tail, sigma 0.8, made shards wait most).
    return common + [
        f"rollout.batch_max={envs_per_gpu}", "rollout.wait_max_ms=2",
        f"env.shards={envs_per_gpu}", f"pipeline.max_staleness={staleness}",
        "env.image_size=32", "policy.hidden=32", "learner.epochs=1",
        f"env.latency_median_ms={preset['sim_ms']}", f"env.latency_sigma={preset['sigma']}",
        f"emulate.inference_ms={preset['inf_a_ms']}",
        f"emulate.inference_ms_per_env={preset['inf_b_ms']}",
        f"emulate.learner_ms_per_micro_batch={preset['learn_ms_per_segment'] * micro}"]


def ideal_bound(mode, cfg, preset, gpus) -> float:
    """Env steps/s no schedule can beat, from the emulated costs (module docstring)."""
    E, H, T = cfg.env.envs_per_simulator, cfg.env.chunk_len, cfg.rollout.segment_len
    latency = preset["sim_ms"] * math.exp(preset["sigma"] ** 2 / 2) / 1e3  # lognormal mean
    micro, epochs = cfg.learner.micro_batch, cfg.learner.epochs
    learn_s = preset["learn_ms_per_segment"] * micro / 1e3 * epochs  # per micro-batch
    if mode == "sync-colocated":  # per rank: roll out a batch, then train it, one at a time
        batch = micro * cfg.learner.micro_batches
        infer_s = (preset["inf_a_ms"] + preset["inf_b_ms"] * E) / 1e3
        rollout_s = batch / E * T * (latency + infer_s)
        return gpus * batch * T * H / (rollout_s + cfg.learner.micro_batches * learn_s)
    per_node, nodes = cfg.placement.per_node, _ranks(mode, gpus) // cfg.placement.ranks_per_node
    n_sim, n_inf, n_learn = (nodes * per_node[r] for r in ("simulator", "inference", "learner"))
    cell = E * n_sim // n_inf
    a, b = preset["inf_a_ms"] / 1e3, preset["inf_b_ms"] / 1e3
    # closed loop: each env step is a simulator step plus at least a forward pass of one env
    c_sim = n_sim * E * H / (latency + a + b)
    c_inf = n_inf * cell * H / (a + b * cell)
    c_learn = n_learn * micro * T * H / learn_s
    return min(c_sim, c_inf, c_learn)


def _measured_bound(summary: dict) -> float:
    """min over stages of steps / (busy seconds per rank of that stage)."""
    steps, busy = summary["env_steps"], {}
    for rank in summary["per_rank"]:
        for stage, seconds in rank["busy_s"].items():
            if stage in ("simulate", "infer", "train"):
                busy.setdefault(stage, []).append(seconds)
    caps = [steps / (sum(v) / len(v)) for v in busy.values() if sum(v) > 0]
    return min(caps) if caps else float("nan")


def cases(sweep: str | None, envs: int, staleness: int = 2) -> list[tuple]:
    """(label, mode, envs per simulator, extra overrides, max_staleness) of each run: the five
    modes, or a sweep. Extra overrides None: the layout `plan --auto` picks."""
    if sweep is None:
        return [(mode, mode, envs, [], staleness) for mode in MODES]
    if sweep == "batching":  # RL-VLA³ Fig. 8: B_max x T_max for the streamer
        return [(f"streamer B_max={b} T_max={t}ms", "streamer", envs,
                 [f"rollout.batch_max={b}", f"rollout.wait_max_ms={t}"], staleness)
                for b in (8, 16, 32) for t in (1, 5, 20)]
    if sweep == "auto":  # each mode at the layout `hpcvla plan --auto` picks for it; the
        # streamer also under the looser bounds plan --auto predicts for (it never loosens one)
        return [(f"{mode} (plan --auto)", mode, envs, None, staleness)
                for mode in ("sync-colocated", "streamer")] + [
                (f"streamer (plan --auto) S={s}", "streamer", envs, None, s)
                for s in (staleness + 1, staleness + 2)]
    if sweep == "envs":  # D-VLA Fig. 7: environments per simulator rank
        return [(f"{mode} E={e}", mode, e, [], staleness) for e in (16, 32, 64)
                for mode in ("sync-colocated", "streamer")]
    raise ValueError(f"--sweep {sweep!r}: expected batching, envs or auto")


def auto_layout(mode: str, base: list[str], preset_name: str, preset: dict,
                gpus: int) -> tuple[list[str], float]:
    """The overrides of the layout the scale model predicts fastest for this mode and
    accelerator count (scale/autoplan.py, the preset's costs, envs per simulator searched
    too), with the emulated learner's delay following the micro-batch it picks; and the env
    steps/s it predicts there."""
    from hpcvla.config import load_config
    from hpcvla.scale.autoplan import search
    from hpcvla.scale.model import Layout
    from hpcvla.scale.probe import named_costs
    cfg = load_config(None, base)
    ranks = _ranks(mode, gpus)
    layout = Layout(mode, ranks, cfg.placement.ranks_per_node or ranks,
                    dict(cfg.placement.per_node), cfg.env.envs_per_simulator, cfg.env.shards,
                    cfg.rollout.batch_max, cfg.rollout.wait_max_ms / 1e3, cfg.env.chunk_len,
                    cfg.rollout.segment_len, cfg.learner.micro_batch,
                    cfg.learner.micro_batches, cfg.learner.epochs, cfg.pipeline.max_staleness)
    best, predicted = search(layout, named_costs(preset_name)[0], search_envs=True)[0]
    return best.overrides() + ["emulate.learner_ms_per_micro_batch="
                               f"{preset['learn_ms_per_segment'] * best.micro_batch}"], \
        predicted.env_steps_per_s


def run(workload="emulated", preset_name="balanced", gpus=2, envs_per_gpu=None, updates=20,
        json_path=None, sweep=None, staleness=2) -> dict:
    from hpcvla.config import load_config

    if envs_per_gpu is None:
        envs_per_gpu = 4 if workload in SIM_WORKLOADS else 16

    preset = PRESETS[preset_name]
    if workload == "emulated":
        envs_per_gpu = preset["envs"]
    results = {"workload": workload, "preset": preset_name if workload == "emulated" else None,
               "costs_ms": preset if workload == "emulated" else None, "gpus": gpus,
               "sweep": sweep, "updates": updates, "max_staleness": staleness, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="hpcvla-bench-") as tmp:
        for n, (label, mode, envs, extra, bound_s) in enumerate(
                cases(sweep, envs_per_gpu, staleness)):
            ranks = _ranks(mode, gpus)
            base = [f"pipeline.mode={mode}", *_layout(mode, gpus),
                    *_workload(workload, preset, envs, updates, mode, bound_s)]
            predicted = None
            if extra is None:
                if workload != "emulated":
                    raise ValueError("--sweep auto: the emulated workload only (the planner "
                                     "takes its stage costs from the preset)")
                extra, predicted = auto_layout(mode, base, preset_name, preset, gpus)
            overrides = [*base, *extra, f"run.root={tmp}", f"run.name=case{n}"]
            cmd = [sys.executable, "-m", "hpcvla", "train", "--ranks", str(ranks), *overrides]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise RuntimeError(f"{label} failed:\n{out.stderr[-3000:]}")
            (run_dir,) = Path(tmp).glob(f"case{n}-*")
            summary = json.loads((run_dir / "summary.json").read_text())
            cfg = load_config(run_dir / "config.yaml")
            bound = ideal_bound(mode, cfg, preset, gpus) if workload == "emulated" \
                else _measured_bound(summary)
            results["modes"][label] = {
                "mode": mode, "ranks": ranks, "overrides": extra,
                "max_staleness": cfg.pipeline.max_staleness, "predicted": predicted,
                "env_steps": summary["env_steps"], "wall_s": summary["wall_s"],
                "throughput": summary["env_steps_per_s"], "ideal_bound": bound,
                "efficiency": summary["env_steps_per_s"] / bound,
                "busy_fraction": summary["busy_fraction"],
                "staleness_hist": summary["staleness_hist"],
                "success_rate": summary["success_rate"]}
            print(f"{label:<36} {summary['env_steps_per_s']:>9.0f} steps/s  bound {bound:>9.0f}"
                  f"  efficiency {summary['env_steps_per_s'] / bound:5.2f}"
                  + (f"  (plan --auto predicted {predicted:.0f})" if predicted else ""),
                  flush=True)
    base = next((r["throughput"] for r in results["modes"].values()
                 if r["mode"] == "sync-colocated"), None)
    if base:
        results["speedup_vs_sync_colocated"] = {
            m: r["throughput"] / base for m, r in results["modes"].items()}
        print("speed-up over sync-colocated: " + ", ".join(
            f"{m} {v:.2f}x" for m, v in results["speedup_vs_sync_colocated"].items()))
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return results
