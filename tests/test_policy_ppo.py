"""Tests for the policy interface, DefaultPolicy and the PPO pieces."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributions import Normal

from hpcvla.algorithms import decoupled_ppo_loss, gae, normalize_advantages, value_loss
from hpcvla.policies import ActOutput, DefaultPolicy, Policy, make_policy
from helpers import policy_batch

VOCAB = 20
ACTION_DIM = 3
CHUNK = 4
SPEC = {"image": ((32, 32, 3), "|u1"), "instruction": ((5,), "<i4"), "state": ((7,), "<f4")}
SPEC_NO_STATE = {k: v for k, v in SPEC.items() if k != "state"}


def make_obs(spec: dict, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random numpy observations matching `spec`, with some instruction padding."""
    rng = np.random.default_rng(seed)
    obs = {}
    for name, (shape, dtype) in spec.items():
        if name == "image":
            obs[name] = rng.integers(0, 256, size=(batch, *shape), dtype=np.uint8)
        elif name == "instruction":
            tok = rng.integers(1, VOCAB, size=(batch, *shape)).astype(dtype)
            tok[:, 3:] = 0  # padding tail
            tok[0, :] = 0  # one fully padded instruction must still work
            obs[name] = tok
        else:
            obs[name] = rng.standard_normal((batch, *shape)).astype(dtype)
    return obs


def make(spec=SPEC, seed: int = 0) -> DefaultPolicy:
    torch.manual_seed(seed)
    return make_policy("default", spec, ACTION_DIM, CHUNK, VOCAB)


# ----------------------------------------------------------------------------- policy


def test_make_policy_registry():
    assert isinstance(make(), DefaultPolicy)
    assert isinstance(make(), Policy)
    with pytest.raises(ValueError, match="default"):
        make_policy("nope", SPEC, ACTION_DIM, CHUNK, VOCAB)


def test_obs_to_tensors_keeps_dtype_and_shares_memory():
    obs = make_obs(SPEC, 2)
    obs["image"].setflags(write=False)  # as when decoded from a received buffer
    t = Policy.obs_to_tensors(obs, "cpu")
    assert t["image"].dtype == torch.uint8
    assert t["instruction"].dtype == torch.int32
    assert t["state"].dtype == torch.float32
    assert t["state"].data_ptr() == obs["state"].ctypes.data  # no copy on CPU


@pytest.mark.parametrize("spec", [SPEC, SPEC_NO_STATE], ids=["state", "no_state"])
def test_act_shapes_and_dtypes(spec):
    policy = make(spec)
    out = policy.act(Policy.obs_to_tensors(make_obs(spec, 6), "cpu"))
    assert isinstance(out, ActOutput)
    assert out.actions.shape == (6, CHUNK, ACTION_DIM)
    assert out.logprob.shape == (6,) and out.value.shape == (6,)
    for t in out:
        assert t.dtype == torch.float32
        assert not t.requires_grad
        assert torch.isfinite(t).all()
    assert policy.has_state == ("state" in spec)


def test_evaluate_matches_act_and_independent_normal():
    policy = make()
    obs = Policy.obs_to_tensors(make_obs(SPEC, 8), "cpu")
    out = policy.act(obs)
    logprob, value, entropy = policy.evaluate(obs, out.actions)
    torch.testing.assert_close(logprob, out.logprob)
    torch.testing.assert_close(value, out.value)

    # Independent computation: per-dim Normal log-probs summed over chunk x action_dim.
    with torch.no_grad():
        mean = policy.mean_head(policy.trunk(policy.features(obs))).view(8, CHUNK, ACTION_DIM)
        std = policy.log_std.exp().view(CHUNK, ACTION_DIM)
        ref = Normal(mean, std).log_prob(out.actions).sum(dim=(1, 2))
    torch.testing.assert_close(logprob.detach(), ref)

    # Entropy: closed form sum(0.5 + 0.5 log(2 pi) + log_std), same for every sample.
    closed = (0.5 + 0.5 * math.log(2 * math.pi) + policy.log_std.detach()).sum()
    assert (entropy > 0).all()
    torch.testing.assert_close(entropy.detach(), closed.expand(8))


def test_deterministic_act_returns_mean():
    policy = make()
    obs = Policy.obs_to_tensors(make_obs(SPEC, 5), "cpu")
    det = policy.act(obs, deterministic=True)
    with torch.no_grad():
        mean = policy.mean_head(policy.trunk(policy.features(obs))).view(5, CHUNK, ACTION_DIM)
    torch.testing.assert_close(det.actions, mean)
    torch.testing.assert_close(det.actions, policy.act(obs, deterministic=True).actions)
    # Sampling differs from the mean.
    assert not torch.allclose(policy.act(obs).actions, det.actions)


def test_gradients_reach_every_parameter():
    policy = make()
    obs = Policy.obs_to_tensors(make_obs(SPEC, 8), "cpu")
    actions = torch.randn(8, CHUNK, ACTION_DIM)
    logprob, value, entropy = policy.evaluate(obs, actions)
    (-logprob.mean() + value.pow(2).mean() - 0.01 * entropy.mean()).backward()
    for name, p in policy.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name
    assert policy.token_embedding.weight.grad[0].abs().sum() == 0  # padding row stays fixed


# ----------------------------------------------------------------------------- GAE


def reference_gae(rewards, values, dones, bootstrap, gamma, lam):
    """Plain Python-loop GAE over each column independently."""
    T, N = rewards.shape
    adv = np.zeros((T, N))
    for n in range(N):
        running = 0.0
        for t in reversed(range(T)):
            if dones[t, n]:
                next_v, running = 0.0, 0.0
            else:
                next_v = bootstrap[n] if t == T - 1 else values[t + 1, n]
            delta = rewards[t, n] + gamma * next_v - values[t, n]
            running = delta + gamma * lam * running
            adv[t, n] = running
    return adv, adv + values


def test_gae_matches_reference_loop():
    rng = np.random.default_rng(1)
    T, N = 9, 4
    rewards = rng.standard_normal((T, N))
    values = rng.standard_normal((T, N))
    dones = np.zeros((T, N), dtype=bool)
    dones[3, 0] = dones[6, 1] = dones[T - 1, 2] = dones[0, 3] = dones[4, 3] = True
    bootstrap = rng.standard_normal(N)
    adv, ret = gae(
        torch.tensor(rewards, dtype=torch.float32),
        torch.tensor(values, dtype=torch.float32),
        torch.tensor(dones),
        torch.tensor(bootstrap, dtype=torch.float32),
        gamma=0.97,
        lam=0.9,
    )
    ref_adv, ref_ret = reference_gae(rewards, values, dones, bootstrap, 0.97, 0.9)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret.numpy(), ref_ret, rtol=1e-5, atol=1e-5)

    # 1-D input works the same as one column.
    adv1, _ = gae(*(torch.tensor(x[:, 1], dtype=torch.float32) for x in (rewards, values)),
                  torch.tensor(dones[:, 1]), torch.tensor(bootstrap[1], dtype=torch.float32), 0.97, 0.9)
    np.testing.assert_allclose(adv1.numpy(), ref_adv[:, 1], rtol=1e-5, atol=1e-5)


def test_the_learners_advantages_take_gamma_and_lambda_from_their_settings():
    """advantages_of (what the learner trains on) with algorithm.gamma 0.9 and gae_lambda
    0.5, by hand on two steps: deltas 0 + 0.9 * 1.0 - 0.2 = 0.7 and 1 + 0.9 * 0.2 - 0.5 =
    0.68, advantages 0.7 and 0.68 + 0.9 * 0.5 * 0.7 = 0.995 (swapped: 0.3 and 0.735)."""
    from dataclasses import replace

    from hpcvla.algorithms.objective import advantages_of
    from hpcvla.config import load_config

    alg = replace(load_config("configs/default.yaml").algorithm, gamma=0.9, gae_lambda=0.5)
    no = np.zeros((2, 1), bool)
    batch = {"reward": np.array([[1.0], [0.0]], np.float32), "done": no, "env_fault": no,
             "value": np.array([[0.5], [0.2]], np.float32),
             "bootstrap_value": np.array([1.0], np.float32)}
    returns = advantages_of(alg, batch, torch.device("cpu")).returns
    np.testing.assert_allclose(returns.numpy()[:, 0], [0.995 + 0.5, 0.7 + 0.2], rtol=1e-6)


def test_gae_truncates_before_a_faulted_step():
    """An env fault at step 2 (done there): that step gets advantage 0 and return V(s_2);
    step 1 bootstraps from V(s_2) instead of seeing the fault as a 0-reward failure."""
    rewards = torch.tensor([1.0, 0.5, 0.0, 2.0])
    values = torch.tensor([0.3, 0.4, 0.9, 0.1])
    dones = torch.tensor([False, False, True, False])
    faults = torch.tensor([False, False, True, False])
    g, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, dones, torch.tensor(0.7), g, lam, faults)
    d1 = 0.5 + g * 0.9 - 0.4  # bootstrap V(s_2), nothing of the faulted step's outcome
    d0 = 1.0 + g * 0.4 - 0.3
    d3 = 2.0 + g * 0.7 - 0.1
    torch.testing.assert_close(adv, torch.tensor([d0 + g * lam * d1, d1, 0.0, d3]))
    assert ret[2].item() == pytest.approx(0.9)
    plain, _ = gae(rewards, values, dones, torch.tensor(0.7), g, lam)  # a 0-reward failure
    assert plain[1].item() == pytest.approx(d1 + g * lam * (0.0 - 0.9))


# ----------------------------------------------------------------------------- losses


def test_decoupled_loss_hand_computed():
    # ratios r = exp(lp - prox): 1.5 (clipped to 1.2), 0.5 (clipped to 0.8), 1.0
    prox = torch.tensor([0.0, 0.0, -1.0])
    lp = prox + torch.log(torch.tensor([1.5, 0.5, 1.0]))
    beh = prox - torch.log(torch.tensor([1.5, 1.0, 0.5]))  # weights exp(prox - beh) = 1.5, 1, 0.5
    adv = torch.tensor([1.0, -2.0, 3.0])
    loss, stats = decoupled_ppo_loss(lp, prox, beh, adv, clip=0.2, max_behaviour_weight=2.0)
    # surrogates: min(1.5, 1.2)=1.2; min(-1.0, -1.6)=-1.6; 3.0
    expected = -(1.5 * 1.2 + 1.0 * -1.6 + 0.5 * 3.0) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    assert stats["behaviour_weight_mean"] == pytest.approx(1.0)
    assert stats["behaviour_weight_max"] == pytest.approx(1.5)
    kl = np.mean([(r - 1) - math.log(r) for r in (1.5, 0.5, 1.0)])
    assert stats["approx_kl"] == pytest.approx(kl, rel=1e-5)


def test_decoupled_equals_ppo_clip_when_on_policy():
    torch.manual_seed(0)
    old = torch.randn(50)
    lp = (old + 0.3 * torch.randn(50)).requires_grad_()
    adv = torch.randn(50)
    loss, stats = decoupled_ppo_loss(lp, old, old, adv, clip=0.2)
    ratio = (lp - old).exp()  # CleanRL formulation
    ref = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    torch.testing.assert_close(loss, ref)
    assert stats["behaviour_weight_mean"] == pytest.approx(1.0)
    g, = torch.autograd.grad(loss, lp)
    g_ref, = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g, g_ref)


def test_behaviour_weight_truncation():
    prox = torch.zeros(2)
    beh = torch.tensor([-3.0, 0.0])  # raw weights e^3 ~ 20 and 1
    lp = prox.clone().requires_grad_()
    adv = torch.tensor([1.0, 1.0])
    loss, stats = decoupled_ppo_loss(lp, prox, beh, adv, max_behaviour_weight=2.0)
    assert stats["behaviour_weight_max"] == pytest.approx(2.0)
    assert stats["behaviour_weight_mean"] == pytest.approx(1.5)
    assert loss.item() == pytest.approx(-(2.0 + 1.0) / 2)
    # the weight is detached: d loss / d lp = -w * A / n
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, torch.tensor([-1.0, -0.5]))
    # a masked step (an env fault) is no part of the weights' statistics, as of the loss
    _, masked = decoupled_ppo_loss(lp, prox, beh, adv, max_behaviour_weight=2.0,
                                   mask=torch.tensor([False, True]))
    assert masked["behaviour_weight_max"] == masked["behaviour_weight_mean"] == 1.0


def test_a_runaway_ratio_under_a_negative_advantage_is_bounded_by_the_dual_clip():
    """PPO-clip leaves r * A unbounded for A < 0: a chunk's log-ratio of 20 gave a loss and
    gradient of 4.9e8, of 100 inf (the step then skipped on every learner). The dual clip
    bounds the surrogate by c * A (no gradient beyond it), and the log-ratio's bound keeps
    even an unclipped loss finite."""
    prox = beh = torch.zeros(3)
    adv = torch.tensor([-1.0, -1.0, 1.0])
    for log_ratio in (5.0, 20.0, 100.0):
        lp = torch.tensor([log_ratio, 0.1, log_ratio]).requires_grad_()
        loss, stats = decoupled_ppo_loss(lp, prox, beh, adv, clip=0.2, dual_clip=3.0)
        # -(3 * -1 + e^0.1 * -1 + 1.2 * 1) / 3: the runaway unit at -3, the positive one clipped
        assert loss.item() == pytest.approx(-(-3.0 - math.exp(0.1) + 1.2) / 3, rel=1e-5)
        (g,) = torch.autograd.grad(loss, lp)
        torch.testing.assert_close(g, torch.tensor([0.0, math.exp(0.1) / 3, 0.0]))
        assert math.isfinite(stats["approx_kl"])
        off, _ = decoupled_ppo_loss(lp, prox, beh, adv, clip=0.2, dual_clip=0.0)
        assert math.isfinite(off.item()) and off.item() > loss.item()
    # below c the dual clip changes nothing: PPO-clip as CleanRL writes it
    lp = torch.tensor([0.5, -0.3, 1.0]).requires_grad_()
    ratio = lp.detach().exp()
    ref = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    assert decoupled_ppo_loss(lp, prox, beh, adv, dual_clip=3.0)[0].item() == \
        pytest.approx(ref.item(), rel=1e-6)


def test_a_masked_unit_adds_nothing_whatever_it_holds():
    """A unit the mask leaves out (an env fault; GRPO's unscored episodes) was multiplied by
    0, and 0 * NaN is NaN: one NaN behaviour log-prob, advantage or runaway ratio there made
    the micro-batch's loss NaN, and every learner skipped the step. Now the loss and its
    gradient are those of the kept units alone."""
    prox = torch.zeros(3)
    lp = torch.tensor([0.1, 0.2, 0.0]).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([True, True, False])
    kept, kept_stats = decoupled_ppo_loss(lp[:2], prox[:2], prox[:2], adv[:2])
    (g_kept,) = torch.autograd.grad(kept, lp)
    nan_lp = torch.tensor([0.1, 0.2, float("nan")]).requires_grad_()  # the forward's NaN
    for beh, bad_adv, current in ((torch.tensor([0.0, 0.0, float("nan")]), adv, lp),
                                  (prox, torch.tensor([1.0, -0.5, float("nan")]), lp),
                                  (prox, torch.tensor([1.0, -0.5, float("inf")]), lp),
                                  (prox, adv, nan_lp)):
        loss, stats = decoupled_ppo_loss(current, prox, beh, bad_adv, mask=mask)
        assert loss.item() == pytest.approx(kept.item(), rel=1e-6)
        (g,) = torch.autograd.grad(loss, current)
        torch.testing.assert_close(g[:2], g_kept[:2])
        assert g[2].item() == 0.0
        assert stats["behaviour_weight_mean"] == kept_stats["behaviour_weight_mean"] == 1.0
    # GAE: a failed step's NaN reward stays in it (the steps before it bootstrap from the
    # value of its observation, V(s_t), which is no output of the failed step)
    values = torch.tensor([0.5, 0.4, 0.3])
    rewards = torch.tensor([0.0, float("nan"), 1.0])
    faults = torch.tensor([False, True, False])
    dones = faults.clone()
    adv, _ = gae(rewards, values, dones, torch.tensor(0.0), 0.9, 0.95, faults)
    assert adv[1].item() == 0.0 and torch.isfinite(adv).all(), adv


def test_the_behaviour_weights_spread_is_reported_before_the_cap():
    """At staleness 0 the behaviour weight is the inference rank's and the learner's numerics
    alone (bf16 kernels), and it grows as the policy's noise shrinks: its min and the spread
    of its log per chunk are logged beside the capped mean and max."""
    prox = torch.zeros(4)
    beh = torch.tensor([-1.0, 1.0, 0.0, 5.0])  # log weights 1, -1, 0, -5
    _, stats = decoupled_ppo_loss(prox.clone(), prox, beh, torch.ones(4),
                                  mask=torch.tensor([True, True, True, False]))
    assert stats["behaviour_weight_min"] == pytest.approx(math.exp(-1))
    assert stats["behaviour_weight_max"] == pytest.approx(2.0)  # e^1, capped at 2
    assert stats["behaviour_log_weight_std"] == pytest.approx(1.0)  # std of 1, -1, 0


def test_advantages_normalised_over_every_learners_batch(monkeypatch):
    """algorithm.advantage_norm=batch: the GAE advantages of every micro-batch of a version,
    every learner's, zero-mean and unit-std together (the statistics summed over the
    learners), a failed env's steps out of them; `micro_batch` (the default) normalises each
    micro-batch alone, which scales a micro-batch of no outcome (the critic's noise) up to
    the size of one with a success."""
    from hpcvla.algorithms.objective import advantages_of
    from hpcvla.config import load_config
    from hpcvla.roles.learner import MicroBatch, batch_normalized
    cfg = load_config(None, ["algorithm.advantage_norm=batch", "pipeline.mode=rollout-async"])
    rng = np.random.default_rng(0)

    def micro(success: bool) -> MicroBatch:  # (T, N) = (4, 3): a noisy critic, no reward ...
        arrays = {"reward": np.zeros((4, 3), np.float32), "done": np.zeros((4, 3), bool),
                  "value": (0.5 + 1e-3 * rng.standard_normal((4, 3))).astype(np.float32),
                  "bootstrap_value": np.full(3, 0.5, np.float32),
                  "env_fault": np.zeros((4, 3), bool)}
        if success:  # ... or one env's success
            arrays["reward"][2, 0], arrays["done"][2, 0] = 1.0, True
        arrays["env_fault"][3, 2] = True  # a failed env's step: in no statistic
        arrays["reward"][3, 2] = 1e6
        return MicroBatch(arrays, advantages_of(cfg.algorithm, arrays, torch.device("cpu")))

    learners = [[([], micro(False)), ([], micro(True))], [([], micro(False))]]
    raw = torch.cat([m.advantages.advantages[~torch.as_tensor(m.arrays["env_fault"])]
                     for lane in learners for _, m in lane])
    moments = [np.array([k.numel(), float(k.double().sum()), float((k.double() ** 2).sum())])
               for k in [torch.cat([m.advantages.advantages[
                   ~torch.as_tensor(m.arrays["env_fault"])] for _, m in lane])
                   for lane in learners]]
    together = sum(moments)
    for lane in learners:  # each learner's sum is every learner's
        batch_normalized(lane, lambda mine: together)
    done = torch.cat([m.advantages.advantages[~torch.as_tensor(m.arrays["env_fault"])]
                      for lane in learners for _, m in lane])
    torch.testing.assert_close(done, (raw - raw.double().mean().float()) / raw.std(),
                               rtol=1e-5, atol=1e-5)
    # a micro-batch of no outcome: its critic's noise stays small beside a success (its
    # spread; centring moves it by the batch's mean), where the default scales it to 1
    quiet = learners[1][0][1].advantages.advantages[:, :2]
    assert quiet.std() < 0.1, quiet
    per_micro = advantages_of(load_config(None).algorithm, learners[1][0][1].arrays,
                              torch.device("cpu")).advantages
    assert per_micro[:, :2].std() > 0.9, per_micro


def test_value_loss_hand_computed():
    value = torch.tensor([1.0, 0.0, 2.0])
    old = torch.tensor([0.5, 0.1, 2.0])
    ret = torch.tensor([2.0, 1.0, 2.5])
    # clipped values: 0.7, 0.0, 2.0 ; squared errors unclipped: 1, 1, .25 ; clipped: 1.69, 1, .25
    expected = 0.5 * (1.69 + 1.0 + 0.25) / 3
    assert value_loss(value, old, ret, clip=0.2).item() == pytest.approx(expected, rel=1e-6)


def test_normalize_advantages():
    adv = torch.tensor([1.0, 2.0, 3.0, 6.0])
    n = normalize_advantages(adv)
    assert n.mean().abs() < 1e-6
    assert n.std().item() == pytest.approx(1.0, rel=1e-5)
    assert normalize_advantages(torch.tensor([5.0])).item() == 0.0
    # statistics over the masked-in elements only: the outlier does not shift them
    masked = normalize_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0, 100.0]),
                                  torch.tensor([True, True, True, True, False]))
    torch.testing.assert_close(masked[:4], n)


def test_value_loss_mask():
    value, ret = torch.tensor([1.0, 0.0, 5.0]), torch.tensor([2.0, 2.0, 0.0])
    mask = torch.tensor([True, True, False])
    assert value_loss(value, value, ret, clip=None, mask=mask).item() == \
        pytest.approx(0.5 * (1.0 + 4.0) / 2)


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_ppo_moves_bandit_mean_toward_target():
    """1-step bandit, reward = -||chunk - target||^2: PPO must pull the mean to the target."""
    torch.manual_seed(0)
    spec = {"image": ((32, 32, 3), "|u1"), "instruction": ((5,), "<i4")}
    policy = DefaultPolicy(spec, ACTION_DIM, CHUNK, VOCAB, hidden=32)
    obs = Policy.obs_to_tensors(make_obs(spec, 32, seed=3), "cpu")
    target = torch.linspace(-0.6, 0.6, CHUNK * ACTION_DIM).view(CHUNK, ACTION_DIM)
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)

    def mean_dist() -> float:
        return (policy.act(obs, deterministic=True).actions - target).pow(2).sum((1, 2)).mean().item()

    start = mean_dist()
    for _ in range(60):  # 60 rollouts x 4 epochs = 240 Adam steps
        out = policy.act(obs)
        reward = -(out.actions - target).pow(2).sum((1, 2))
        adv, ret = gae(reward[None], out.value[None], torch.ones(1, 32, dtype=torch.bool),
                       torch.zeros(32), gamma=0.99, lam=0.95)
        adv, ret = normalize_advantages(adv[0]), ret[0]
        for _ in range(4):
            logprob, value, _ = policy.evaluate(obs, out.actions)
            pg, _ = decoupled_ppo_loss(logprob, out.logprob, out.logprob, adv)
            loss = pg + 0.5 * value_loss(value, out.value, ret)
            opt.zero_grad()
            loss.backward()
            opt.step()
    end = mean_dist()
    assert end < 0.25 * start, (start, end)


@pytest.mark.parametrize("algorithm,config,extra", [
    ("ppo", "configs/default.yaml", []),
    ("grpo", "configs/default.yaml", ["algorithm.group_size=2"]),
    # the policy's recorded fields have domains of their own: random_step's noisy-step time
    # t in (0, 1), which an all-zero faulted row would take to 0/0
    ("ppo", "configs/reach_flow.yaml", ["policy.logprob_mode=random_step",
                                        "policy.flow_noise=sde"])], ids=["ppo", "grpo", "sde"])
def test_a_faulted_step_is_masked_out_of_the_learners_loss(algorithm, config, extra):
    """Through the learner's `policy_loss`: whatever a faulted step recorded (reward, action,
    success; NaN actions and observations) changes nothing, and its gradient stays finite;
    the same step unflagged is trained as a failure."""
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.algorithms.objective import policy_loss
    from hpcvla.factory import build_policy

    cfg = load_config(config, [f"algorithm.name={algorithm}", *extra,
                               "env.max_episode_chunks=8"])
    spec = env_spec(cfg.env)
    policy = build_policy(cfg, spec)
    T, N, rng = 4, 4, np.random.default_rng(0)
    obs, _ = policy_batch(spec, T * N)
    with torch.no_grad():
        out, extras = policy.sample(obs)
    batch = {f"obs.{k}": v.numpy().reshape(T, N, *v.shape[1:])
             for k, v in {**obs, **extras}.items()}
    batch.update(actions=out.actions.numpy().reshape(T, N, *out.actions.shape[1:]),
                 logprob=out.logprob.numpy().reshape(T, N), value=out.value.numpy().reshape(T, N),
                 reward=rng.standard_normal((T, N)).astype(np.float32),
                 done=np.zeros((T, N), bool), env_fault=np.zeros((T, N), bool),
                 success=np.zeros((T, N), bool), bootstrap_value=np.zeros(N, np.float32))
    batch["done"][-1] = True  # every column's episode ends at the last step...
    batch["success"][-1, :2] = [True, False]
    batch["success"][-1, 2:] = [True, False]
    batch["env_fault"][-1, 3] = True  # ...column 3's by an env fault

    batch["logprob"] += 0.1 * rng.standard_normal((T, N)).astype(np.float32)  # stale data

    def loss_of(b):
        policy.zero_grad()
        loss, stats, _ = policy_loss(cfg.algorithm, policy, b)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in policy.parameters()
                   if p.grad is not None)
        return loss.item(), stats

    base, stats = loss_of(batch)
    scrambled = {k: v.copy() for k, v in batch.items()}
    scrambled["reward"][-1, 3] = 100.0
    scrambled["success"][-1, 3] = True
    scrambled["actions"][-1, 3] = -scrambled["actions"][-1, 3]
    assert loss_of(scrambled)[0] == pytest.approx(base, rel=1e-6)
    for name in ("actions", *(f"obs.{k}" for k in spec.obs)):  # what a diverged simulator
        if scrambled[name].dtype.kind == "f":  # or policy gives the env
            scrambled[name][-1, 3] = np.nan
    assert loss_of(scrambled)[0] == pytest.approx(base, rel=1e-6)
    unflagged = dict(batch, env_fault=np.zeros((T, N), bool))
    assert loss_of(unflagged)[0] != pytest.approx(base, rel=1e-3)
    if algorithm == "ppo":
        assert {"explained_variance", "return_std", "value_mean"} <= stats.keys()


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_the_loss_is_its_terms_weighted_by_their_coefficients(algorithm):
    """loss = pg_loss + value_coef * value_loss - entropy_coef * entropy (every shipped config
    leaves the entropy bonus at 0): a sign or a coefficient swapped shows here. PPO's entropy
    term is the chunk entropy's mean over the steps no env fault masked (GRPO's, over its
    kept episodes: test_grpo.py)."""
    from dataclasses import replace

    from hpcvla.algorithms.objective import policy_loss
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy

    grouped = ["algorithm.group_size=2"] if algorithm == "grpo" else []
    cfg = load_config("configs/default.yaml", [f"algorithm.name={algorithm}", *grouped,
                                               "env.max_episode_chunks=8"])
    policy, (T, N), rng = build_policy(cfg, env_spec(cfg.env)), (4, 4), np.random.default_rng(2)
    obs, _ = policy_batch(env_spec(cfg.env), T * N)
    with torch.no_grad():
        out = policy.act(obs)
        entropy = policy.evaluate(obs, out.actions)[2].reshape(T, N, -1).sum(-1)
    batch = {f"obs.{k}": v.numpy().reshape(T, N, *v.shape[1:]) for k, v in obs.items()}
    done = np.zeros((T, N), bool)
    done[-1] = True
    batch.update(actions=out.actions.numpy().reshape(T, N, *out.actions.shape[1:]),
                 logprob=out.logprob.numpy().reshape(T, N), value=out.value.numpy().reshape(T, N),
                 reward=rng.standard_normal((T, N)).astype(np.float32), done=done,
                 env_fault=np.zeros((T, N), bool), success=done & (np.arange(N) % 2 == 0),
                 bootstrap_value=np.zeros(N, np.float32))
    batch["env_fault"][1, 3] = True
    batch["logprob"] += 0.1 * rng.standard_normal((T, N)).astype(np.float32)
    terms = {}
    for entropy_coef, value_coef in [(0.0, 0.5), (0.1, 0.25), (-0.3, 2.0)]:
        alg = replace(cfg.algorithm, entropy_coef=entropy_coef, value_coef=value_coef)
        loss, stats, _ = policy_loss(alg, policy, batch)
        assert loss.item() == pytest.approx(stats["pg_loss"] + value_coef * stats["value_loss"]
                                            - entropy_coef * stats["entropy"], rel=1e-5, abs=1e-6)
        terms[entropy_coef] = (stats["pg_loss"], stats["value_loss"], stats["entropy"])
    assert len(set(terms.values())) == 1  # the coefficients weigh the terms, nothing else
    assert (terms[0.0][1] == 0.0) == (algorithm == "grpo")  # GRPO trains no value head
    if algorithm == "ppo":
        assert terms[0.0][2] == pytest.approx(entropy[~batch["env_fault"]].mean().item(),
                                              rel=1e-5)


def test_the_value_clip_is_around_the_versions_first_values_not_the_recorded_ones():
    """algorithm.value_clip keeps the critic within the clip of its values when the version's
    training began (its first pass: objective.Proximal), as CleanRL's at its update's start.
    The values the behaviour policy recorded are versions old under asynchrony: a critic that
    had moved toward the returns by more than the clip got no gradient in the first epoch."""
    from dataclasses import replace

    from hpcvla.algorithms.objective import Advantages, Proximal, policy_loss
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy

    cfg = load_config("configs/default.yaml", ["algorithm.value_clip=true"])
    policy, (T, N) = build_policy(cfg, env_spec(cfg.env)), (2, 3)
    obs, _ = policy_batch(env_spec(cfg.env), T * N)
    with torch.no_grad():
        out = policy.act(obs)
    value = out.value.reshape(T, N)
    batch = {f"obs.{k}": v.numpy().reshape(T, N, *v.shape[1:]) for k, v in obs.items()}
    batch.update(actions=out.actions.numpy().reshape(T, N, *out.actions.shape[1:]),
                 logprob=out.logprob.numpy().reshape(T, N),
                 value=(value - 1.0).numpy(),  # recorded by a critic 1.0 below today's
                 env_fault=np.zeros((T, N), bool))
    returns = value + 0.1  # today's critic is 0.1 short of the returns; the clip is 0.2
    advantages = Advantages(advantages=torch.zeros(T, N), returns=returns)
    alg = replace(cfg.algorithm, entropy_coef=0.0)
    loss, stats, proximal = policy_loss(alg, policy, batch, advantages)
    torch.testing.assert_close(proximal.value, value, atol=1e-5, rtol=0)
    assert stats["value_loss"] == pytest.approx(0.5 * 0.1 ** 2, rel=1e-3)  # not (1 - 0.2 - 0.1)
    policy.zero_grad()
    loss.backward()
    head = [p.grad for name, p in policy.named_parameters() if name.startswith("value")]
    assert head and all(g is not None for g in head) and sum(g.abs().sum() for g in head) > 0
    # a later epoch clips around that first pass: a critic moved 0.5 past it is held there
    moved = Proximal(proximal.logprob, proximal.value - 0.5)
    _, later, _ = policy_loss(alg, policy, batch, advantages, moved)
    assert later["value_loss"] == pytest.approx(0.5 * (0.5 - 0.2 + 0.1) ** 2, rel=1e-3)


@pytest.mark.parametrize("first_value_only", [False, True], ids=["ppo", "critic-warm-up"])
def test_every_pass_of_a_version_clips_around_its_first(first_value_only):
    """The learner keeps a micro-batch's first pass (roles/learner.train_micro_batch: a PPO
    pass, or a value-only one in the critic's warm-up) and clips every later pass of the
    version around it, its log-probs and values, though the weights have moved."""
    from hpcvla.algorithms.objective import advantages_of
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.metrics.timeline import Timeline
    from hpcvla.roles.learner import MicroBatch, train_micro_batch

    class OneLearner:  # torch's AdamW, a step per pass: the engine interface, one process
        def __init__(self, policy):
            self.module, self.device = policy, torch.device("cpu")
            self.optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)

        def __call__(self, obs, actions):
            return self.module(obs, actions)

        def backward(self, loss):
            loss.backward()

        def step(self):
            self.optimizer.step()
            self.optimizer.zero_grad()

        def is_gradient_accumulation_boundary(self):
            return True

        def step_stats(self, _):
            return {}

    cfg = load_config("configs/default.yaml", ["algorithm.value_clip=true"])
    policy, (T, N) = build_policy(cfg, env_spec(cfg.env)), (2, 3)
    obs, _ = policy_batch(env_spec(cfg.env), T * N)
    with torch.no_grad():
        out = policy.act(obs)
        first = policy.evaluate(obs, out.actions)
    arrays = {f"obs.{k}": v.numpy().reshape(T, N, *v.shape[1:]) for k, v in obs.items()}
    arrays.update(actions=out.actions.numpy().reshape(T, N, *out.actions.shape[1:]),
                  logprob=out.logprob.numpy().reshape(T, N), value=np.zeros((T, N), np.float32),
                  reward=np.ones((T, N), np.float32), done=np.ones((T, N), bool),
                  env_fault=np.zeros((T, N), bool), bootstrap_value=np.zeros(N, np.float32))
    micro = MicroBatch(arrays, advantages_of(cfg.algorithm, arrays, torch.device("cpu")))
    engine, timeline = OneLearner(policy), Timeline(None, 0, "learner")
    train_micro_batch(cfg, engine, micro, timeline, value_only=first_value_only)
    kept = micro.proximal
    torch.testing.assert_close(kept.value, first[1].reshape(T, N))  # not the recorded 0
    torch.testing.assert_close(kept.logprob, first[0].reshape(T, N))
    for value_only in (False, True):
        train_micro_batch(cfg, engine, micro, timeline, value_only=value_only)
        assert micro.proximal is kept
    with torch.no_grad():  # the weights moved: a later pass's own values are not the anchor
        assert not torch.allclose(policy.evaluate(obs, out.actions)[1], first[1])


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_critic_passes_move_the_critic_alone(fused):
    """The learner's optimizer groups: the critic (`value_*`) at algorithm.critic_lr; inside
    `actor_scaled(engine, 0)` (the value-only passes) an optimizer step moves the critic and
    leaves every actor weight and the actor's Adam state (moments, step count) as they were,
    though the value loss reaches the actor's parameters; the rates come back after it."""
    from types import SimpleNamespace

    from hpcvla.config import load_config
    from hpcvla.engines import param_groups
    from hpcvla.roles.learner import actor_scaled

    cfg = load_config("configs/default.yaml", ["algorithm.critic_lr=0.01"])
    policy = make_policy("default", SPEC, 7, 4, 10)
    groups = param_groups(policy, cfg.algorithm)
    assert [(g["name"], g["lr"]) for g in groups] == [("actor", 3e-4), ("critic", 0.01)]
    critic = {id(p) for p in groups[1]["params"]}
    assert critic == {id(p) for n, p in policy.named_parameters() if n.startswith("value_")}
    engine = SimpleNamespace(optimizer=torch.optim.AdamW(groups, fused=fused))
    obs = {"image": torch.randint(0, 255, (8, 32, 32, 3), dtype=torch.uint8),
           "instruction": torch.ones(8, 5, dtype=torch.int32), "state": torch.randn(8, 7)}

    def step(loss_of):
        _, value, entropy = policy.evaluate(obs, torch.zeros(8, 4, 7))
        engine.optimizer.zero_grad()
        loss_of(value, entropy).backward()
        engine.optimizer.step()

    step(lambda value, entropy: value.square().mean() - entropy.mean())  # the actor's Adam warm
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    state = engine.optimizer.state
    adam = {n: {k: v.clone() for k, v in state[p].items()} for n, p in policy.named_parameters()}
    for _ in range(2):
        with actor_scaled(engine, 0.0):
            step(lambda value, entropy: ((value - 1.0) ** 2).mean() - entropy.mean())
        assert [g["lr"] for g in engine.optimizer.param_groups] == [3e-4, 0.01]  # restored
        assert [len(g["params"]) for g in engine.optimizer.param_groups] == \
            [len(g["params"]) for g in groups]
    reached = [n for n, p in policy.named_parameters() if id(p) not in critic and
               p.grad is not None and p.grad.abs().sum() > 0]
    assert reached  # the value loss's gradient reached the shared encoders
    for name, p in policy.named_parameters():
        moved = not torch.equal(p.detach(), before[name])
        assert moved == (id(p) in critic), name
        kept = all(torch.equal(v, state[p][k]) for k, v in adam[name].items())
        assert kept != (id(p) in critic), name


def test_the_actors_rate_per_version_warms_up_the_critic_then_ramps():
    """actor_lr_factor: 0 through algorithm.critic_warmup_versions, then lr_warmup_versions'
    linear ramp; `actor_scaled` steps the actor by that share of its unscaled Adam step (the
    critic by all of its own) and restores the rates."""
    from types import SimpleNamespace

    from hpcvla.config import load_config
    from hpcvla.engines import param_groups
    from hpcvla.roles.learner import actor_lr_factor, actor_scaled

    def alg(critic, ramp):
        return SimpleNamespace(critic_warmup_versions=critic, lr_warmup_versions=ramp)
    assert [actor_lr_factor(alg(0, 0), v) for v in range(3)] == [1, 1, 1]
    assert [actor_lr_factor(alg(2, 3), v) for v in range(7)] == [0, 0, .25, .5, .75, 1, 1]
    cfg = load_config("configs/default.yaml")
    obs = {"image": torch.randint(0, 255, (8, 32, 32, 3), dtype=torch.uint8),
           "instruction": torch.ones(8, 5, dtype=torch.int32), "state": torch.randn(8, 7)}
    moves = []
    for factor in (1.0, 0.25):
        torch.manual_seed(0)
        policy = make_policy("default", SPEC, 7, 4, 10)
        optimizer = torch.optim.AdamW(param_groups(policy, cfg.algorithm))
        engine = SimpleNamespace(optimizer=optimizer)
        before = {n: p.detach().clone() for n, p in policy.named_parameters()}
        logprob, value, _ = policy.evaluate(obs, torch.zeros(8, 4, 7))
        (value.square().mean() - logprob.mean()).backward()
        with actor_scaled(engine, factor):
            engine.optimizer.step()
        assert [g["lr"] for g in engine.optimizer.param_groups] == \
            [cfg.algorithm.lr, cfg.algorithm.critic_lr]
        moves.append({n: p.detach() - before[n] for n, p in policy.named_parameters()})
    for name, full in moves[0].items():
        share = 1.0 if name.startswith("value_") else 0.25
        torch.testing.assert_close(moves[1][name], share * full, rtol=1e-2, atol=5e-7)


@pytest.mark.mpi
@pytest.mark.parametrize("engine", [["learner.zero_stage=1"], ["learner.zero_stage=3"],
                                    ["learner.backend=horovod"]],
                         ids=["zero1", "zero3", "horovod"])
def test_critic_warmup_versions_move_the_critic_alone(engine):
    """algorithm.critic_warmup_versions on two learners (DeepSpeed ZeRO-1, the OFT recipe's
    stage, ZeRO-3, which steps sub-groups, or Horovod): through the learner's own `learn`,
    the warm-up versions change only `value_*` tensors and leave the actor's Adam state
    unspent (with weight decay on: the decay spares it too), the next one moves the actor
    too, and the learners stay identical; the optimizer has the algorithm's AdamW settings."""
    from helpers import MPI_DIR, hpcvla

    out = hpcvla("launch", "-n", 2, "--timeout", 240, "--", MPI_DIR / "critic_warmup.py",
                 "configs/colocated.yaml", "algorithm.critic_warmup_versions=2", *engine,
                 "learner.epochs=2", "algorithm.critic_epochs=1", "algorithm.adam_beta2=0.95",
                 "algorithm.adam_eps=1e-8", "algorithm.weight_decay=0.01",
                 "env.image_size=32", "learner.micro_batch=8", "learner.micro_batches=1",
                 "rollout.segment_len=4", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "critic warm-up: 2 versions moved the critic alone, version 2 moved" in out.stdout


def test_advantages_are_normalized_over_the_steps_a_fault_did_not_end():
    """objective.advantages_of: PPO's advantages are centred and scaled over the kept steps
    alone: a faulted step's zero entering the mean and the spread would shift and shrink
    every other step's."""
    from hpcvla.algorithms.objective import advantages_of
    from hpcvla.config import load_config
    alg = load_config("configs/default.yaml").algorithm
    fault = np.zeros((3, 1), bool)
    fault[2, 0] = True  # the env failed at the last step, which ends the column's episode
    batch = {"reward": np.array([[1.0], [0.0], [5.0]], np.float32), "done": fault.copy(),
             "env_fault": fault, "value": np.zeros((3, 1), np.float32),
             "bootstrap_value": np.zeros(1, np.float32)}
    kept = advantages_of(alg, batch, torch.device("cpu")).advantages[:2, 0]
    assert float(kept.mean()) == pytest.approx(0, abs=1e-5)
    assert float(kept.std()) == pytest.approx(1, abs=1e-4), kept


@pytest.mark.parametrize("algorithm,granularity", [("ppo", "action"), ("grpo", "token")])
def test_actions_a_chunk_never_ran_are_out_of_the_finer_units_loss(algorithm, granularity):
    """A chunk stopped by its episode's end (a success after its first action:
    chunk_steps 1): at action or token granularity the actions after it are no outcome of
    the policy, and what they hold changes neither the loss nor its gradient (fresh data,
    each chunk's behaviour log-prob its own); the same actions run (chunk_steps H) do."""
    from hpcvla.algorithms.objective import policy_loss
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy

    cfg = load_config("configs/reach_flow.yaml", [
        f"algorithm.name={algorithm}", f"policy.logprob_granularity={granularity}",
        "env.max_episode_chunks=8"])
    spec = env_spec(cfg.env)
    policy = build_policy(cfg, spec)
    T, N, H = 4, 4, cfg.env.chunk_len
    obs, _ = policy_batch(spec, T * N)
    with torch.no_grad():
        out, extras = policy.sample(obs)
    done, success = np.zeros((T, N), bool), np.zeros((T, N), bool)
    done[-1], success[-1] = True, [True, False, True, False]  # two groups of 2, not degenerate
    batch = {f"obs.{k}": v.numpy().reshape(T, N, *v.shape[1:])
             for k, v in {**obs, **extras}.items()}
    batch.update(actions=out.actions.numpy().reshape(T, N, H, -1),
                 value=out.value.numpy().reshape(T, N), reward=success.astype(np.float32),
                 done=done, success=success, env_fault=np.zeros((T, N), bool),
                 bootstrap_value=np.zeros(N, np.float32), chunk_steps=np.full((T, N), H))
    batch["chunk_steps"][-1, 0] = 1

    def loss_and_grad(b):
        with torch.no_grad():  # fresh data: the behaviour policy is the learner's
            flat = {k[4:]: torch.as_tensor(v).reshape(T * N, *v.shape[2:])
                    for k, v in b.items() if k.startswith("obs.")}
            scored = policy.evaluate(flat, torch.as_tensor(b["actions"]).reshape(T * N, H, -1))
            b = dict(b, logprob=scored[0].reshape(T, N, -1).sum(-1).numpy())
        policy.zero_grad()
        loss = policy_loss(cfg.algorithm, policy, b)[0]
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in policy.parameters()
                                       if p.grad is not None])

    base, base_grad = loss_and_grad(batch)
    moved = dict(batch, actions=batch["actions"].copy())
    moved["actions"][-1, 0, 1:] += 0.5  # the actions its success left unrun
    loss, grad = loss_and_grad(moved)
    assert loss == pytest.approx(base, rel=1e-5)
    torch.testing.assert_close(grad, base_grad, rtol=1e-4, atol=1e-6)
    ran = dict(moved, chunk_steps=np.full((T, N), H))
    assert not torch.allclose(loss_and_grad(ran)[1], loss_and_grad(dict(batch, chunk_steps=ran[
        "chunk_steps"]))[1], rtol=1e-3)
