"""`hpcvla bench scale --validate`: the scale model against the real pipeline.

Each case is a Layout run for real (`hpcvla train --ranks N`, one MPI world per case) on the
emulated workload (bench/modes.py's presets: calibrated delays, so the delays and not this
machine's cores set the pace), and predicted by the model with the probed costs
(probe.emulated_costs) for the same number of updates. Reported per case: measured and
predicted env steps/s and the relative error (predicted / measured - 1).

The one cost the presets leave to the machine, the inference rank's CPU work per request
(`inf_per_request_s`), depends on how busy the cores are: the probe times it on an idle
core, but here 4-8 ranks share 2 cores. So a second prediction uses the cost as the run
itself measured it (its `assemble` time per request served, "in situ"); both are reported.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from hpcvla.scale.model import Layout, predict
from hpcvla.scale.probe import emulated_costs

# 4 to 8 ranks, every mode, 1-3 nodes, 1-2 cells per node, 1-2 learners per node.
CASES = [
    Layout("sync-colocated", 4, 4, envs=16, micro_batch=16, micro_batches=1),
    Layout("sync-disaggregated", 6, 6, {"simulator": 4, "inference": 1, "learner": 1},
           envs=16, micro_batch=32, micro_batches=2),
    Layout("train-async", 6, 6, {"simulator": 4, "inference": 1, "learner": 1},
           envs=16, micro_batch=32, micro_batches=2, max_staleness=1),
    Layout("rollout-async", 6, 6, {"simulator": 3, "inference": 2, "learner": 1},
           envs=16, shards=4, batch_max=16, wait_max_s=0.005, micro_batch=16,
           micro_batches=2, max_staleness=2),
    Layout("streamer", 6, 6, {"simulator": 4, "inference": 1, "learner": 1},
           envs=16, shards=4, batch_max=32, wait_max_s=0.005, micro_batch=16,
           micro_batches=2, max_staleness=2),
    Layout("streamer", 8, 4, {"simulator": 2, "inference": 1, "learner": 1},
           envs=32, shards=8, batch_max=32, wait_max_s=0.002, micro_batch=16,
           micro_batches=2, max_staleness=2),
    Layout("streamer", 8, 8, {"simulator": 4, "inference": 2, "learner": 2},
           envs=16, shards=16, batch_max=16, wait_max_s=0.002, micro_batch=16,
           micro_batches=2, max_staleness=2),
    Layout("streamer", 6, 6, {"simulator": 4, "inference": 1, "learner": 1},
           envs=16, shards=16, batch_max=64, wait_max_s=0.02, micro_batch=16,
           micro_batches=4, max_staleness=1),
    # more envs than the staleness quota lets run: segments held at their boundary
    Layout("streamer", 4, 4, {"simulator": 2, "inference": 1, "learner": 1},
           envs=64, shards=64, batch_max=64, wait_max_s=0.001, micro_batch=8,
           micro_batches=4, max_staleness=2),
]


HEADER = (f"{'case':<58} {'measured':>9} {'predicted':>9} {'error':>7} {'in situ':>9} "
          f"{'error':>7}  bottleneck")


def in_situ_overhead(lay: Layout, busy_fraction: dict, wall_s: float, env_steps: float
                     ) -> float:
    """Seconds of `assemble` per request the run measured on its inference ranks."""
    if lay.mode == "sync-colocated":
        return 0.0  # colocated ranks assemble inside their own loop: in the measured spans
    e = lay.envs // (lay.shards if lay.mode in ("rollout-async", "streamer") else 1)
    n_inf = lay.world // lay.ranks_per_node * lay.per_node["inference"]
    requests = env_steps / lay.chunk_len / e
    return busy_fraction.get("inference:assemble", 0.0) * wall_s * n_inf / requests


def _row(name, lay, costs, updates, measured, wall_s, env_steps, busy_fraction) -> dict:
    pred = predict(lay, costs, updates=updates)
    situ = replace(costs, inf_per_request_s=in_situ_overhead(lay, busy_fraction, wall_s,
                                                              env_steps))
    pred_situ = predict(lay, situ, updates=updates)
    row = {"label": name, "layout": lay.overrides(), "measured": measured,
           "predicted": pred.env_steps_per_s, "error": pred.env_steps_per_s / measured - 1,
           "in_situ_overhead_s": situ.inf_per_request_s,
           "predicted_in_situ": pred_situ.env_steps_per_s,
           "error_in_situ": pred_situ.env_steps_per_s / measured - 1,
           "prediction": pred.to_dict(), "busy_fraction": busy_fraction}
    print(f"{name:<58} {measured:>9.0f} {row['predicted']:>9.0f} {row['error']:>+7.1%} "
          f"{row['predicted_in_situ']:>9.0f} {row['error_in_situ']:>+7.1%}  {pred.bottleneck}",
          flush=True)
    return row


def summarize(rows: list[dict]) -> dict:
    out = {}
    for key in ("error", "error_in_situ"):
        errors = [abs(r[key]) for r in rows]
        out[key] = {"mean_abs": sum(errors) / len(errors), "max_abs": max(errors)}
        print(f"{key}: mean |error| {out[key]['mean_abs']:.1%}, max {out[key]['max_abs']:.1%}"
              f" over {len(rows)} runs")
    return out


def workload_overrides(preset: dict, layout: Layout, updates: int) -> list[str]:
    """The emulated costs (as bench modes sets them) and a short run."""
    return [f"pipeline.total_updates={updates}", "pipeline.progress_every_s=1000",
            "env.image_size=32", "policy.hidden=32",
            f"env.latency_median_ms={preset['sim_ms']}", f"env.latency_sigma={preset['sigma']}",
            f"emulate.inference_ms={preset['inf_a_ms']}",
            f"emulate.inference_ms_per_env={preset['inf_b_ms']}",
            f"emulate.learner_ms_per_micro_batch="
            f"{preset['learn_ms_per_segment'] * layout.micro_batch}"]


def run(preset_name: str = "balanced", updates: int = 10, json_path=None,
        cases=CASES) -> dict:
    from hpcvla.bench.modes import PRESETS
    preset = PRESETS[preset_name]
    costs, probe = emulated_costs(preset_name)
    results = {"preset": preset_name, "updates": updates, "probe": probe, "cases": []}
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="hpcvla-scale-") as tmp:
        for n, layout in enumerate(cases):
            overrides = layout.overrides() + workload_overrides(preset, layout, updates) + [
                f"run.root={tmp}", f"run.name=case{n}"]
            cmd = [sys.executable, "-m", "hpcvla", "train", "--ranks", str(layout.world),
                   *overrides]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise RuntimeError(f"case {n} failed:\n{out.stderr[-3000:]}")
            (run_dir,) = Path(tmp).glob(f"case{n}-*")
            summary = json.loads((run_dir / "summary.json").read_text())
            results["cases"].append(_row(label(layout), layout, costs, updates,
                                         summary["env_steps_per_s"], summary["wall_s"],
                                         summary["env_steps"], summary["busy_fraction"]))
    results["summary"] = summarize(results["cases"])
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return results


def label(lay: Layout) -> str:
    if lay.mode == "sync-colocated":
        return f"{lay.mode} {lay.world} ranks E={lay.envs}"
    pn = lay.per_node
    out = (f"{lay.mode} {lay.world}r/{lay.ranks_per_node} {pn['simulator']}s{pn['inference']}"
           f"i{pn['learner']}l E={lay.envs}")
    if lay.mode in ("rollout-async", "streamer"):
        out += f" S={lay.shards} B={lay.batch_max} T={lay.wait_max_s * 1e3:g}ms"
    return out


def bench_modes_layout(mode: str, gpus: int, envs: int) -> Layout:
    """The layout `hpcvla bench modes --workload emulated --gpus G` runs for `mode`
    (bench/modes.py: _layout, _ranks, _workload)."""
    micro = 16 if mode in ("rollout-async", "streamer") else math.lcm(16, envs)
    common = dict(envs=envs, shards=envs, batch_max=envs, wait_max_s=0.002, max_staleness=2,
                  micro_batch=micro, micro_batches=max(1, 32 // micro), epochs=1)
    if mode == "sync-colocated":
        return Layout(mode, gpus, gpus, **common)
    if gpus == 1:
        return Layout(mode, 3, 3, {"simulator": 1, "inference": 1, "learner": 1}, **common)
    return Layout(mode, 2 * gpus, 4, {"simulator": 2, "inference": 1, "learner": 1}, **common)


def compare_bench_modes(json_path) -> list[dict]:
    """Predict every mode of a `bench modes --workload emulated --json F` result, with the
    costs probed here; prints measured, predicted and the error."""
    from hpcvla.bench.modes import MODES
    result = json.loads(Path(json_path).read_text())
    costs, _ = emulated_costs(result["preset"], confirm=False)
    rows = []
    for name, r in result["modes"].items():
        if r["mode"] not in MODES or r["overrides"]:
            continue
        lay = bench_modes_layout(r["mode"], result["gpus"], result["costs_ms"]["envs"])
        rows.append(_row(f"bench modes {result['preset']} gpus={result['gpus']} {name}", lay,
                         costs, result["updates"], r["throughput"], r["wall_s"],
                         r["env_steps"], r["busy_fraction"]))
    return rows
