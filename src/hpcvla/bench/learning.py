"""`hpcvla bench learning`: does asynchrony cost sample efficiency?

`streamer` (4 ranks: 2 simulators, 1 inference, 1 learner; samples up to
`pipeline.max_staleness` versions old, corrected by the decoupled PPO objective) against
`sync-colocated` (2 ranks in lock-step, never stale), several seeds each, on the same task
with the same env-step budget and the same learner batch per policy version (32 segments of
8 chunks; colocated: 2 learners x 16). Every run is a real `hpcvla train`.

Reported: per run the success curve against trained env steps (success over the last 200
finished episodes, from metrics.jsonl) on a common grid; per mode the final success of every
seed and their mean, and the mean of the curve over the budget (how early it learns); the
differences of the means (streamer - colocated) with 95 % Welch confidence intervals. A PNG of the overlaid curves goes next to the JSON.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# Each mode's layout; both train 32 segments x 8 chunks per policy version.
MODES = {
    "streamer": ["configs/default.yaml", "--ranks", "4", "pipeline.mode=streamer"],
    "sync-colocated": ["configs/colocated.yaml", "--ranks", "2", "learner.micro_batches=1"],
}
# two-sided 97.5 % quantiles of Student's t, by degrees of freedom (1..30; normal beyond)
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def welch_interval(a, b) -> tuple[float, float, float]:
    """mean(a) - mean(b) and its 95 % Welch confidence interval."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    diff = a.mean() - b.mean()
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, diff, diff
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    t = T975[min(int(df), 30) - 1] if df < 31 else 1.96
    return diff, diff - t * se, diff + t * se


def curve(run_dir: Path, grid: np.ndarray) -> list[float]:
    """Success rate against trained env steps, sampled on `grid` (last value held)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().split("\n")
               if line]
    steps = np.array([r["trained_env_steps"] for r in records], float)
    success = np.array([r["success_rate"] for r in records], float)
    return np.interp(grid, steps, success).round(4).tolist()


def run(seeds=3, updates=200, json_path=None, overrides=()) -> dict:
    per_version = 32 * 8 * 4  # segments x chunks x chunk_len: trained env steps per version
    budget = updates * per_version
    grid = np.linspace(per_version, budget, min(updates, 50))
    results = {"seeds": seeds, "updates": updates, "env_step_budget": budget,
               "overrides": list(overrides), "grid_env_steps": grid.tolist(), "modes": {}}
    with tempfile.TemporaryDirectory(prefix="hpcvla-learning-") as tmp:
        for mode, layout in MODES.items():
            runs = []
            for seed in range(seeds):
                root = Path(tmp) / f"{mode}-{seed}"
                cmd = [sys.executable, "-m", "hpcvla", "train", *layout, f"run.seed={seed}",
                       f"pipeline.total_updates={updates}", f"run.root={root}",
                       "pipeline.progress_every_s=1000", *overrides]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
                if out.returncode != 0:
                    raise RuntimeError(f"{mode} seed {seed} failed:\n{out.stderr[-3000:]}")
                (run_dir,) = root.iterdir()
                summary = json.loads((run_dir / "summary.json").read_text())
                runs.append({"seed": seed, "final_success": summary["success_rate"],
                             "wall_s": summary["wall_s"], "env_steps": summary["env_steps"],
                             "curve": curve(run_dir, grid)})
                print(f"{mode:<15} seed {seed}: final success {summary['success_rate']:.3f} "
                      f"in {summary['wall_s']:.0f} s", flush=True)
            results["modes"][mode] = {
                "runs": runs, "final_mean": float(np.mean([r["final_success"] for r in runs])),
                "curve_mean": float(np.mean([np.mean(r["curve"]) for r in runs]))}
    # final success, and the curve's mean over the budget (area under the curve: how early
    # the policy learns per env step), streamer - colocated with a 95 % Welch interval
    for name, of_run in (("difference", lambda r: r["final_success"]),
                         ("curve_difference", lambda r: float(np.mean(r["curve"])))):
        a = [of_run(r) for r in results["modes"]["streamer"]["runs"]]
        b = [of_run(r) for r in results["modes"]["sync-colocated"]["runs"]]
        diff, low, high = welch_interval(a, b) if seeds > 1 else (np.mean(a) - np.mean(b),) * 3
        results[name] = {"streamer_minus_colocated": diff, "ci95": [low, high]}
        print(f"{'final success' if name == 'difference' else 'mean of the curve'}: streamer "
              f"{np.mean(a):.3f}, sync-colocated {np.mean(b):.3f}; difference {diff:+.3f} "
              f"(95 % CI {low:+.3f} .. {high:+.3f})", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
        _plot(results, Path(json_path).with_suffix(".png"))
    return results


def _plot(results: dict, path: Path) -> None:
    """Overlaid success curves, blues for the streamer's seeds, reds for sync-colocated's
    (drawn without matplotlib)."""
    from hpcvla.metrics.raster import line_chart

    shades = {"streamer": [(31, 119, 180), (90, 160, 220), (20, 70, 130)],
              "sync-colocated": [(214, 39, 40), (240, 110, 100), (140, 25, 25)]}
    series, colors = {}, {}
    for mode, m in results["modes"].items():
        for i, r in enumerate(m["runs"]):
            label = f"{mode} seed {r['seed']}"
            series[label] = (results["grid_env_steps"], r["curve"])
            colors[label] = shades[mode][i % len(shades[mode])]
    line_chart(path, series, "success rate vs trained env steps (same budget per mode)",
               "trained env steps", "success rate", ylim=(0, 1), colors=colors)
