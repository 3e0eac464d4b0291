"""`hpcvla bench checkpoint`: what a checkpoint every version costs the learners.

Three arms of the same training run, side by side (interleaved over `repeats` rounds, so load
on the machine falls on all of them alike):
* `none`: `learner.checkpoint_every=0` (one checkpoint, at the end);
* `foreground`: a checkpoint after every version, training waits for the files
  (`learner.checkpoint_background=false`);
* `background`: the same checkpoints, written by a thread while the next version trains
  (checkpoint/store.py's Writer; the default).
Reported per arm: wall seconds per version (the run's wall clock over its versions), the
learners' seconds per version inside checkpointing (the timeline's `checkpoint` spans: the
snapshot, plus any wait for files) and how many checkpoints each learner wrote (those spans
counted); and each arm's wall per version over `none`'s.

The default workload is the colocated reach run on 2 ranks with a wider policy
(`policy.hidden=1024`: 7.6 M parameters, 121 MB of weights, fp32 masters and Adam moments per
checkpoint): big enough that writing shows; pass overrides for another (e.g. a flow policy).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from hpcvla.job.trainrun import train_run

ARMS = {"none": ["learner.checkpoint_every=0"],
        "foreground": ["learner.checkpoint_every=1", "learner.checkpoint_background=false"],
        "background": ["learner.checkpoint_every=1", "learner.checkpoint_background=true"]}
WORKLOAD = ["configs/colocated.yaml", "--ranks", 2, "policy.hidden=1024"]


def run(updates: int = 8, repeats: int = 2, overrides=(), json_path=None) -> dict:
    samples: dict[str, list] = {arm: [] for arm in ARMS}
    for n in range(repeats):
        for arm in ARMS if n % 2 == 0 else reversed(ARMS):
            with tempfile.TemporaryDirectory(prefix=f"bench-checkpoint-{arm}-") as root:
                run_dir, summary = train_run([*WORKLOAD, f"pipeline.total_updates={updates}",
                                              *ARMS[arm], *overrides], Path(root), label=arm)
                samples[arm].append((*_per_version(summary, updates), _checkpoints(run_dir)))
    results = {"workload": [*map(str, WORKLOAD), *overrides], "updates": updates,
               "repeats": repeats, "arms": {}}
    for arm, runs in samples.items():
        results["arms"][arm] = {
            "wall_s_per_version": statistics.median(r[0] for r in runs),
            "checkpoint_s_per_version": statistics.median(r[1] for r in runs),
            "checkpoints_per_learner": max(r[2] for r in runs), "runs": runs}
    base = results["arms"]["none"]["wall_s_per_version"]
    for arm, result in results["arms"].items():
        result["wall_over_none"] = result["wall_s_per_version"] / base
        print(f"{arm:>10}: {result['wall_s_per_version']:.3f} s per version "
              f"({result['wall_over_none']:.2f}x none), learners in checkpointing "
              f"{result['checkpoint_s_per_version']:.3f} s per version")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return results


def _checkpoints(run_dir: Path) -> float:
    """Checkpoints each learner wrote in the run: its timeline's `checkpoint` spans."""
    spans = [span for path in run_dir.glob("timeline.rank*.jsonl")
             for span in map(json.loads, path.read_text().splitlines()) if "stage" in span]
    learners = {s["rank"] for s in spans if "learner" in s["role"]}
    return sum(s["stage"] == "checkpoint" for s in spans) / max(1, len(learners))


def _per_version(summary: dict, updates: int) -> tuple[float, float]:
    """(wall seconds, the learners' mean checkpoint seconds) per version of one run."""
    wall = summary["wall_s"]
    learners = [r for r in summary["per_rank"] if "learner" in r["role"]]
    checkpointing = statistics.mean(r["busy_s"].get("checkpoint", 0.0) for r in learners)
    return wall / updates, checkpointing / updates
