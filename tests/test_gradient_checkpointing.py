"""learner.gradient_checkpointing: the gradients are the same to the bit with and without it
(every VLA family and mode, π0.5's time-conditioned norms included), the activation memory
the planner counts falls, and the setting is refused where there is nothing to recompute.
End to end under DeepSpeed: tests/test_vla_policies.py (ZeRO-3 runs) and
tests/test_checkpoint.py (resume)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcvla.config import ConfigError, load_config
from hpcvla.envs import env_spec
from hpcvla.factory import build_policy
from hpcvla.memory.footprint import policy_footprint

CASES = {  # id -> (config, overrides)
    "pi0": ("configs/reach_flow.yaml", []),
    "pi0-chain": ("configs/reach_flow.yaml", ["policy.logprob_mode=chain"]),
    "pi0-expert-only": ("configs/reach_flow.yaml", ["policy.train_expert_only=true"]),
    "pi05": ("configs/reach_flow.yaml", ["policy.variant=pi05"]),
    "tokens": ("configs/reach_tokens.yaml", []),
    "oft": ("configs/maniskill_pickcube_oft.yaml", ["policy.pretrained=", "policy.tokenizer="]),
}


def batch(spec, n=3):
    rng = np.random.default_rng(1)
    obs = {}
    for key, (shape, dtype) in spec.obs.items():
        if dtype == "|u1":
            obs[key] = torch.from_numpy(rng.integers(0, 256, (n, *shape), dtype=np.uint8))
        elif "i" in dtype:
            obs[key] = torch.from_numpy(rng.integers(1, len(spec.vocab), (n, *shape))).int()
        else:
            obs[key] = torch.from_numpy(rng.standard_normal((n, *shape))).float()
    actions = torch.from_numpy(rng.uniform(-1, 1, (n, spec.chunk_len, spec.action_dim)))
    return obs, actions.float()


def gradients(cfg, spec, checkpointing: bool, supervised: bool):
    policy = build_policy(cfg, spec)
    if checkpointing:
        policy.enable_gradient_checkpointing()
    obs, actions = batch(spec)
    if policy.extra_fields():  # flow's chain mode scores the recorded denoising chain
        torch.manual_seed(3)
        obs.update(policy.sample(obs)[1])
    torch.manual_seed(5)  # flow matching draws its noise and times
    if supervised:
        loss = policy.imitation_loss(obs, actions, torch.ones(actions.shape[:2], dtype=bool))
    else:
        logprob, value, entropy = policy.evaluate(obs, actions)
        loss = logprob.mean() + value.pow(2).mean() + entropy.mean()
    loss.backward()
    return {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_gradients_are_the_same_to_the_bit(case):
    """PPO's evaluate and SFT's loss: every parameter that gets a gradient without
    checkpointing gets the same one with it (a dropped prefix cache or a norm reading
    another pass's time would change them or fail)."""
    config, overrides = CASES[case]
    cfg = load_config(config, overrides)
    spec = env_spec(cfg.env)
    for supervised in (False, True):
        plain = gradients(cfg, spec, False, supervised)
        recomputed = gradients(cfg, spec, True, supervised)
        assert plain.keys() == recomputed.keys() and len(plain) > 20
        for name in plain:
            assert torch.equal(plain[name], recomputed[name]), (case, supervised, name)


def test_the_planner_counts_the_activations_checkpointing_saves():
    """The small flow policy, 32 observations: the micro-batch's activation peak (fake
    tensors, as `hpcvla plan` counts it) falls several fold; acting is unchanged."""
    figures = {}
    for on in (False, True):
        cfg = load_config("configs/reach_flow.yaml", ["policy.size=small",
                                                      f"learner.gradient_checkpointing={on}"])
        figures[on] = policy_footprint(cfg, env_spec(cfg.env), 32, 8, on_gpus=False)
    assert figures[True].train_bytes * 3 < figures[False].train_bytes, figures
    assert figures[True].act_bytes == figures[False].act_bytes


def test_the_default_policy_refuses_gradient_checkpointing():
    with pytest.raises(ConfigError, match="learner.gradient_checkpointing"):
        load_config("configs/default.yaml", ["learner.gradient_checkpointing=true"])
