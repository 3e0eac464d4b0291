"""`hpcvla bench scale`: predicted throughput of pi0 on LIBERO from 8 to 256 GPUs.

Stage costs come from RL-VLA³ (arXiv 2602.05765v1), setup A (Table 2: pi0, LIBERO, 128
envs and a global batch of 2,048 chunk samples per 8-GPU node, 4 update epochs,
micro-batches of 128, chunks of 10 steps, 480-step episodes) and Table 3 (seconds per
training step):

* Learner: 18 ms per chunk sample per epoch. Colocated on 8 GPUs the actor phase takes
  228.6 s for 128 envs x 480 steps / 10 x 4 rollout epochs = 24,576 chunk samples x 4
  epochs on 8 GPUs: 228.6 x 8 / 98,304 = 18.6 ms; disaggregated 1:1 on 16 and 32 GPUs gives
  18.0 ms (442.8 s on 8 learners for twice the samples).
* Simulator + inference: colocated, a rollout step of 16 envs per GPU takes 577.4 s / 192
  chunk-steps = 3.0 s. We split it (assumption) into a pi0 forward pass (4 denoising steps,
  bf16) of 60 ms + 5 ms per env (140 ms for 16) and a LIBERO chunk whose slowest of 16 envs
  takes 2.86 s: with a lognormal tail of sigma 0.5 (as the emulated `balanced` preset; the
  expected max of 16 draws is ~2.4x the median), a median of 1.2 s per env and chunk.
* Weights: pi0 has 3.3 B parameters, 6.6 GB in bf16, published every version and all-reduced
  (gradients, bf16) every optimizer step.

Other assumptions:
* Network: InfiniBand HDR, one 200 Gb/s link per node, 2 us latency; within a node 100 GB/s
  (NVLink all-reduce, host-to-GPU weight copies). No contention with other jobs.
* Layout per node of 8 GPUs (RL-VLA³'s 1:1 ratio): 4 inference + 4 learner GPUs and 4 CPU
  simulator ranks of 32 envs (128 envs per node, Table 2), every env its own shard (one
  process per env, as LIBERO runs), B_max = the cell's 32 envs, T_max = 5 ms, segments of 8
  chunks, each learner trains 64 segments (512 chunk samples: the node's 2,048 over 4
  learners) per version in micro-batches of 16 segments (128 samples), 4 epochs,
  max_staleness 1. Envs and batch grow with the nodes, as the paper scales them.
* Simulators have cores enough for one env each (no CPU contention); learners are
  lock-stepped by their all-reduce, with 8 of them simulated (a straggler effect among more
  learners is not modelled beyond that); the weight broadcast is a tree (log2 nodes hops).
* Ideal = 8-GPU throughput x GPUs / 8; efficiency = predicted / ideal.
* A second series replaces the tree broadcast of the weights by a sequential sync (the root
  sends each remote inference rank its copy in turn over its one link), the kind of
  per-worker communication RL-VLA³ blames for its sublinear scaling beyond 128 GPUs.
* RL-VLA³'s own curve (Figure 3, pi0.5 on LIBERO+) is published without numbers; what it
  states is its shape (near-linear 8 -> 24 GPUs, moderating to 128, degrading to 256), which
  the chart's two series are read against.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from hpcvla.scale.model import Network, StageCosts, predict
from hpcvla.schedule import Layout

PI0_SEGMENT_LEN = 8  # chunks per segment: the learner's 18 ms per chunk sample x 8
PI0_LIBERO = StageCosts(sim_median_s=1.2, sim_sigma=0.5, inf_a_s=0.060, inf_b_s=0.005,
                        learn_s_per_segment=PI0_SEGMENT_LEN * 0.018, weight_bytes=6.6e9)
HDR = Network(bandwidth_Bps=200e9 / 8, latency_s=2e-6, local_bandwidth_Bps=100e9)
GPUS = (8, 16, 24, 32, 64, 128, 256)


def pi0_layout(gpus: int) -> Layout:
    nodes = gpus // 8
    return Layout("streamer", world=12 * nodes, ranks_per_node=12,
                  per_node={"simulator": 4, "inference": 4, "learner": 4}, envs=32, shards=32,
                  batch_max=32, wait_max_s=0.005, chunk_len=10, segment_len=PI0_SEGMENT_LEN,
                  micro_batch=16, micro_batches=4, epochs=4, max_staleness=1)


def table(gpus=GPUS, costs: StageCosts = PI0_LIBERO, network: Network = HDR) -> list[dict]:
    rows = []
    for n in gpus:
        pred = predict(pi0_layout(n), costs, network, updates=None)
        seq = predict(pi0_layout(n), costs, replace(network, weight_sync="sequential"),
                      updates=None)
        rows.append({"gpus": n, "nodes": n // 8, "env_steps_per_s": pred.env_steps_per_s,
                     "bottleneck": pred.bottleneck, "busy": pred.busy,
                     "sequential_sync_env_steps_per_s": seq.env_steps_per_s,
                     "sequential_sync_bottleneck": seq.bottleneck})
    base = rows[0]["env_steps_per_s"] / rows[0]["gpus"]
    for row in rows:
        row["ideal"] = base * row["gpus"]
        row["efficiency"] = row["env_steps_per_s"] / row["ideal"]
        row["sequential_sync_efficiency"] = row["sequential_sync_env_steps_per_s"] / row["ideal"]
    return rows


def run(json_path=None, chart_path=None, gpus=GPUS) -> list[dict]:
    rows = table(gpus)
    print("pi0 on LIBERO, streamer 1:1, InfiniBand HDR (assumptions: hpcvla/scale/predict.py)")
    print(f"{'GPUs':>5} {'nodes':>5} {'env steps/s':>12} {'ideal':>9} {'eff.':>6}  "
          f"{'seq. sync':>9} {'eff.':>6}  bottleneck (busy: simulate/infer/train)")
    for r in rows:
        b = r["busy"]
        print(f"{r['gpus']:>5} {r['nodes']:>5} {r['env_steps_per_s']:>12.0f} "
              f"{r['ideal']:>9.0f} {r['efficiency']:>6.1%}  "
              f"{r['sequential_sync_env_steps_per_s']:>9.0f} "
              f"{r['sequential_sync_efficiency']:>6.1%}  {r['bottleneck']} "
              f"({b['simulate']:.2f}/{b['infer']:.2f}/{b['train']:.2f})")
    if json_path:
        Path(json_path).write_text(json.dumps({"costs": PI0_LIBERO.__dict__,
                                               "network": HDR.__dict__, "rows": rows},
                                              indent=1))
    if chart_path:
        from hpcvla.metrics.charts import line_chart
        xs = [r["gpus"] for r in rows]
        line_chart(chart_path, {"predicted (streamer 1:1)": (xs, [r["env_steps_per_s"]
                                                                  for r in rows]),
                                "weights synced rank by rank": (xs, [
                                    r["sequential_sync_env_steps_per_s"] for r in rows]),
                                "linear from 8 GPUs": (xs, [r["ideal"] for r in rows])},
                   "pi0 on LIBERO: predicted throughput (scale model, InfiniBand HDR)",
                   "GPUs", "env steps/s", logx=True, logy=True)
    return rows
