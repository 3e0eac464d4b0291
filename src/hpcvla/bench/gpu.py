"""`hpcvla bench gpu`: what each rank of a node would compute on, and the GPU paths measured.

Sections of the JSON (each says `skipped` and why when it cannot run here):

* `devices`: the device map (devices.py) of `configs/reach_flow.yaml`'s layout on this node's
  visible GPUs, rank by rank, as `hpcvla plan` prints it.
* `presets`: one act and one learner step (evaluate + backward) of each VLA preset whose
  training state fits the free GPU memory (bf16 weights and gradients, fp32 masters and Adam
  moments: 16 bytes per parameter, plus a quarter for activations), batch 8, bf16.
* `flow_inference`: `act` of the flow policy (`small`; batch 32) on the CPU (float32, every
  core torch uses) and on the GPU (bf16), side by side: `gpu_speedup` = CPU ms / GPU ms.
* `memory_model`: π0 at full size in bf16 on LIBERO's shapes (224 px, two cameras), built on
  the GPU: the memory model's footprint (hpcvla/memory: weights, a micro-batch's forward and
  backward, one `act`; shallow copies run on meta tensors (memory/footprint.py), as `hpcvla
  plan` computes it)
  against CUDA's allocator peaks of the same steps, with and without gradient checkpointing.
* `reach_training`: `hpcvla train configs/reach_flow.yaml`, 20 updates, 4 ranks: success rate,
  wall time, and the device and dtype every rank reported.
* `maniskill_gpu_sim`: env steps/s of one ManiSkill GPU-simulated shard (env.sim_backend=gpu,
  PickCube-v1, 64 px camera) at 1, 64 and 512 envs.
* `modes_real`: `hpcvla bench modes --workload real` on the GPUs (2 per pair of accelerator
  ranks; one GPU: inference and learner share it).

On a machine without CUDA the GPU sections are skipped and the CPU side still runs, so the
check itself is tested by the CPU suite (`--quick`: tiny sizes, 2 updates).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hpcvla.bench.policies import FAMILIES, step_ms
from hpcvla.envs import make_env
from hpcvla.job.trainrun import train_run
from hpcvla.policies import Policy, make_policy
from hpcvla.policies.registry import count_preset_parameters
from hpcvla.policies.vla import SIZE_NAMES

ROOT = Path(__file__).resolve().parents[3]
NO_CUDA = "no CUDA device visible (torch.cuda.is_available() is False)"


def _reach_batch(batch: int):
    env = make_env("reach", batch, 0)
    spec, obs = env.spec, env.reset()
    env.close()
    return spec, obs


def _policy_times(family, size, device, batch, repeats) -> dict:
    """act and learner-step ms of one preset on `device` (bf16 on a GPU)."""
    spec, obs_np = _reach_batch(batch)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    torch.manual_seed(0)
    policy = make_policy(family, spec.obs, spec.action_dim, spec.chunk_len, len(spec.vocab),
                         size=size, dtype=dtype).to(device)
    obs = Policy.obs_to_tensors(obs_np, device)
    row = {"device": str(device), "dtype": dtype,
           **step_ms(policy, obs, repeats, device)}
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    del policy
    return row


def presets(device, quick: bool) -> dict:
    spec, _ = _reach_batch(1)
    args = (spec.obs, spec.action_dim, spec.chunk_len, len(spec.vocab))
    out = {}
    for family in FAMILIES:
        for size in SIZE_NAMES:
            key, params = f"{family}/{size}", count_preset_parameters(family, size, *args)
            need_gib = params * 16 * 1.25 / 2 ** 30
            if device.type == "cuda":
                torch.cuda.empty_cache()
                free_gib = torch.cuda.mem_get_info(device)[0] / 2 ** 30
            else:
                free_gib = None
            if device.type != "cuda" and size != "tiny":
                out[key] = {"parameters": params, "skipped": f"{NO_CUDA}; the CPU runs tiny"}
            elif quick and size != "tiny":
                out[key] = {"parameters": params, "skipped": "--quick: tiny only"}
            elif free_gib is not None and need_gib > free_gib:
                out[key] = {"parameters": params, "skipped": f"needs ~{need_gib:.0f} GiB to "
                            f"train, {free_gib:.0f} GiB free (learner.zero_stage=3 over "
                            "several GPUs shards it)"}
            else:
                out[key] = {"parameters": params,
                            **_policy_times(family, size, device, 8, 3 if quick else 10)}
            print(f"preset {key:12} {json.dumps(out[key])}", flush=True)
    return out


def flow_inference(gpu, quick: bool) -> dict:
    size, batch = ("tiny", 8) if quick else ("small", 32)
    out = {"size": size, "batch": batch, "cpu_threads": torch.get_num_threads(),
           "cpu": _policy_times("flow", size, torch.device("cpu"), batch, 3 if quick else 10)}
    if gpu is None:
        out["gpu"] = {"skipped": NO_CUDA}
    else:
        out["gpu"] = _policy_times("flow", size, gpu, batch, 3 if quick else 10)
        out["gpu_speedup"] = out["cpu"]["act_ms"] / out["gpu"]["act_ms"]
    print(f"flow inference {json.dumps(out)}", flush=True)
    return out


# name -> (overrides of configs/libero_pi0.yaml, observations per micro-batch)
PI0_CASES = {"pi0-full-checkpointed": (["learner.gradient_checkpointing=true"], 16),
             "pi0-full": ([], 8)}
PI0_FULL = ["policy.pretrained=", "policy.tokenizer=", "policy.size=full",
            "policy.dtype=bfloat16", "env.image_size=224"]
ACT_OBS = 8


def memory_model(gpu, quick: bool) -> dict:
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.memory.footprint import policy_footprint
    out = {}
    for name, (overrides, train_obs) in list(PI0_CASES.items())[:1 if quick else None]:
        cfg = load_config(ROOT / "configs/libero_pi0.yaml", PI0_FULL + overrides)
        try:
            spec = env_spec(cfg.env)
        except ImportError as err:  # LIBERO's tasks give the instruction length
            return {"skipped": str(err)}
        fp = policy_footprint(cfg, spec, train_obs, ACT_OBS, on_gpus=True)
        predicted = {"weights": fp.weight_bytes, "train": fp.train_bytes, "act": fp.act_bytes}
        measured = _cuda_footprint(cfg, spec, gpu, train_obs)
        out[name] = {"params": fp.params, "train_obs": train_obs, "act_obs": ACT_OBS,
                     "predicted_gib": {k: v / 2 ** 30 for k, v in predicted.items()},
                     "measured_gib": {k: v / 2 ** 30 for k, v in measured.items()},
                     "predicted_over_measured": {k: predicted[k] / measured[k]
                                                 for k in predicted}}
        print(f"memory model {name} {json.dumps(out[name])}", flush=True)
    return out


def _cuda_footprint(cfg, spec, gpu, train_obs: int) -> dict[str, int]:
    """What footprint.policy_footprint counts, from CUDA's allocator: the weights, the peak above
    them of one micro-batch's forward and backward (gradients dropped as they come: the
    engine's are modelled apart), and of one `act`."""
    from hpcvla.factory import constructor_kwargs
    from hpcvla.memory.footprint import drop_gradients, observation_batch, step_loss

    def peak_above_now(step) -> int:
        torch.cuda.synchronize(gpu)
        base = torch.cuda.memory_allocated(gpu)
        torch.cuda.reset_peak_memory_stats(gpu)
        step()
        torch.cuda.synchronize(gpu)
        return torch.cuda.max_memory_allocated(gpu) - base

    def observations(n):
        return {k: v.to(gpu) for k, v in observation_batch(spec, policy.extra_fields(),
                                                            n).items()}

    def train():
        actions = torch.zeros((train_obs, spec.chunk_len, spec.action_dim), device=gpu)
        outputs = policy.evaluate(observations(train_obs), actions)
        step_loss(outputs).backward()

    def act():
        with torch.no_grad():
            policy.act(observations(ACT_OBS))

    before = torch.cuda.memory_allocated(gpu)
    with torch.device(gpu):  # initialised there: 3 B parameters on the CPU take minutes
        policy = make_policy(cfg.policy.name, spec.obs, spec.action_dim, spec.chunk_len,
                             len(spec.vocab), **constructor_kwargs(cfg, on_gpus=True))
    if cfg.learner.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    drop_gradients(policy)
    torch.cuda.synchronize(gpu)
    try:
        return {"weights": torch.cuda.memory_allocated(gpu) - before,
                "train": peak_above_now(train), "act": peak_above_now(act)}
    finally:
        del policy
        torch.cuda.empty_cache()


def _hpcvla(*args, timeout=1800) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "hpcvla", *map(str, args)], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"hpcvla {' '.join(map(str, args))} failed:\n{out.stderr[-3000:]}")
    return out


def reach_training(quick: bool) -> dict:
    updates = 2 if quick else 20
    with tempfile.TemporaryDirectory(prefix="hpcvla-gpu-") as tmp:
        _, summary = train_run(["configs/reach_flow.yaml", "--ranks", 4,
                                f"pipeline.total_updates={updates}",
                                "pipeline.progress_every_s=1000"], Path(tmp), cwd=ROOT)
    out = {"updates": updates, "wall_s": summary["wall_s"],
           "env_steps_per_s": summary["env_steps_per_s"],
           "success_rate": summary["success_rate"],
           "ranks": {r["rank"]: f"{r['role']} {r['device']} {r['dtype']}"
                     for r in summary["per_rank"]}}
    print(f"reach training {json.dumps(out)}", flush=True)
    return out


def maniskill_gpu_sim(quick: bool) -> dict:
    from hpcvla.config import load_config
    from hpcvla.envs import env_kwargs

    from hpcvla.envs.maniskill_gpu import physx_gpu_missing
    unavailable = physx_gpu_missing()
    if unavailable:
        print(f"maniskill gpu sim: skipped: {unavailable}", flush=True)
        return {"skipped": unavailable}

    cfg = load_config(None, ["env.name=maniskill", "env.task=PickCube-v1", "env.image_size=64",
                             "env.sim_backend=gpu", "env.chunk_len=5"])
    out, chunks = {}, 2 if quick else 10
    for envs in ((1, 4) if quick else (1, 64, 512)):
        env = make_env("maniskill", envs, 0, **env_kwargs(cfg.env))
        try:
            env.reset()
            actions = torch.zeros(envs, env.spec.chunk_len, env.spec.action_dim).numpy()
            env.step(actions)  # warm-up
            start = time.perf_counter()
            for _ in range(chunks):
                env.step(actions)
            seconds = time.perf_counter() - start
        finally:
            env.close()
        out[str(envs)] = {"env_steps_per_s": envs * env.spec.chunk_len * chunks / seconds}
        print(f"maniskill gpu sim {envs:4} envs: {out[str(envs)]['env_steps_per_s']:.0f} "
              "env steps/s", flush=True)
    return out


def modes_real(gpus: int, quick: bool) -> dict:
    accel = 1 if gpus == 1 else min(8, gpus - gpus % 2)
    with tempfile.TemporaryDirectory(prefix="hpcvla-gpu-") as tmp:
        _hpcvla("bench", "modes", "--workload", "real", "--gpus", accel,
                *(["--quick"] if quick else []), "--json", f"{tmp}/modes.json", timeout=3600)
        return json.loads(Path(f"{tmp}/modes.json").read_text())


def run(quick: bool = False, json_path=None) -> dict:
    from hpcvla.config import load_config
    from hpcvla.devices import plan_devices, visible_gpus
    from hpcvla.envs import env_uses_gpu
    from hpcvla.topology.plan import plan_from_config

    gpus = len(visible_gpus())
    gpu = torch.device("cuda", 0) if gpus else None
    cfg = load_config(ROOT / "configs/reach_flow.yaml")
    plan = plan_from_config(cfg.placement, 4)
    results = {"gpus": gpus, "gpu_name": torch.cuda.get_device_name(0) if gpus else None,
               "torch": torch.__version__, "quick": quick,
               "devices": plan_devices(plan, gpus, env_uses_gpu(cfg.env))}
    print(plan.table(results["devices"]), flush=True)
    results["presets"] = presets(gpu or torch.device("cpu"), quick)
    results["flow_inference"] = flow_inference(gpu, quick)
    results["memory_model"] = memory_model(gpu, quick) if gpus else {"skipped": NO_CUDA}
    results["reach_training"] = reach_training(quick)
    results["maniskill_gpu_sim"] = maniskill_gpu_sim(quick) if gpus else {"skipped": NO_CUDA}
    results["modes_real"] = modes_real(gpus, quick) if gpus else \
        {"skipped": f"{NO_CUDA}; on CPU run `hpcvla bench modes --workload real`"}
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1, default=str))
    return results


__all__ = ["run"]
