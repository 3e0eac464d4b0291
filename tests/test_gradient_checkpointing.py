"""learner.gradient_checkpointing: the gradients are the same to the bit with and without it
(every VLA family and mode, π0.5's time-conditioned norms included), the activation memory
the planner counts falls, and the setting is refused where there is nothing to recompute.
End to end under DeepSpeed: tests/test_vla_policies.py (ZeRO-3 runs) and
tests/test_checkpoint.py (resume)."""

from __future__ import annotations

import pytest
import torch

from hpcvla.config import ConfigError, load_config
from hpcvla.envs import env_spec
from hpcvla.factory import build_policy
from hpcvla.memory.footprint import policy_footprint
from helpers import VLA_CASES, policy_batch

def gradients(cfg, spec, checkpointing: bool, supervised: bool):
    policy = build_policy(cfg, spec)
    if checkpointing:
        policy.enable_gradient_checkpointing()
    obs, actions = policy_batch(spec)
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


@pytest.mark.parametrize("case", list(VLA_CASES))
def test_checkpointed_gradients_are_the_same_to_the_bit(case):
    """PPO's evaluate and SFT's loss: every parameter that gets a gradient without
    checkpointing gets the same one with it (a dropped prefix cache or a norm reading
    another pass's time would change them or fail)."""
    config, overrides = VLA_CASES[case]
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
