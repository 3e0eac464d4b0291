"""`hpcvla bench memory`: the memory model (hpcvla/memory/) against what it models, side by
side in one run.

* Learner peaks on this machine: for each case (a policy, a ZeRO stage, a micro-batch), a
  fresh process builds the policy, trains two steps under DeepSpeed (one learner, gloo) and
  reports its peak resident memory above what it held before the engine started (sampled
  every 0.5 ms); the model predicts the same difference: the learner's figure less the
  weights, which the process held already. CPU: no CUDA context, untouched pages are free;
  the child runs with glibc's `MALLOC_MMAP_THRESHOLD_=65536`, so every tensor's pages go back
  to the system when it is freed and the resident memory follows the bytes alive, as a GPU
  allocator's statistics do (with glibc's sliding threshold, freed tensors under 32 MiB stay
  resident and the peak counts buffers that are never alive together).
* Model states at full size (π0, OpenVLA-OFT in bf16, parameters counted on the meta device)
  against DeepSpeed's own estimators (`estimate_zero2/3_model_states_mem_needs`, no offload),
  per learner for 8 and 64 learners, all states at once as the estimators count them.
* A simulator rank's envs (ManiSkill, LIBERO) in a fresh process: resident memory gained
  making them and stepping, against memory/simulators.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# name -> (config, overrides, ZeRO stage, observations per micro-batch[, the imitation loss])
CASES = {
    "flow-small-z0": ("configs/reach_flow.yaml", ["policy.size=small"], 0, 64),
    "flow-small-z1": ("configs/reach_flow.yaml", ["policy.size=small"], 1, 64),
    "flow-small-z2": ("configs/reach_flow.yaml", ["policy.size=small"], 2, 64),
    "flow-small-z3": ("configs/reach_flow.yaml", ["policy.size=small"], 3, 64),
    "flow-small-bf16-z0": ("configs/reach_flow.yaml", ["policy.size=small",
                                                       "policy.dtype=bfloat16"], 0, 64),
    "flow-small-bf16-z2": ("configs/reach_flow.yaml", ["policy.size=small",
                                                       "policy.dtype=bfloat16"], 2, 64),
    "tokens-small-z0": ("configs/reach_tokens.yaml", ["policy.size=small"], 0, 32),
    "tokens-small-z1": ("configs/reach_tokens.yaml", ["policy.size=small"], 1, 32),
    "tokens-small-z3": ("configs/reach_tokens.yaml", ["policy.size=small"], 3, 32),
    "flow-small-checkpointed-z0": ("configs/reach_flow.yaml", [
        "policy.size=small", "learner.gradient_checkpointing=true"], 0, 64),
    "tokens-small-checkpointed-z1": ("configs/reach_tokens.yaml", [
        "policy.size=small", "learner.gradient_checkpointing=true"], 1, 32),
    "flow-small-lora-z1": ("configs/reach_flow.yaml", ["policy.size=small",
                                                       "policy.lora_rank=8"], 1, 64),
    "tokens-small-lora-z2": ("configs/reach_tokens.yaml", ["policy.size=small",
                                                           "policy.lora_rank=8"], 2, 32),
    # `hpcvla sft`'s learner: flow matching, the tokens' cross-entropy
    "flow-small-sft-z0": ("configs/reach_flow.yaml", ["policy.size=small"], 0, 64, True),
    "tokens-small-sft-z1": ("configs/reach_tokens.yaml", ["policy.size=small"], 1, 32, True),
}
QUICK = ("flow-small-z0", "tokens-small-z1")
FULL_SIZE = {"pi0": ("configs/libero_pi0.yaml", ["policy.pretrained=", "policy.tokenizer=",
                                                 "policy.size=full", "env.image_size=224"]),
             "oft": ("configs/libero_oft.yaml", ["policy.pretrained=", "policy.size=full",
                                                 "env.image_size=224"])}

# The child: build, warm up the kernels' own memory with a 1-observation step, then measure.
MEASURE = r"""
import gc, json, os, sys, threading, time
import torch
from hpcvla.config import load_config
from hpcvla.engines.base import adamw
from hpcvla.envs import env_spec
from hpcvla.factory import build_policy
from hpcvla.memory.footprint import observation_batch, step_loss
torch.set_num_threads(1)
config, overrides, stage, n, imitation = json.loads(sys.argv[1])
cfg = load_config(config, overrides)
spec = env_spec(cfg.env)
policy = build_policy(cfg, spec)
if cfg.learner.gradient_checkpointing:  # as engines.init_engine does
    policy.enable_gradient_checkpointing()
from hpcvla.engines.zero import lean_deepspeed
deepspeed = lean_deepspeed(torch.device("cpu"))  # as the learners start it
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")  # a world of one serves its store on a port the kernel gives
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
obs = observation_batch(spec, policy.extra_fields(), n)
actions = torch.zeros((n, spec.chunk_len, spec.action_dim))
real = torch.ones((n, spec.chunk_len), dtype=bool) if imitation else None
loss = (lambda out: out) if imitation else step_loss  # hpcvla sft's forward gives its loss
loss(policy({k: v[:1] for k, v in obs.items()}, actions[:1],
            None if real is None else real[:1])).backward()
policy.zero_grad(set_to_none=True)
gc.collect()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
base = rss(); peak = [base]; done = threading.Event()
def watch():
    while not done.is_set():
        peak[0] = max(peak[0], rss()); time.sleep(0.0005)
watcher = threading.Thread(target=watch, daemon=True); watcher.start()
bf16 = any(p.dtype == torch.bfloat16 for p in policy.parameters())
engine, *_ = deepspeed.initialize(model=policy, optimizer=adamw(cfg, policy), config={
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
    "gradient_clipping": 0.5, "steps_per_print": 10 ** 9})
for _ in range(2):
    engine.backward(loss(engine(obs, actions, real))); engine.step()
done.set(); watcher.join()
print("MEASURED", peak[0] - base)
"""


# A simulator rank's envs: resident memory gained making them, a reset and three steps.
SIMULATE = r"""
import json, os, sys
import numpy as np
from hpcvla.config import load_config
from hpcvla.envs.build import make_envs
config, overrides = json.loads(sys.argv[1])
cfg = load_config(config, overrides)
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
base = rss()
env = make_envs(cfg, cfg.env.envs_per_simulator, 0)
env.reset()
for _ in range(3):
    env.step(np.zeros((env.num_envs, env.spec.chunk_len, env.spec.action_dim), np.float32))
print("MEASURED", rss() - base)
"""
SIMULATORS = {  # inline: the envs in the measuring process itself
    "maniskill-4-envs": ("configs/maniskill_pickcube.yaml", ["env.envs_per_simulator=4",
                                                             "env.isolation=inline"]),
    # two tasks of one scene (they share its model and renderer), two tasks of two scenes
    "libero-2-envs-1-scene": ("configs/libero_spatial.yaml", [
        "env.envs_per_simulator=2", "env.shards=1", "env.suite_task=-1",
        "env.isolation=inline"]),
    "libero-2-envs-2-scenes": ("configs/libero_spatial.yaml", [
        "env.suite=libero_object", "env.envs_per_simulator=2", "env.shards=1",
        "env.suite_task=-1", "env.isolation=inline"]),
}


def simulators(names=tuple(SIMULATORS)) -> dict:
    """Measured vs modelled host memory of a simulator rank's envs (memory/simulators.py)."""
    from hpcvla.config import load_config
    from hpcvla.memory.simulators import simulator_bytes
    from hpcvla.schedule import shards_of
    out = {}
    for name in names:
        config, overrides = SIMULATORS[name]
        measured = child_measurement(SIMULATE, [json.dumps([config, overrides])], name)
        cfg = load_config(config, overrides)
        predicted = simulator_bytes(cfg.env, shards_of(cfg))
        out[name] = {"measured": measured, "predicted": predicted,
                     "predicted_over_measured": predicted / measured}
        print(f"{name:<22} measured {measured / 2 ** 20:7.0f} MiB  predicted "
              f"{predicted / 2 ** 20:7.0f} MiB  ratio {predicted / measured:.2f}", flush=True)
    return out


def child_measurement(script: str, args: list[str], what: str, env: dict | None = None) -> int:
    """Run a measuring `script` in a fresh Python process; the bytes its MEASURED line gives."""
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                         timeout=900, env={**os.environ, **(env or {})})
    lines = [line for line in out.stdout.splitlines() if line.startswith("MEASURED")]
    if out.returncode or not lines:
        raise RuntimeError(f"measuring {what} failed:\n{out.stderr[-3000:]}")
    return int(lines[-1].split()[1])


def measure(config: str, overrides: list[str], stage: int, n: int,
            imitation: bool = False) -> int:
    return child_measurement(MEASURE, [json.dumps([config, overrides, stage, n, imitation])],
                             f"{config} {overrides} at ZeRO-{stage}",
                             env={"MALLOC_MMAP_THRESHOLD_": "65536"})


def predict(config: str, overrides: list[str], stage: int, n: int,
            imitation: bool = False) -> dict:
    """The model's figure for what `measure` sees, and its parts."""
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.memory.footprint import policy_footprint
    from hpcvla.memory.states import learner_bytes
    cfg = load_config(config, overrides)
    fp = policy_footprint(cfg, env_spec(cfg.env), n, 1, on_gpus=False, imitation=imitation)
    parts = learner_bytes(fp, stage, 1, on_gpu=False)
    return {"predicted": sum(parts.values()) - fp.weight_bytes, "parts": parts,
            "params": fp.params}


def peaks(names) -> dict:
    out = {}
    for name in names:
        config, overrides, stage, n, *imitation = CASES[name]
        row = predict(config, overrides, stage, n, *imitation)
        row["measured"] = measure(config, overrides, stage, n, *imitation)
        row["predicted_over_measured"] = row["predicted"] / row["measured"]
        out[name] = row
        print(f"{name:<20} measured {row['measured'] / 2 ** 20:7.0f} MiB  predicted "
              f"{row['predicted'] / 2 ** 20:7.0f} MiB  ratio {row['predicted_over_measured']:.2f}",
              flush=True)
    return out


def full_size_states(learners=(8, 64)) -> dict:
    """Model states per learner at full size vs DeepSpeed's estimators (ZeRO-2 and -3)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.memory.footprint import Footprint, parameter_counts
    from hpcvla.memory.states import model_states
    out = {}
    for name, (config, overrides) in FULL_SIZE.items():
        cfg = load_config(config, overrides + ["policy.dtype=bfloat16"])
        meta = build_policy(cfg, env_spec(cfg.env), device="meta")
        params, trainable, b, largest = parameter_counts(meta)
        weights = sum(t.numel() * t.element_size() for t in [*meta.parameters(),
                                                               *meta.buffers()])
        fp = Footprint(params, trainable, weights, b, largest, 0, 0, 0, 0)
        for n in learners:
            for stage in (2, 3):
                ours = model_states(fp, stage, n)
                # buffers DeepSpeed allocates that its estimators leave out: the gradient
                # bucket, and at ZeRO-3 the gradient partition (stage3's flat buffer)
                ours = sum(ours.values()) - ours["gradient bucket"] - \
                    (ours["gradients"] if stage == 3 else 0)
                if stage == 2:
                    _, theirs = estimate_zero2_model_states_mem_needs(
                        params, num_gpus_per_node=n, cpu_offload=False)
                else:
                    _, theirs, _ = estimate_zero3_model_states_mem_needs(
                        params, largest, num_gpus_per_node=n, cpu_offload=False,
                        cpu_offload_params=False)
                key = f"{name} ZeRO-{stage} x{n}"
                out[key] = {"ours": ours, "deepspeed": theirs, "ratio": ours / theirs,
                            "params": params}
                print(f"{key:<20} ours {ours / 2 ** 30:6.2f} GiB  DeepSpeed "
                      f"{theirs / 2 ** 30:6.2f} GiB  ratio {ours / theirs:.3f}", flush=True)
    return out


def run(quick: bool = False, json_path: str | None = None) -> dict:
    result = {"learner_peaks": peaks(QUICK if quick else CASES),
              "full_size_model_states": full_size_states(),
              "simulators": simulators(SIMULATORS if not quick else ("maniskill-4-envs",))}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result
