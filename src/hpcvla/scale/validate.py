"""`hpcvla bench scale --validate`: the scale model against the real pipeline.

Each case is a Layout run for real (`hpcvla train --ranks N`, one MPI world per case) on the
emulated workload (scale/presets.py: calibrated delays, so the delays and not this
machine's cores set the pace), and predicted by the model with the probed costs
(probe.emulated_costs) for the same number of updates. Reported per case: measured and
predicted env steps/s and the relative error (predicted / measured - 1).

The one cost the presets leave to the machine, the inference rank's CPU work per request
(`inf_per_request_s`), depends on how busy the cores are: the probe times it on an idle
core, but here 4-8 ranks share 2 cores. So a second prediction uses the cost as the run
itself measured it (its `assemble` time per request served, "in situ"); both are reported.
Both take the learners' start (their engine's build, which the run's clock counts while the
cells act) as the run measured it: the model predicts the pipeline, not DeepSpeed's set-up.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

from hpcvla.job.trainrun import train_run
from hpcvla.scale.model import StageCosts, predict
from hpcvla.scale.presets import PRESETS, emulated_cost_overrides
from hpcvla.scale.probe import emulated_costs
from hpcvla.schedule import Layout

# 4 to 8 ranks, every mode, 1-2 nodes, 1-2 cells per node, 1-2 learners per node.
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


def in_situ_overhead(lay: Layout, busy_fraction: dict, active_s: float, env_steps: float
                     ) -> float:
    """Seconds of `assemble` and `send` (the ring puts, their waits for a full lane not
    counted) per request the run measured on its inference ranks (its busy fractions are of
    summary.json's `active_s`)."""
    if lay.traits.colocated:
        return 0.0  # colocated ranks assemble inside their own loop: in the measured spans
    e = lay.envs_per_shard
    n_inf = lay.world // lay.ranks_per_node * lay.per_node["inference"]
    requests = env_steps / lay.chunk_len / e
    shares = busy_fraction.get("inference:assemble", 0.0) + \
        busy_fraction.get("inference:send", 0.0)
    return shares * active_s * n_inf / requests


def learner_start_s(summary: dict) -> float:
    """The learners' engine build after the clock started (roles/policy_ranks.py), as the run
    measured it: the slowest learner's."""
    return max((r["phases_s"]["engine_ready"] - r["phases_s"]["all_ranks_ready"]
                for r in summary["per_rank"] if "engine_ready" in r["phases_s"]), default=0.0)


def _row(name: str, lay: Layout, costs: StageCosts, updates: int, summary: dict) -> dict:
    measured, busy_fraction = summary["env_steps_per_s"], summary["busy_fraction"]
    costs = replace(costs, learner_start_s=learner_start_s(summary))  # the machine's, as given
    pred = predict(lay, costs, updates=updates)
    situ = replace(costs, inf_per_request_s=in_situ_overhead(
        lay, busy_fraction, summary.get("active_s", summary["wall_s"]), summary["env_steps"]))
    pred_situ = predict(lay, situ, updates=updates)
    row = {"label": name, "layout": lay.to_overrides(), "measured": measured,
           "predicted": pred.env_steps_per_s, "error": pred.env_steps_per_s / measured - 1,
           "learner_start_s": costs.learner_start_s,
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
    """The emulated costs (scale/presets.py) and a short run."""
    return [f"pipeline.total_updates={updates}", "pipeline.progress_every_s=1000",
            *emulated_cost_overrides(preset, layout.micro_batch)]


def run(preset_name: str = "balanced", updates: int = 10, json_path=None,
        cases=CASES) -> dict:
    preset = PRESETS[preset_name]
    costs, probe = emulated_costs(preset_name)
    results = {"preset": preset_name, "updates": updates, "probe": probe, "cases": []}
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="hpcvla-scale-") as tmp:
        for n, layout in enumerate(cases):
            overrides = layout.to_overrides() + workload_overrides(preset, layout, updates)
            _, summary = train_run(["--ranks", layout.world, *overrides, f"run.name=case{n}"],
                                   Path(tmp) / f"case{n}", label=f"case {n}")
            results["cases"].append(_row(label(layout), layout, costs, updates, summary))
    results["summary"] = summarize(results["cases"])
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return results


def label(lay: Layout) -> str:
    if lay.traits.colocated:
        return f"{lay.mode} {lay.world} ranks E={lay.envs}"
    pn = lay.per_node
    out = (f"{lay.mode} {lay.world}r/{lay.ranks_per_node} {pn['simulator']}s{pn['inference']}"
           f"i{pn['learner']}l E={lay.envs}")
    if lay.traits.dynamic_batcher:
        out += f" S={lay.shards} B={lay.batch_max} T={lay.wait_max_s * 1e3:g}ms"
    return out
