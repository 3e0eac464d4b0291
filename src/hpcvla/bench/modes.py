"""`hpcvla bench modes`: the five execution modes on one workload, in one invocation.

Every mode runs the real pipeline (`hpcvla train`, one MPI world per mode) on the same
accelerators: `gpus` GPU ranks (colocated: `gpus` ranks doing everything; otherwise half
inference, half learners) and, outside colocated, `gpus` simulator ranks on CPU, with the same
total number of envs. Reported per mode: throughput (env steps/s, RL-VLA³ Eq. 2), the ideal
bound min(stage capacities), efficiency = throughput / bound, and busy fractions per stage.

Workloads:
* `emulated`: stage costs are calibrated delays (scale/presets.py, which also computes the
  ideal bound from the mean costs); the delays, not the machine's cores, set the pace.
* `real`: the reach env, the default policy and DeepSpeed as configured; the bound comes from
  the measured busy time of each stage (capacity = steps / mean busy seconds of its ranks).
* `maniskill`, `libero`: the same with a real simulator (ManiSkill3 PickCube-v1, LIBERO-Spatial
  task 0) rendering 64 px cameras on CPU, a tiny default policy and small learner batches
  (SIM_WORKLOADS); 4 envs per simulator rank unless `run(envs_per_gpu=...)` says otherwise
  (the emulated workload takes its preset's).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from hpcvla.job.trainrun import train_run
from hpcvla.scale.presets import (PRESETS, SIM_WORKLOADS, emulated_workload, ideal_bound,
                                  learner_delay, ranks_for)
from hpcvla.schedule import MODES, Layout, traits


def _layout(mode: str, gpus: int) -> list[str]:
    if traits(mode).colocated:
        return ["placement.mode=colocated"]
    if gpus == 1:  # one GPU: its inference rank and its learner share it (devices.py)
        return ["placement.mode=disaggregated", "placement.ranks_per_node=3",
                "placement.per_node={simulator: 1, inference: 1, learner: 1}"]
    return ["placement.mode=disaggregated", "placement.ranks_per_node=4",  # a cell per node
            "placement.per_node={simulator: 2, inference: 1, learner: 1}"]


def cell_envs(envs_per_simulator: int, gpus: int) -> int:
    """The envs of a cell in _layout's layout: one simulator's on one GPU, else two's."""
    return envs_per_simulator * (1 if gpus == 1 else 2)


def _workload(workload: str, preset: dict, envs_per_gpu: int, updates: int,
              mode: str, staleness: int = 2) -> list[str]:
    # Learner batch: 32 segments per learner and version in micro-batches of 16, where a
    # micro-batch may be smaller than a whole unsharded simulator (the sharded modes); an
    # unsharded mode's micro-batch holds whole simulators (64 segments at 64 envs), and the
    # simulator workloads set their own (SIM_COMMON: 4 x 2).
    micro = 16 if traits(mode).sharded else math.lcm(16, envs_per_gpu)
    common = [f"pipeline.total_updates={updates}", f"env.envs_per_simulator={envs_per_gpu}",
              f"learner.micro_batch={micro}", f"learner.micro_batches={max(1, 32 // micro)}",
              "pipeline.progress_every_s=1000"]
    if workload == "real":
        return common
    if workload in SIM_WORKLOADS:
        return common + SIM_WORKLOADS[workload]
    return common + emulated_workload(preset, envs_per_gpu, micro, staleness, mode)


def _measured_bound(summary: dict) -> float:
    """min over stages of steps / (busy seconds per rank of that stage)."""
    steps, busy = summary["env_steps"], {}
    for rank in summary["per_rank"]:
        for stage, seconds in rank["busy_s"].items():
            if stage in ("simulate", "infer", "train"):
                busy.setdefault(stage, []).append(seconds)
    caps = [steps / (sum(v) / len(v)) for v in busy.values() if sum(v) > 0]
    return min(caps) if caps else float("nan")


def cases(sweep: str | None, envs: int, staleness: int = 2, gpus: int = 2) -> list[tuple]:
    """(label, mode, envs per simulator, extra overrides, max_staleness) of each run: the five
    modes, or a sweep. Extra overrides None: the layout `plan --auto` picks. `gpus`: the
    accelerator ranks of _layout's layout, whose cell the batching sweep fills."""
    cell = cell_envs(envs, gpus)
    if sweep is None:
        return [(mode, mode, envs, [], staleness) for mode in MODES]
    if sweep == "batching":  # RL-VLA³ Fig. 8: B_max x T_max for the streamer; B_max a
        # quarter, half and all of a cell's envs
        return [(f"streamer B_max={b} T_max={t}ms", "streamer", envs,
                 [f"rollout.batch_max={b}", f"rollout.wait_max_ms={t}"], staleness)
                for b in sorted({max(1, cell // 4), max(1, cell // 2), cell})
                for t in (1, 5, 20)]
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
    from hpcvla.scale.probe import named_costs
    cfg = load_config(None, base)
    ranks = ranks_for(mode, gpus)
    layout = Layout.from_config(cfg, ranks, cfg.placement.ranks_per_node or ranks)
    best, predicted = search(layout, named_costs(preset_name)[0], search_envs=True)[0]
    return best.to_overrides() + [learner_delay(preset, best.micro_batch)], \
        predicted.env_steps_per_s


def run(workload="emulated", preset_name="balanced", gpus=2, envs_per_gpu=None, updates=20,
        json_path=None, sweep=None, staleness=2, only=None) -> dict:
    """Each case of `cases` (the five modes, or a sweep) as a training world; `only`: the
    execution modes to run (default all)."""
    from hpcvla.config import load_config

    if envs_per_gpu is None:
        envs_per_gpu = 4 if workload in SIM_WORKLOADS else 16

    preset = PRESETS[preset_name]
    if workload == "emulated":
        envs_per_gpu = preset["envs"]
    results = {"workload": workload, "preset": preset_name if workload == "emulated" else None,
               "costs_ms": preset if workload == "emulated" else None, "gpus": gpus,
               "sweep": sweep, "updates": updates,
               "max_staleness": staleness if workload == "emulated" else None, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="hpcvla-bench-") as tmp:
        for n, (label, mode, envs, extra, bound_s) in enumerate(
                cases(sweep, envs_per_gpu, staleness, gpus)):
            if only and mode not in only:
                continue
            ranks = ranks_for(mode, gpus)
            base = [f"pipeline.mode={mode}", *_layout(mode, gpus),
                    *_workload(workload, preset, envs, updates, mode, bound_s)]
            predicted = None
            if extra is None:  # --sweep auto (emulated only: bench/command.py)
                extra, predicted = auto_layout(mode, base, preset_name, preset, gpus)
            run_dir, summary = train_run(["--ranks", ranks, *base, *extra, f"run.name=case{n}"],
                                         Path(tmp) / f"case{n}", label=label)
            cfg = load_config(run_dir / "config.yaml", record=True)
            bound = ideal_bound(mode, cfg, preset, gpus) if workload == "emulated" \
                else _measured_bound(summary)
            results["modes"][label] = {
                "mode": mode, "ranks": ranks, "overrides": extra,
                # what it ran at (the synchronous modes at 0, whatever the setting)
                "max_staleness": cfg.pipeline.max_staleness
                if traits(mode).bounded_staleness else 0, "predicted": predicted,
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
                 if traits(r["mode"]).colocated), None)
    if base:
        results["speedup_vs_sync_colocated"] = {
            m: r["throughput"] / base for m, r in results["modes"].items()}
        print("speed-up over sync-colocated: " + ", ".join(
            f"{m} {v:.2f}x" for m, v in results["speedup_vs_sync_colocated"].items()))
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return results
