"""`hpcvla bench shards`: a simulator rank's env shards stepped one after another vs together.

With `env.isolation=process` every shard of a simulator rank lives in its own worker process
(envs/isolated.py). The simulator loop (roles/simulator.py) starts every shard whose actions
are in before collecting any, so the workers step concurrently and a rank with K shards can
use up to K cores. This measures what that buys, side by side in one process: the same K
workers, the same actions, alternating rounds of
* `sequential`: `step` each shard in turn (what one in-process simulator does), and
* `concurrent`: `step_async` every shard, then `step_wait` each (what the simulator loop does).
Reported: env steps/s of each (primitive steps) and their ratio. The ratio is bounded by
min(K, free cores) and by the rank's share of each step (sending actions, unpickling
observations).

Workloads: `emulated` (reach with a 20 ms median lognormal step latency that the worker sleeps:
overlap of waiting, not of cores), `real` (reach, CPU-bound and tiny: the overhead of the worker
round trip), `maniskill`, `libero` (the rendered 64 px workloads of `bench modes`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from hpcvla.scale.presets import SIM_WORKLOADS

WORKLOAD_OVERRIDES = {"emulated": ["env.latency_median_ms=20"], "real": [], **{
    name: [o for o in overrides if o.startswith("env.")]
    for name, overrides in SIM_WORKLOADS.items()}}


def run(workload: str = "emulated", shards: int = 2, envs_per_shard: int = 4, rounds: int = 20,
        json_path=None) -> dict:
    from hpcvla.config import load_config
    from hpcvla.envs import check_env
    from hpcvla.envs.base import close_all
    from hpcvla.envs.build import make_envs
    from hpcvla.seeds import shard_seed

    cfg = load_config(None, [*WORKLOAD_OVERRIDES[workload], "env.isolation=process"])
    check_env(cfg)  # a missing simulator is named before any worker starts
    envs = [make_envs(cfg, envs_per_shard, shard_seed(cfg, 0, k), first_env=k * envs_per_shard,
                      owner="bench") for k in range(shards)]
    spec, rng = envs[0].spec, np.random.default_rng(0)
    shape = (envs_per_shard, spec.chunk_len, spec.action_dim)
    seconds = {"sequential": 0.0, "concurrent": 0.0}
    try:
        for env in envs:
            env.reset()
        for n in range(rounds + 1):  # round 0 warms up (first renders, lazy imports)
            actions = [rng.uniform(-1, 1, shape).astype(np.float32) for _ in envs]
            for way in ("sequential", "concurrent") if n % 2 else ("concurrent", "sequential"):
                begin = time.perf_counter()
                if way == "sequential":
                    for env, a in zip(envs, actions):
                        env.step(a)
                else:
                    for env, a in zip(envs, actions):
                        env.step_async(a)
                    for env in envs:
                        env.step_wait()
                if n:
                    seconds[way] += time.perf_counter() - begin
    finally:
        close_all(envs)
    steps = rounds * shards * envs_per_shard * spec.chunk_len
    results = {"workload": workload, "shards": shards, "envs_per_shard": envs_per_shard,
               "rounds": rounds, "env_steps_per_way": steps,
               "throughput": {way: steps / s for way, s in seconds.items()}}
    results["concurrent_over_sequential"] = seconds["sequential"] / seconds["concurrent"]
    print(f"{workload}: {shards} shards x {envs_per_shard} envs, {rounds} rounds: "
          + ", ".join(f"{way} {v:.0f} env steps/s" for way, v in results["throughput"].items())
          + f"; concurrent / sequential {results['concurrent_over_sequential']:.2f}x")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return results
