"""`hpcvla eval`: the success rate of a policy (a run's checkpoint, or the untrained policy
its config builds) on a fixed set of initial states of the configured env, in this process.

The env names the states (`VectorEnv.evaluation_states`): ids 0, 1, 2, ... where every id is
its own initial state (reach, ManiSkill), the suite's (task, fixed state) pairs taken task by
task in turn for LIBERO. They are all of the evaluation split, ids below EVAL_STATE_IDS,
which training never starts from (envs/base.py); the result names the split, the id range
and what the states are. Two policies evaluated with the same `episodes` see the same states,
so their success rates compare directly (the policy still samples its actions, as it does in
training, unless `deterministic`). An episode the env ended by a fault (`env_fault`) is no
verdict on the policy: it is left out and counted.

ManiSkill's evaluation conventions are reported beside this one: its evaluation runs every
episode to the horizon (ignore_terminations) and reports `success_once` (the task done at any
step) and `success_at_end` (done at the last step). For a ManiSkill env the episodes here run
the same way (`VectorEnv.run_to_horizon`): `success_rate` is then success_once, the same
outcome as an episode that ends at its first success (the same steps up to it), and
`success_at_end` is measured too.

`hpcvla export`: a run's newest checkpoint as a Hugging Face-style folder (`export_policy`).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from hpcvla import checkpoint
from hpcvla.devices import local_device
from hpcvla.envs import env_kwargs, make_env
from hpcvla.envs.base import is_evaluation_state


def evaluate(cfg, weights: dict | None, episodes: int = 128, envs: int = 32, seed: int = 0,
             deterministic: bool = False) -> dict:
    """Run the env's first `episodes` evaluation states, `envs` at a time, one episode each;
    returns success rate, mean return, episodes, faults and success per task.
    `weights` None: the untrained policy. The policy runs on the first visible GPU when
    there is one (placement.gpus_per_node=0: the CPU)."""
    from hpcvla.factory import build_policy  # the policy exactly as training builds it
    kwargs = env_kwargs(cfg.env)
    if cfg.env.name == "reach":  # no emulated latency, no injected faults
        kwargs.update(latency_median_ms=0.0, hang_at_step=0, crash_at_step=0)
    envs = max(1, min(envs, episodes))
    env = make_env(cfg.env.name, envs, seed, **kwargs)
    env.run_to_horizon = cfg.env.name == "maniskill"  # ManiSkill's conventions (docstring)
    policy = build_policy(cfg, env.spec, local_device(cfg.placement.gpus_per_node))
    if weights is not None:
        policy.load_arrays(weights)
    torch.manual_seed(seed)
    ids, tasks = env.evaluation_states(episodes)
    assert all(is_evaluation_state(int(i)) for i in ids), "evaluation states only"
    per_task, returns, faults, at_end = defaultdict(list), [], 0, []
    try:
        for first in range(0, len(ids), envs):
            batch = ids[first:first + envs]
            keep = len(batch)  # the last batch pads with repeats, whose outcomes are dropped
            obs = env.reset(init_state_ids=np.resize(batch, envs))
            running = np.ones(envs, bool)
            success, ret = np.zeros(envs, bool), np.zeros(envs, np.float32)
            fault, success_at_end = np.zeros(envs, bool), np.zeros(envs, bool)
            while running.any():  # each env's first episode; auto-reset ones are ignored
                with torch.no_grad():
                    actions = policy.act(policy.obs_to_tensors(obs, policy.device),
                                         deterministic).actions
                result = env.step(actions.cpu().numpy())
                ended = running & (result.terminated | result.truncated)
                success[ended], ret[ended] = result.success[ended], result.episode_return[ended]
                fault[ended] = result.env_fault[ended]
                if result.success_at_end is not None:
                    success_at_end[ended] = result.success_at_end[ended]
                running &= ~ended
                obs = result.obs
            for i in range(keep):
                if fault[i]:
                    faults += 1
                    continue
                per_task[tasks[first + i]].append(bool(success[i]))
                returns.append(float(ret[i]))
                at_end.append(bool(success_at_end[i]))
    finally:
        env.close()
    outcomes = [s for task in per_task.values() for s in task]
    return {"split": "evaluation", "init_state_ids": [int(ids.min()), int(ids.max())],
            "states": env.evaluation_kind,
            "actions": "deterministic" if deterministic else "sampled",
            "episodes": len(outcomes), "success_rate": float(np.mean(outcomes)),
            "mean_return": float(np.mean(returns)), "env_faults": faults,
            "device": str(policy.device),
            **({"success_once": float(np.mean(outcomes)),
                "success_at_end": float(np.mean(at_end))} if env.run_to_horizon else {}),
            "per_task": {task: {"episodes": len(s), "success_rate": float(np.mean(s))}
                         for task, s in per_task.items()}}


def checkpoint_weights(run_dir: Path) -> tuple[dict, dict]:
    """The newest checkpoint's weights of a run directory (or of a checkpoint directory), and
    its state (policy `version`, `counters` such as trained_env_steps)."""
    path = checkpoint.latest(run_dir)
    if path is None:
        raise checkpoint.CheckpointError(f"{run_dir}: no complete checkpoint "
                                         "(checkpoints/v*/state.json)")
    return checkpoint.load_weights(path), checkpoint.read_state(path)


def export_policy(cfg, run_dir: Path, out: Path) -> dict:
    """The newest checkpoint of the run `cfg` configured, as a folder `policy.pretrained` and
    `policies.load_pretrained` read (policies.save_pretrained), LoRA adapters merged into the
    weights (policies/lora.py); returns its version, merged layers and folder."""
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.policies import save_pretrained
    from hpcvla.policies.lora import merge_lora
    policy = build_policy(cfg, env_spec(cfg.env))
    weights, state = checkpoint_weights(run_dir)
    policy.load_arrays(weights)
    merged = merge_lora(policy) if cfg.policy.lora_rank else 0
    save_pretrained(policy, out)
    return {"version": state["version"], "merged_lora_layers": merged, "folder": str(out)}
