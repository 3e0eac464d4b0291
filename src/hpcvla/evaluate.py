"""`hpcvla eval`: the success rate of a policy (a run's checkpoint, or the untrained policy
its config builds) on a fixed set of initial states of the configured env, in this process.

Episodes start from init_state_ids 0, 1, 2, ...: two policies evaluated with the same
`episodes` see the same tasks, so their success rates compare directly (the policy still
samples its actions, as it does in training, unless `deterministic`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hpcvla import checkpoint
from hpcvla.envs import env_kwargs, make_env


def evaluate(cfg, weights: dict | None, episodes: int = 128, envs: int = 32, seed: int = 0,
             deterministic: bool = False) -> dict:
    """Run `episodes` episodes, `envs` at a time, each env one episode from its own initial
    state; returns success rate, mean return and episodes. `weights` None: untrained."""
    from hpcvla.roles.pipeline import build_policy  # the policy exactly as training builds it
    kwargs = env_kwargs(cfg.env)
    if cfg.env.name == "reach":  # no emulated latency, no injected faults
        kwargs.update(latency_median_ms=0.0, hang_at_step=0, crash_at_step=0)
    env = make_env(cfg.env.name, envs, seed, **kwargs)
    policy = build_policy(cfg, env.spec)
    if weights is not None:
        policy.load_arrays(weights)
    torch.manual_seed(seed)
    successes, returns = [], []
    try:
        for first in range(0, episodes, envs):
            obs = env.reset(init_state_ids=np.arange(first, first + envs))
            running = np.ones(envs, bool)
            success, ret = np.zeros(envs, bool), np.zeros(envs, np.float32)
            while running.any():  # each env's first episode; auto-reset ones are ignored
                with torch.no_grad():
                    actions = policy.act(policy.obs_to_tensors(obs), deterministic).actions
                result = env.step(actions.numpy())
                ended = running & (result.terminated | result.truncated)
                success[ended], ret[ended] = result.success[ended], result.episode_return[ended]
                running &= ~ended
                obs = result.obs
            keep = min(envs, episodes - first)  # the last batch may run more than needed
            successes += success[:keep].tolist()
            returns += ret[:keep].tolist()
    finally:
        env.close()
    return {"episodes": len(successes), "success_rate": float(np.mean(successes)),
            "mean_return": float(np.mean(returns))}


def checkpoint_weights(run_dir: Path) -> tuple[dict, dict]:
    """The newest checkpoint's weights of a run directory (or of a checkpoint directory), and
    its state (policy `version`, `counters` such as trained_env_steps)."""
    path = checkpoint.latest(run_dir)
    if path is None:
        raise checkpoint.CheckpointError(f"{run_dir}: no complete checkpoint "
                                         "(checkpoints/v*/state.json)")
    return checkpoint.load_weights(path), checkpoint.read_state(path)
