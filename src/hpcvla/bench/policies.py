"""`hpcvla bench policies`: parameter counts and step times of the VLA policy presets.

For every family (flow, tokens) and size: the parameter count (counted on the meta device, so
the `full` sizes cost no memory), and for the sizes that fit this machine (`tiny`, `small`;
`full` needs a GPU) the median wall time over a few repeats of `act` and of one learner step
(evaluate + backward) on a batch of reach observations (64 px, chunk 4 x 2), with
torch on one thread (the learner of a CPU rank), float32. For flow, the learner step of each
`policy.logprob_mode` too (`train_step_ms_by_mode`: its K = 4 denoising steps scored as each
mode scores them), timed in turns, one step of each mode a round.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from hpcvla.config.policy import LOGPROB_MODES
from hpcvla.envs import make_env
from hpcvla.policies import Policy, make_policy
from hpcvla.policies.registry import count_preset_parameters
from hpcvla.policies.vla import SIZE_NAMES

FAMILIES = ("flow", "tokens")


def median_ms(fn, repeats: int, device=None) -> float:
    """Median wall time of fn() in ms after a warm-up; on a GPU the queue is drained around
    each call, so the time is the work's, not its launch's."""
    cuda = device is not None and torch.device(device).type == "cuda"
    fn()  # warm-up (kernels, allocator)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def step_ms(policy, obs, repeats: int, device=None) -> dict[str, float]:
    """Median ms of `act` and of one learner step (evaluate + backward) on `obs`."""
    return {"act_ms": median_ms(lambda: policy.act(obs), repeats, device),
            "train_step_ms": median_ms(train_step(policy, obs), repeats, device)}


def train_step(policy, obs):
    """One learner step's work on what `policy` sampled for `obs` (its extras included)."""
    out, extras = policy.sample(obs)
    scored = {**obs, **extras}

    def step():
        logprob, value, entropy = policy.evaluate(scored, out.actions)
        (logprob.mean() + value.pow(2).mean() + entropy.mean()).backward()
    return step


def mode_step_ms(args, size: str, obs, repeats: int) -> dict[str, float]:
    """Median ms of a learner step per flow logprob_mode, the same weights, in turns."""
    steps = {}
    for mode in LOGPROB_MODES:
        torch.manual_seed(0)
        steps[mode] = train_step(make_policy("flow", *args, size=size, dtype="float32",
                                             logprob_mode=mode), obs)
        steps[mode]()  # warm-up
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(repeats):
        for mode, step in steps.items():
            start = time.perf_counter()
            step()
            times[mode].append((time.perf_counter() - start) * 1e3)
    return {mode: statistics.median(t) for mode, t in times.items()}


def run(quick: bool = False, batch: int = 16, json_path=None) -> dict:
    torch.set_num_threads(1)
    env = make_env("reach", batch, 0)
    spec, obs_np = env.spec, env.reset()
    env.close()
    obs = Policy.obs_to_tensors(obs_np, "cpu")
    args = (spec.obs, spec.action_dim, spec.chunk_len, len(spec.vocab))
    results = {"batch": batch, "threads": 1, "image": list(spec.obs["image"][0]),
               "chunk": [spec.chunk_len, spec.action_dim], "policies": {}}
    print(f"{'policy':8} {'size':6} {'params':>15} {'act ms':>9} {'train ms':>9}")
    for family in FAMILIES:
        for size in SIZE_NAMES:
            row = {"parameters": count_preset_parameters(family, size, *args)}
            if size != "full" and not (quick and size == "small"):
                torch.manual_seed(0)
                policy = make_policy(family, *args, size=size, dtype="float32")
                row.update(step_ms(policy, obs, 3 if quick else 7))
                if family == "flow":
                    row["train_step_ms_by_mode"] = mode_step_ms(args, size, obs,
                                                                3 if quick else 7)
            results["policies"][f"{family}/{size}"] = row
            print(f"{family:8} {size:6} {row['parameters']:>15,} "
                  f"{row.get('act_ms', float('nan')):>9.1f} "
                  f"{row.get('train_step_ms', float('nan')):>9.1f}"
                  + "".join(f"  {mode} {ms:.1f}" for mode, ms in
                            row.get("train_step_ms_by_mode", {}).items()))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    return results


__all__ = ["run", "median_ms", "step_ms"]
