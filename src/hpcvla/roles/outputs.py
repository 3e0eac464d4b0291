"""What a training run writes besides its metrics: checkpoints when due, the optional HDF5
trajectory dump of a producer, and at the end `summary.json` with the whole run's busy
fractions in TensorBoard, its start and stop (metrics/phases.py) and every rank's peak memory
beside the memory model's figure (gathered on rank 0)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import yaml

from hpcvla import checkpoint, restarts
from hpcvla.config.loader import config_to_dict
from hpcvla.memory.states import GIB
from hpcvla.metrics import phases
from hpcvla.metrics.tensorboard import RunBoard

MEMORY_PLAN = "memory.json"  # the memory model's figures for the run (GPU runs: pipeline.py)


def checkpointer(cfg, engine, learners, run_dir, progress, timeline):
    """save(version, full weights, last): a checkpoint when one is due or the run ends
    (collective on the learners). With learner.checkpoint_background it is written in the
    background (checkpoint.Writer): training waits only for the snapshot, and for the
    previous checkpoint if that is still being written. The last one is complete when save
    returns."""
    writer = checkpoint.Writer(cfg.learner.checkpoint_background)

    def save(version, weights, last):
        every = cfg.learner.checkpoint_every
        if every >= 0 and (last or (every and version % every == 0)):
            with timeline.span("checkpoint"):
                writer.save(run_dir, engine, weights, version,  # [dist] the learners
                            {"trained_env_steps": progress.steps}, learners,
                            keep=cfg.learner.checkpoint_keep)
                if last:
                    writer.wait()
    return save


def trajectory_dump(cfg, spec, policy, rank, run_dir, seed_of_slot):
    """This producer's HDF5 trajectory dump (metrics/dump.py), or None when not asked for.
    It holds the observations and what the policy records beside them (extra_fields)."""
    if not cfg.run.dump_trajectories:
        return None
    from hpcvla.metrics.dump import TrajectoryDump
    keys = list(spec.obs) + list(policy.extra_fields())
    return TrajectoryDump(run_dir / "trajectories" / f"rank{rank}.h5", rank, keys,
                          spec.vocab, seed_of_slot, cfg.env.name, spec.chunk_len,
                          yaml.safe_dump(config_to_dict(cfg), sort_keys=False),
                          cfg.run.dump_flush_s)


def write_report(world, summary: dict, cfg, run_dir) -> dict:
    """Gather every rank's summary on rank 0; write summary.json; print the headline."""
    everyone = world.gather(summary, root=0)  # [dist]
    if world.Get_rank() != 0:
        return summary
    wall = max(s["wall_s"] for s in everyone)
    steps = sum(s["env_steps"] for s in everyone)
    staleness = Counter()
    for s in everyone:
        staleness.update({int(k): v for k, v in s.get("staleness_hist", {}).items()})
    root = next((s for s in everyone if "success_rate" in s), {})
    busy = {}
    for s in everyone:
        for stage, seconds in s["busy_s"].items():
            busy.setdefault(f"{s['role']}:{stage}", []).append(seconds / s["wall_s"])
    result = {
        "mode": cfg.pipeline.mode, "ranks": len(everyone), "wall_s": wall,
        "env_steps": steps, "env_steps_per_s": steps / wall,
        "success_rate": root.get("success_rate"), "mean_return": root.get("mean_return"),
        # trained episodes an env fault ended: not in success_rate, not trained on
        "env_fault_episodes": root.get("env_fault_episodes"),
        "staleness_hist": dict(sorted(staleness.items())),
        "busy_fraction": {k: float(np.mean(v)) for k, v in sorted(busy.items())},
        "per_rank": everyone,
    }
    result["preempted"] = any(s["preempted"] for s in everyone)
    result["bad_slots"] = sum(s["ring"]["bad_slots"] for s in everyone if "ring" in s)
    result["lost_records"] = sum(s["ring"]["lost_records"] for s in everyone if "ring" in s)
    result["env_failures"] = sum(len(s.get("env_failures", [])) for s in everyone)
    result["restarts"] = restarts.recorded(run_dir)  # inside the allocation (jobs/launch.sh)
    result["phases_s"] = phases.slowest([s["phases_s"] for s in everyone])
    _add_planned_memory(everyone, run_dir / MEMORY_PLAN)
    (run_dir / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    board = RunBoard(run_dir, cfg.run)  # the whole run's busy fractions, once
    board.scalars({"busy/" + k.replace(":", "/"): v for k, v in result["busy_fraction"].items()},
                  root.get("trained_env_steps", 0))
    board.close()
    if result["preempted"] and cfg.learner.checkpoint_every < 0:
        print("[hpcvla] stopped by a signal; no checkpoint (learner.checkpoint_every=-1)")
    elif result["preempted"]:
        print(f"[hpcvla] stopped by a signal after a checkpoint; continue with "
              f"`hpcvla train run.resume={run_dir} --ranks {len(everyone)}` (it loads the "
              "run's own config; under srun/mpiexec start the same ranks with run.resume=)",
              flush=True)
    print("[hpcvla] start and stop, s since launch (slowest rank): " + " | ".join(
        f"{step} {seconds:.1f}" for step, seconds in result["phases_s"].items()))
    print(memory_table(everyone), flush=True)
    print(f"[hpcvla] done: {steps} env steps in {wall:.1f} s = {steps / wall:.0f} steps/s | "
          f"success {result['success_rate']} | staleness {result['staleness_hist']}",
          flush=True)
    return result


def _add_planned_memory(everyone: list[dict], path) -> None:
    """Each rank's figures of the memory model (memory.json, where the run wrote one), bytes,
    beside the peaks it measured."""
    if not path.is_file():
        return
    planned = json.loads(path.read_text())
    for s in everyone:
        rank = str(s["rank"])
        s["planned_memory"] = {"gpu": sum(planned["gpu"].get(rank, {}).values()),
                               "host": sum(planned["host_by_rank"].get(rank, {}).values())}


def memory_table(everyone: list[dict]) -> str:
    """Every rank's peak memory (GiB) as it measured it, and the memory model's figure where
    the run has one (GPU runs); columns nobody has are left out."""
    columns = {"GPU allocated": lambda s: s["peak_memory"].get("gpu_allocated"),
               "GPU reserved": lambda s: s["peak_memory"].get("gpu_reserved"),
               "GPU planned": lambda s: s.get("planned_memory", {}).get("gpu"),
               "host RSS": lambda s: s["peak_memory"]["host_rss"],
               "host planned": lambda s: s.get("planned_memory", {}).get("host")}
    columns = {k: f for k, f in columns.items() if any(f(s) is not None for s in everyone)}
    lines = ["[hpcvla] peak memory, GiB (measured by each rank; planned: the memory model):",
             f"{'rank':>4} {'role':<30} {'device':<7} " + " ".join(f"{k:>13}" for k in columns)]
    for s in everyone:
        values = [f(s) for f in columns.values()]
        lines.append(f"{s['rank']:>4} {s['role']:<30} {s['device']:<7} " + " ".join(
            f"{'-' if v is None else f'{v / GIB:.2f}':>13}" for v in values))
    return "\n".join(lines)
