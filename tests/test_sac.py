"""Tests for the SAC losses (algorithms/sac.py) and the replay buffer (algorithms/replay.py),
against values computed by hand on tiny tensors; transitions cut from segment groups
(algorithms/transitions.py); SAC's objective on the default policy's critics
(algorithms/off_policy.py, policies/soft_critics.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcvla.algorithms.replay import ReplayBuffer, symmetric_sample
from hpcvla.algorithms.transitions import transition_specs, transitions_of
from hpcvla.algorithms.sac import (actor_loss, critic_loss, target_entropy,
                                   polyak_update, soft_target, temperature_loss)

# ----------------------------------------------------------------------------- SAC losses


def test_soft_target_bootstraps_unless_terminal():
    reward = torch.tensor([1.0, 2.0])
    next_q1, next_q2 = torch.tensor([10.0, 4.0]), torch.tensor([8.0, 6.0])
    next_logprob = torch.tensor([-2.0, -1.0])
    # row 0: min(10, 8) - 0.5 * (-2) = 9;  y = 1 + 0.9 * 9 = 9.1
    # row 1: terminal, nothing bootstrapped: y = 2
    y = soft_target(reward, torch.tensor([False, True]), next_q1, next_q2, next_logprob,
                    alpha=0.5, discount=0.9)
    torch.testing.assert_close(y, torch.tensor([9.1, 2.0]))
    # not terminal (a truncation bootstraps): row 1 is min(4, 6) - 0.5 * (-1) = 4.5,
    # y = 2 + 0.9 * 4.5 = 6.05
    y = soft_target(reward, torch.tensor([0.0, 0.0]), next_q1, next_q2, next_logprob,
                    alpha=0.5, discount=0.9)
    torch.testing.assert_close(y, torch.tensor([9.1, 6.05]))


def test_soft_target_per_transition_discount_and_finer_logprob():
    # transitions of 2 and 3 chunks at gamma 0.9: discounts 0.81 and 0.729
    # row 0: 1 + 0.81 * 9 = 8.29;  row 1: 2 + 0.729 * 4.5 = 5.2805
    # next log-probs given per action, (-1.5, -0.5) and (-0.25, -0.75): sums -2 and -1
    y = soft_target(torch.tensor([1.0, 2.0]), torch.tensor([False, False]),
                    torch.tensor([10.0, 4.0]), torch.tensor([8.0, 6.0]),
                    torch.tensor([[-1.5, -0.5], [-0.25, -0.75]]),
                    alpha=torch.tensor(0.5, requires_grad=True),
                    discount=torch.tensor([0.81, 0.729]))
    torch.testing.assert_close(y, torch.tensor([8.29, 5.2805]))
    assert not y.requires_grad


def test_soft_target_takes_no_gradient():
    next_q1 = torch.tensor([1.0], requires_grad=True)
    y = soft_target(torch.tensor([0.0]), torch.tensor([False]), next_q1, next_q1 + 1,
                    torch.tensor([0.0]), alpha=0.1, discount=0.99)
    assert not y.requires_grad


def test_critic_loss_is_the_sum_of_two_plain_mses():
    q1 = torch.tensor([1.0, 2.0], requires_grad=True)
    q2 = torch.tensor([0.0, 4.0], requires_grad=True)
    target = torch.tensor([2.0, 2.0], requires_grad=True)
    loss = critic_loss(q1, q2, target)
    # q1: errors (-1, 0), MSE (1 + 0) / 2 = 0.5;  q2: errors (-2, 2), MSE (4 + 4) / 2 = 4
    assert loss.item() == pytest.approx(4.5)  # MSE, not 0.5 * MSE (which would be 2.25)
    loss.backward()
    # d/dq1 = 2 * (q1 - y) / 2 = (-1, 0);  d/dq2 = (-2, 2);  the target gets none
    torch.testing.assert_close(q1.grad, torch.tensor([-1.0, 0.0]))
    torch.testing.assert_close(q2.grad, torch.tensor([-2.0, 2.0]))
    assert target.grad is None


def test_actor_loss_hand_computed():
    logprob = torch.tensor([-1.0, -2.0], requires_grad=True)
    q1, q2 = torch.tensor([3.0, 5.0]), torch.tensor([4.0, 1.0])
    alpha = torch.tensor(0.2, requires_grad=True)
    # min q = (3, 1);  alpha * logp = (-0.2, -0.4);  terms (-3.2, -1.4);  mean -2.3
    loss = actor_loss(logprob, q1, q2, alpha)
    assert loss.item() == pytest.approx(-2.3)
    loss.backward()
    torch.testing.assert_close(logprob.grad, torch.tensor([0.1, 0.1]))  # alpha / 2
    assert alpha.grad is None  # the temperature is trained by its own loss
    # per-action log-probs (-0.5, -0.5) and (-1.5, -0.5) sum to the same chunks
    finer = torch.tensor([[-0.5, -0.5], [-1.5, -0.5]])
    assert actor_loss(finer, q1, q2, 0.2).item() == pytest.approx(-2.3)


def test_temperature_loss_and_its_gradient_sign():
    target = target_entropy(action_dim=3, chunk_len=2)
    assert target == -6.0  # -(2 * 3)
    # entropy below target: logp (7, 9), entropy -8 < -6;  logp + target = (1, 3)
    log_alpha = torch.tensor(0.5, requires_grad=True)
    logprob = torch.tensor([7.0, 9.0], requires_grad=True)
    loss = temperature_loss(log_alpha, logprob, target)
    assert loss.item() == pytest.approx(-1.0)  # -(0.5 * 1 + 0.5 * 3) / 2
    loss.backward()
    assert log_alpha.grad.item() == pytest.approx(-2.0)  # -(1 + 3) / 2: descent raises alpha
    assert logprob.grad is None
    assert (log_alpha - 0.1 * log_alpha.grad).item() == pytest.approx(0.7)  # an SGD step
    # entropy above target: logp (-1, -3), entropy 2 > -6;  logp + target = (-7, -9)
    log_alpha = torch.tensor(0.0, requires_grad=True)
    temperature_loss(log_alpha, torch.tensor([-1.0, -3.0]), target).backward()
    assert log_alpha.grad.item() == pytest.approx(8.0)  # -(-7 - 9) / 2: alpha shrinks


def test_target_entropy_per_dimension_and_empty_actions():
    assert target_entropy(7) == -7.0  # SAC's convention
    assert target_entropy(2, 4, per_dim=0.0) == 0.0  # DSRL's recipe
    assert target_entropy(2, 4, per_dim=0.5) == 4.0
    with pytest.raises(ValueError, match="action_dim 0"):
        target_entropy(0, 4)


def test_polyak_update_in_place():
    target = [torch.nn.Parameter(torch.tensor([0.0, 2.0])), torch.nn.Parameter(torch.ones(1, 1))]
    online = [torch.tensor([4.0, 4.0]), torch.tensor([[-1.0]])]
    polyak_update(target, online, tau=0.5)
    # 0.5 * (0, 2) + 0.5 * (4, 4) = (2, 3);  0.5 * 1 + 0.5 * (-1) = 0
    torch.testing.assert_close(target[0].data, torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(target[1].data, torch.tensor([[0.0]]))
    torch.testing.assert_close(online[0], torch.tensor([4.0, 4.0]))  # the online untouched
    polyak_update(target[:1], online[:1], tau=0.25)  # 0.75 * (2, 3) + 0.25 * (4, 4)
    torch.testing.assert_close(target[0].data, torch.tensor([2.5, 3.25]))
    with pytest.raises(ValueError, match="tensor 0"):
        polyak_update(target[:1], [torch.zeros(3)], tau=0.5)
    with pytest.raises(ValueError):
        polyak_update(target, online[:1], tau=0.5)
    torch.testing.assert_close(target[0].data, torch.tensor([2.5, 3.25]))  # nothing moved
    with pytest.raises(ValueError, match="tau"):
        polyak_update(target, online, tau=1.5)


# ----------------------------------------------------------------------------- replay buffer

SPECS = {"obs": ((2,), np.float32), "step": ((), np.int64)}


def batch(*steps: int) -> dict[str, np.ndarray]:
    """Transitions numbered by `step`, each obs (step, -step), so a sample shows its origin."""
    step = np.array(steps, dtype=np.int64)
    return {"obs": np.stack([step, -step], axis=-1).astype(np.float32), "step": step}


def held(buffer: ReplayBuffer) -> list[int]:
    """The held transitions' numbers, oldest first (the module docstring's slots)."""
    slots = buffer._slots(buffer.position - buffer.size, buffer.size)
    return buffer._data["step"][slots].tolist()


def test_ring_overwrites_oldest_first():
    buffer = ReplayBuffer(SPECS, capacity=3)
    assert buffer.nbytes == ReplayBuffer.nbytes_of(SPECS, 3) == 48  # 3 * (2 * 4 + 8)
    buffer.add(batch(0, 1))
    assert (buffer.size, buffer.position, held(buffer)) == (2, 2, [0, 1])
    buffer.add(batch(2, 3))  # 3 overwrites 0
    assert (buffer.size, buffer.position, held(buffer)) == (3, 4, [1, 2, 3])
    buffer.add(batch(4))  # 4 overwrites 1
    assert (buffer.size, buffer.position, held(buffer)) == (3, 5, [2, 3, 4])
    buffer.add(batch(5, 6, 7, 8, 9))  # more than the capacity: the newest 3 stay
    assert (buffer.size, buffer.position, held(buffer)) == (3, 10, [7, 8, 9])
    buffer.add(batch())  # an empty batch changes nothing
    assert (len(buffer), buffer.position) == (3, 10)


def test_samples_come_only_from_held_transitions():
    rng = np.random.default_rng(0)
    buffer = ReplayBuffer(SPECS, capacity=5)
    buffer.add(batch(10, 11))  # slots 2-4 are still unwritten zeros
    out = buffer.sample(200, rng)
    assert out["obs"].shape == (200, 2) and out["step"].shape == (200,)
    assert out["obs"].dtype == np.float32 and out["step"].dtype == np.int64
    assert set(out["step"].tolist()) == {10, 11}
    np.testing.assert_array_equal(out["obs"][:, 0], out["step"])  # fields stay together
    buffer.add(batch(*range(12, 19)))  # wraps: holds 14 ... 18
    assert set(buffer.sample(200, rng)["step"].tolist()) == {14, 15, 16, 17, 18}


def test_symmetric_sampling_counts():
    rng = np.random.default_rng(0)
    online, demos = ReplayBuffer(SPECS, 4), ReplayBuffer(SPECS, 4)
    online.add(batch(1, 2, 3))
    demos.add(batch(101, 102))
    for n, from_online in ((4, 2), (5, 3), (1, 1), (0, 0)):  # the odd one online
        out = symmetric_sample(online, demos, n, rng)
        assert out["step"].shape == (n,) and out["obs"].shape == (n, 2)
        assert all(s < 100 for s in out["step"][:from_online])
        assert all(s > 100 for s in out["step"][from_online:])


def test_symmetric_sampling_errors():
    rng = np.random.default_rng(0)
    full, empty = ReplayBuffer(SPECS, 2), ReplayBuffer(SPECS, 2)
    full.add(batch(1))
    with pytest.raises(ValueError, match="online replay buffer is empty"):
        symmetric_sample(empty, full, 2, rng)
    with pytest.raises(ValueError, match="demonstration replay buffer is empty"):
        symmetric_sample(full, empty, 2, rng)
    other = ReplayBuffer({"step": ((), np.int64)}, 2)
    other.add({"step": np.array([1])})
    with pytest.raises(ValueError, match="differ"):
        symmetric_sample(full, other, 2, rng)


def test_add_names_the_field_that_does_not_match():
    buffer = ReplayBuffer(SPECS, 4)
    with pytest.raises(ValueError, match=r"missing \['step'\]"):
        buffer.add({"obs": batch(1)["obs"]})
    with pytest.raises(ValueError, match=r"unexpected \['reward'\]"):
        buffer.add({**batch(1), "reward": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match=r"'obs': shape \(1, 3\), expected \(N, 2\)"):
        buffer.add({**batch(1), "obs": np.zeros((1, 3), np.float32)})
    with pytest.raises(ValueError, match="'obs': dtype float64, expected float32"):
        buffer.add({**batch(1), "obs": np.zeros((1, 2), np.float64)})
    with pytest.raises(ValueError, match="'step': 2 transitions"):
        buffer.add({**batch(1), "step": np.array([1, 2])})
    assert (buffer.size, buffer.position) == (0, 0)  # nothing half-added
    for capacity in (0, -1):
        with pytest.raises(ValueError, match="capacity"):
            ReplayBuffer(SPECS, capacity)


# ----------------------------------------------------------------------------- transitions


def _group(T=3, n=2):
    """A segment group of T rows of n envs with a scalar observation 'x' = 10 * t + env."""
    x = (10 * np.arange(T)[:, None] + np.arange(n)[None]).astype(np.float32)
    zeros = np.zeros((T, n), bool)
    return {"obs.x": x[..., None], "next_obs.x": (10 * T + np.arange(n))[:, None]
            .astype(np.float32), "actions": np.ones((T, n, 2, 1), np.float32),
            "reward": x.copy(), "terminated": zeros.copy(), "truncated": zeros.copy(),
            "env_fault": zeros.copy()}


def test_transitions_pair_each_row_with_the_next_and_the_last_with_next_obs():
    group = _group()
    out, dropped = transitions_of(group, ["x"])
    assert dropped == 0
    assert out["obs.x"][:, 0].tolist() == [0, 1, 10, 11, 20, 21]
    assert out["next_obs.x"][:, 0].tolist() == [10, 11, 20, 21, 30, 31]
    specs = transition_specs({"x": ((1,), "<f4")}, 2, 1)
    ReplayBuffer(specs, 8).add(out)  # the layout a buffer holds


def test_transitions_drop_faults_and_horizon_cuts_and_keep_terminals():
    group = _group()
    group["terminated"][0, 0] = True  # success: kept, no bootstrap
    group["truncated"][1, 1] = True  # the horizon: its next observation is a reset one
    group["env_fault"][2, 0] = group["truncated"][2, 0] = True  # a failed env
    out, dropped = transitions_of(group, ["x"])
    assert dropped == 2
    assert out["obs.x"][:, 0].tolist() == [0, 1, 10, 21]
    assert out["terminal"].tolist() == [True, False, False, False]


# ----------------------------------------------------------------------------- the objective


SPEC = {"image": ((32, 32, 3), "|u1"), "instruction": ((4,), "<i4"), "state": ((3,), "<f4")}


def _batch(n, rng):
    obs = {"image": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
           "instruction": rng.integers(1, 9, (n, 4)).astype(np.int32),
           "state": rng.standard_normal((n, 3)).astype(np.float32)}
    batch = {f"obs.{k}": v for k, v in obs.items()}
    batch.update({f"next_obs.{k}": v[::-1].copy() for k, v in obs.items()})
    batch.update(actions=rng.standard_normal((n, 2, 2)).astype(np.float32),
                 reward=rng.standard_normal(n).astype(np.float32),
                 terminal=rng.random(n) < 0.3)
    return {k: torch.as_tensor(v) for k, v in batch.items()}


def _soft_policy(layer_norm=False):
    from hpcvla.policies import make_policy
    torch.manual_seed(0)
    return make_policy("default", SPEC, 2, 2, 9, hidden=16, soft_critics=True,
                       critic_layer_norm=layer_norm)


def test_each_sac_loss_moves_only_what_it_is_meant_to():
    """One backward of the summed losses: the critics and the encoders get the critic's
    gradient, the actor head the actor's, the temperature its own; the targets none; and
    the actor's loss alone leaves the critics and the encoder untouched."""
    from hpcvla.algorithms.off_policy import soft_actor_critic_loss

    class Alg:
        gamma = 0.99
    policy = _soft_policy(layer_norm=True)
    batch = _batch(8, np.random.default_rng(0))
    loss, stats = soft_actor_critic_loss(Alg, policy, batch, target_entropy=-4.0)
    loss.backward()
    grads = {n: p.grad for n, p in policy.named_parameters()}
    for prefix in ("value_q.", "image_encoder.", "state_encoder.", "trunk.", "mean_head.",
                   "log_std_head.", "sac_log_alpha"):
        assert any(n.startswith(prefix) and g is not None and g.abs().sum() > 0
                   for n, g in grads.items()), prefix
    assert all(g is None for n, g in grads.items() if n.startswith("value_q_target."))
    assert all(g is None for n, g in grads.items() if n.startswith(("value_trunk.",
                                                                    "value_head.")))
    assert stats["alpha"] == 1.0 and np.isfinite(list(stats.values())).all()
    # the actor's loss alone: no gradient to the critics or to the encoder
    policy.zero_grad(set_to_none=True)
    features = policy.features({k[4:]: v for k, v in batch.items() if k.startswith("obs.")})
    actions, logprob = policy.soft_actions(features.detach())
    actor_loss(logprob, *policy.soft_q(features.detach(), actions, frozen=True), 1.0).backward()
    assert all(p.grad is None for n, p in policy.named_parameters()
               if n.startswith(("value_q", "image_encoder.", "state_encoder.")))
    assert policy.mean_head.weight.grad.abs().sum() > 0


def test_the_critic_warmup_trains_the_critics_alone():
    """algorithm.critic_warmup's steps: the critics' gradient only, none to the encoders,
    the actor or the temperature (a policy from an SFT keeps acting as it imitated)."""
    from hpcvla.algorithms.off_policy import soft_actor_critic_loss

    class Alg:
        gamma = 0.99
    policy = _soft_policy(layer_norm=True)
    batch = _batch(8, np.random.default_rng(0))
    full, _ = soft_actor_critic_loss(Alg, policy, batch, target_entropy=-4.0)
    loss, stats = soft_actor_critic_loss(Alg, policy, batch, target_entropy=-4.0,
                                         critics_only=True)
    loss.backward()
    trained = {n for n, p in policy.named_parameters()
               if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained and all(n.startswith("value_q.") for n in trained), trained
    assert float(loss) == pytest.approx(stats["critic_loss"]) != pytest.approx(float(full))


def test_sac_steps_move_a_bandits_mean_to_its_target():
    """One-step episodes (terminal), reward -||a - target||^2 on a fixed batch of
    observations: SAC's gradient steps on a buffer of the policy's own samples pull its
    deterministic chunk toward the target, and the temperature follows the entropy."""
    from hpcvla.algorithms.off_policy import soft_actor_critic_loss, update_targets

    class Alg:
        gamma = 0.99
    policy = _soft_policy()
    rng = np.random.default_rng(1)
    batch = _batch(64, rng)
    target = torch.tensor([0.5, -0.5, 0.3, -0.3])
    obs = {k[4:]: v for k, v in batch.items() if k.startswith("obs.")}
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)

    def mean_distance():
        with torch.no_grad():
            return float((policy.act(obs, deterministic=True).actions.flatten(1) - target)
                         .pow(2).sum(-1).mean())

    start = mean_distance()
    for _ in range(150):
        with torch.no_grad():
            flat = policy.act(obs).actions.flatten(1)
        step = dict(batch, actions=flat.view(-1, 2, 2),
                    reward=-(flat - target).pow(2).sum(-1), terminal=torch.ones(64, dtype=bool))
        loss, stats = soft_actor_critic_loss(Alg, policy, step, target_entropy=-4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        update_targets(policy, 0.05)
    assert mean_distance() < 0.3 * start, (start, mean_distance())
    assert stats["alpha"] < 0.8  # the entropy (~2.2) is above its target (-4): alpha falls
    online, moved = policy.value_q.q1[0].weight, policy.value_q_target.q1[0].weight
    assert not torch.equal(online, moved) and (online - moved).abs().max() < 0.5


def test_a_soft_policy_acts_inside_the_action_box():
    """SAC's actor squashes its chunk by tanh: samples and the deterministic chunk lie in
    (-1, 1), their log-probs are finite, and a recorded chunk on the box's edge scores."""
    policy = _soft_policy()
    obs = {k[4:]: v for k, v in _batch(16, np.random.default_rng(2)).items()
           if k.startswith("obs.")}
    with torch.no_grad():
        policy.log_std_head.bias.fill_(3.0)  # log std ~2: samples reach far past the box
        for deterministic in (False, True):
            out = policy.act(obs, deterministic)
            assert out.actions.abs().max() <= 1 and torch.isfinite(out.logprob).all()
        logprob, _, entropy = policy.evaluate(obs, torch.ones(16, 2, 2))
        assert torch.isfinite(logprob).all() and torch.isfinite(entropy).all()


def test_a_scaled_squash_scores_its_own_samples_at_the_edge():
    """DSRL's noise (tanh scaled to (-1.5, 1.5)): a sample whose tanh float32 rounds to the
    edge gets the log-prob of the Gaussian value it came from, the unscaled squash's minus
    log 1.5 per dimension, and a finite gradient (atanh of the edge is inf: NaN losses)."""
    import math

    from hpcvla.policies.soft_critics import squashed_gaussian
    mean = torch.tensor([[0.0, 5.0, 12.0, -30.0]], requires_grad=True)
    raw_log_std = torch.full((1, 4), -3.0)
    torch.manual_seed(0)
    scaled = squashed_gaussian(mean, raw_log_std, 1.5)
    noise = scaled.rsample()
    assert noise.abs().max() == 1.5  # the two saturated dimensions: on the edge in float32
    logprob = scaled.log_prob(noise)
    torch.manual_seed(0)
    plain = squashed_gaussian(mean, raw_log_std)
    expected = plain.log_prob(plain.rsample()) - math.log(1.5)
    assert torch.isfinite(logprob).all() and torch.allclose(logprob, expected)
    logprob.sum().backward()
    assert torch.isfinite(mean.grad).all()


def test_a_soft_policys_spread_is_a_function_of_the_state_inside_sacs_bounds():
    """SAC's actor's log std: init_log_std in every state at the start, apart between states
    once its layer moves, inside LOG_STD_BOUNDS whatever the layer says, and a gradient of
    the log-prob reaches its layer; a config starting outside the range is refused, and so
    are weights of the actor with one log-std vector."""
    from helpers import ROOT

    from hpcvla.config import load_config
    from hpcvla.config.families import LOG_STD_BOUNDS
    from hpcvla.config.loader import ConfigError

    policy = _soft_policy()  # init_log_std -0.7
    obs = {k[4:]: v for k, v in _batch(16, np.random.default_rng(3)).items()
           if k.startswith("obs.")}
    features = policy.features(obs).detach()

    def log_std():
        return policy.actor_dist(features).base_dist.stddev.log()
    assert torch.allclose(log_std(), torch.full((16, 4), -0.7))
    actions, logprob = policy.soft_actions(features)
    logprob.sum().backward()
    assert policy.log_std_head.weight.grad.abs().sum() > 0
    with torch.no_grad():
        policy.log_std_head.weight.normal_(0.0, 10.0)
        spread = log_std()
    assert spread.std(dim=0).min() > 0.1  # each dimension's spread differs between states
    assert LOG_STD_BOUNDS[0] <= spread.min() and spread.max() <= LOG_STD_BOUNDS[1]
    for config in ("colocated_sac.yaml", "default.yaml", "libero_pi0.yaml"):  # every family's
        with pytest.raises(ConfigError, match="policy.init_log_std"):
            load_config(ROOT / "configs" / config, ["policy.init_log_std=2.5"])
    # weights of the actor before its log std had a layer (one vector) are refused by name
    from hpcvla.checkpoint.store import CheckpointError, check_fit
    old = {**policy.state_dict(), "log_std": torch.zeros(4)}
    del old["log_std_head.weight"], old["log_std_head.bias"]
    with pytest.raises(CheckpointError, match="log_std"):
        check_fit(old, policy.state_dict(), "a checkpoint")


def test_a_dumps_episodes_become_transitions_each_last_row_only_if_terminal(tmp_path):
    """A real trajectory dump (reach, random actions) read as prior data: within an episode
    each row's next observation is the following row's; a last row is kept only where the
    task ended the episode, and rewards and ends are the dump's."""
    from helpers import reach_dump

    from hpcvla.algorithms.transitions import demonstration_transitions
    from hpcvla.demonstrations import read_demonstrations

    _, spec = reach_dump(tmp_path / "dump.h5", n_groups=8)
    demos = read_demonstrations(tmp_path / "dump.h5", spec, outcomes=True)
    first_end = int(np.flatnonzero(demos.episode != demos.episode[0])[0]) - 1
    assert demos.outcomes["truncated"][first_end]  # random actions: every episode cut
    demos.outcomes["truncated"][first_end] = False  # as if the task had ended the first
    demos.outcomes["terminated"][first_end] = True
    out, dropped = demonstration_transitions(demos.obs, demos.actions, demos.outcomes,
                                             demos.episode)
    rows = len(demos.actions)
    ends = np.r_[demos.episode[1:] != demos.episode[:-1], True]
    assert len(out["reward"]) + dropped == rows
    assert dropped == int((ends & ~demos.outcomes["terminated"].astype(bool)).sum())
    assert out["terminal"].sum() == int(demos.outcomes["terminated"].sum()) == 1
    assert out["reward"].sum() == pytest.approx(
        demos.outcomes["rewards"][~(ends & ~demos.outcomes["terminated"].astype(bool))].sum())
    kept_rows = np.flatnonzero(~(ends & ~demos.outcomes["terminated"].astype(bool)))
    for i, row in enumerate(kept_rows):  # the next observation: the episode's next row
        if not ends[row]:
            assert np.array_equal(out["next_obs.image"][i], demos.obs["image"][row + 1])
    # a reader's empty share of the files (more learners on a host than demonstrations)
    empty = next(part for r in range(rows) if not len(part := read_demonstrations(
        tmp_path / "dump.h5", spec, outcomes=True, part=(r, rows))))
    none, _ = demonstration_transitions(empty.obs, empty.actions, empty.outcomes or {},
                                        empty.episode)
    assert len(empty.episode) == 0 and {k: (v.shape[1:], v.dtype) for k, v in none.items()} \
        == {k: (v.shape[1:], v.dtype) for k, v in out.items()} and not len(none["reward"])


def test_the_plan_counts_rlpds_prior_data_from_the_files_headers(tmp_path):
    """`hpcvla plan`'s replay bytes of an RLPD learner: its online buffer, and its node's one
    copy of as many transitions as its demonstrations have rows (read from the dump's
    headers), counted once per node however many learners it holds."""
    from helpers import ROOT, reach_dump

    from hpcvla.config import load_config
    from hpcvla.demonstrations import read_demonstrations
    from hpcvla.memory.layout import replay_bytes

    _, spec = reach_dump(tmp_path / "dump.h5", n_groups=8)
    rows = len(read_demonstrations(tmp_path / "dump.h5", spec, outcomes=True).actions)
    sac = load_config(ROOT / "configs/colocated_sac.yaml", []).algorithm
    rlpd = load_config(ROOT / "configs/colocated_sac.yaml",
                       ["algorithm.name=rlpd", f"algorithm.demos={tmp_path / 'dump.h5'}"]).algorithm
    online, none = replay_bytes(sac, spec)
    per_transition = online // sac.replay_capacity
    assert rows > 0 and none == 0 and replay_bytes(rlpd, spec) == (online, rows * per_transition)
    # algorithm.demos_per_task=1: the first demonstration of each task (instruction), in file
    # order, counted by the same headers
    demos = read_demonstrations(tmp_path / "dump.h5", spec, outcomes=True)
    firsts = {}
    for episode in sorted(set(demos.episode.tolist())):
        firsts.setdefault(str(demos.task[episode]), episode)
    capped = sum(int((demos.episode == e).sum()) for e in firsts.values())
    one_each = load_config(ROOT / "configs/colocated_sac.yaml", [
        "algorithm.name=rlpd", f"algorithm.demos={tmp_path / 'dump.h5'}",
        "algorithm.demos_per_task=1"]).algorithm
    assert len(firsts) > 1 and capped < rows
    assert replay_bytes(one_each, spec) == (online, capped * per_transition)
    from hpcvla.memory.layout import PRIOR, plan_memory
    from hpcvla.topology.plan import plan_from_config
    cfg = load_config(ROOT / "configs/colocated_sac.yaml",
                      ["algorithm.name=rlpd", f"algorithm.demos={tmp_path / 'dump.h5'}"])
    plan = plan_from_config(cfg.placement, 4, 2)  # 2 nodes of 2 colocated learners
    from hpcvla.envs import env_spec
    from hpcvla.memory.footprint import policy_footprint

    def footprint(cfg, _, *args):  # the policy's at its env's spec; the buffers at the dump's
        return policy_footprint(cfg, env_spec(cfg.env), *args)
    memory = plan_memory(cfg, plan, {r: "cpu" for r in range(4)}, spec, footprint)
    for parts in memory.per_node_host().values():
        assert parts[PRIOR] == rows * per_transition and parts["replay buffers"] == 2 * online


def test_an_adam_state_torch_has_not_made_yet_is_saved_as_torch_would_make_it():
    """A checkpoint before the optimizer's first step (SAC before learning_starts) holds the
    masters alone; after it, a parameter no step has reached yet (torch makes its Adam state
    at its first gradient) is saved at step 0 with zero moments beside the others' real ones."""
    from hpcvla.checkpoint.optimizer_state import _replicated
    from hpcvla.checkpoint.store import _optimizer_snapshot
    stepped, idle = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([stepped, idle], lr=0.1)
    parts = [_replicated("stepped", stepped, optimizer), _replicated("idle", idle, optimizer)]
    tensors, index = _optimizer_snapshot(parts, rank=0)
    assert index["keys"] == [] and index["steps"] == {"stepped": 0.0, "idle": 0.0}
    assert set(tensors) == {"stepped/master", "idle/master", "rng.torch_cpu"}
    stepped.grad = torch.ones(3)
    optimizer.step()  # `idle` has no gradient: no state for it
    tensors, index = _optimizer_snapshot(parts, rank=0)
    assert index["keys"] == ["exp_avg", "exp_avg_sq"]
    assert index["steps"] == {"stepped": 1.0, "idle": 0.0}
    assert tensors["stepped/exp_avg"].abs().min() > 0 and tensors["stepped/exp_avg_sq"].all()
    assert not tensors["idle/exp_avg"].any() and not tensors["idle/exp_avg_sq"].any()
    # a snapshot that training may change under a background write is a copy; a save that
    # returns once written (the run's last) writes the CPU state's own memory
    assert tensors["stepped/master"].data_ptr() != stepped.data_ptr()
    tensors, _ = _optimizer_snapshot(parts, rank=0, copy=False)
    assert tensors["stepped/master"].data_ptr() == stepped.data_ptr()
    assert tensors["stepped/exp_avg"].data_ptr() == \
        optimizer.state[stepped]["exp_avg"].data_ptr()
    assert tensors["idle/exp_avg"].shape == idle.shape
