"""PPO building blocks at action-chunk level: GAE, the decoupled clipped objective, value loss.

Everything here is a pure function of tensors so the learner can compose it freely and tests
can check it against hand computations. One "step" is one action chunk: log-probabilities and
values are per chunk, rewards are the reward accumulated over the chunk.

The policy loss is the *decoupled* PPO objective (Hilton et al., "Batch size-invariance for
policy optimization"; used by AReaL for asynchronous RL). With stale data three policies are
involved:

* behaviour: the (possibly old) policy that generated the data,
* proximal: the policy the update should stay close to (e.g. the learner's weights at the
  start of this update),
* current: the policy being optimised.

The trust region is taken around the proximal policy (ratio current/proximal, clipped), and
the off-policyness between proximal and behaviour is corrected by a detached, truncated
importance weight. When proximal == behaviour the weight is 1 and this is exactly PPO-clip.

Log-probs may be finer than chunks (algorithms/granularity.py): the ratio is then taken per
unit (action or token) while the recorded behaviour log-prob and the advantage stay per chunk.
"""

from __future__ import annotations

import torch

from hpcvla.algorithms.granularity import expand_like, sum_to


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    bootstrap_value: torch.Tensor,
    gamma: float,
    lam: float,
    faults: torch.Tensor | None = None,
    truncation_value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one segment: returns (advantages, returns).

    Args:
        rewards, values, dones: (T, N) or (T,); ``dones[t]`` true means the episode ended at
            step t, so nothing is bootstrapped across it (but its truncation_value).
        bootstrap_value: (N,) or scalar, V of the observation after the last step (ignored
            where ``dones[-1]`` is true).
        faults: like dones, or None; ``faults[t]``: the env failed in step t (it must be done
            too), so its outcome says nothing of the policy. The step gets advantage 0 and
            return V(s_t), and the steps before it bootstrap from V(s_t): the episode is
            truncated *before* the failed step, not failed.
        truncation_value: like rewards, or None; V of the observation an episode the
            horizon ended at step t reached (0 elsewhere): that step's target is its reward
            plus gamma times it, the episode's continuation it stands for (a time limit is
            no outcome: partial-episode bootstrapping, Pardo et al. 2018).
    No gradients flow through the result (targets are constants).
    """
    rewards = rewards.detach().float()
    if truncation_value is not None:
        rewards = rewards + gamma * truncation_value.detach().float()
    values = values.detach().float()
    valid = torch.ones_like(values) if faults is None else 1.0 - faults.detach().float()
    not_done = 1.0 - dones.detach().float()
    next_value = torch.as_tensor(bootstrap_value, device=values.device).detach().float().expand_as(values[0])
    advantages = torch.zeros_like(values)
    last = torch.zeros_like(values[0])
    for t in reversed(range(values.shape[0])):
        delta = rewards[t] + gamma * next_value * not_done[t] - values[t]
        # (where, not a product: a failed step's NaN stops here)
        last = torch.where(valid[t] > 0, delta + gamma * lam * not_done[t] * last, 0.0)
        advantages[t] = last
        next_value = values[t]
    return advantages, advantages + values


# The log-ratio's bound before exp: the ratio stays finite (no inf, whose gradient is 0 * inf
# = NaN where a mask or a clip selects against it); beyond it both clips give no gradient.
MAX_LOG_RATIO = 20.0


def decoupled_ppo_loss(
    logprob: torch.Tensor,
    proximal_logprob: torch.Tensor,
    behaviour_logprob: torch.Tensor,
    advantages: torch.Tensor,
    clip: float = 0.2,
    max_behaviour_weight: float = 2.0,
    mask: torch.Tensor | None = None,
    dual_clip: float = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO-clip loss (to minimise) and diagnostics.

    loss = -mean(w * min(r * A, clip(r, 1 - clip, 1 + clip) * A)) with
    r = exp(logprob - proximal_logprob) and w = min(exp(proximal - behaviour), max_behaviour_weight)
    (detached). Truncating w bounds the variance that very stale samples can inject.
    `dual_clip` c > 1 (0: off) bounds a negative advantage's surrogate below by c * A (dual-clip
    PPO, Ye et al. 2020): PPO-clip leaves r * A unbounded there, and one unit whose ratio ran
    away (a log-prob summed over a chunk's many dimensions) would set the whole step.

    `logprob` and `proximal_logprob` share one shape, (B,) per chunk or finer, (B, *units).
    `behaviour_logprob` and `advantages` may be per chunk, (B,), when those are finer: every
    unit then uses its chunk's advantage, and w is the chunk's weight, exp(sum of the
    proximal unit log-probs - behaviour), the exact correction for the chunk the behaviour
    policy sampled. `mask` (B,) or like `logprob`, 0/1 or bool: the mean runs over the
    included units only (GRPO drops degenerate groups this way); non-negative weights make
    it a weighted mean (GRPO's mean over episodes weighs a step by 1 / its episode's length).
    A unit left out contributes nothing to the loss, whatever it holds (a NaN or inf
    included), nor to its gradient through the recorded advantages and log-probs (a NaN the
    forward computed there reaches the gradient through the model: objective.policy_loss
    scores a failed env's action as zeros).
    """
    proximal_logprob = proximal_logprob.detach()
    behaviour_logprob = behaviour_logprob.detach()
    include = torch.ones_like(logprob) if mask is None else \
        expand_like(mask.to(logprob.dtype), logprob)
    kept = include > 0
    count = include.sum().clamp(min=1.0)
    # a left-out unit's advantage and weight are 0 (where, not a product: 0 * NaN is NaN, in
    # the loss and in its gradient)
    advantages = torch.where(kept, expand_like(advantages.detach(), logprob), 0.0)
    log_ratio = torch.where(kept, logprob - proximal_logprob, 0.0) \
        .clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    surrogate = torch.min(ratio * advantages, ratio.clamp(1.0 - clip, 1.0 + clip) * advantages)
    if dual_clip:
        surrogate = torch.where(advantages < 0, torch.max(surrogate, dual_clip * advantages),
                                surrogate)
    log_weight = sum_to(proximal_logprob, behaviour_logprob.ndim) - behaviour_logprob
    weight = torch.where(kept, expand_like(log_weight.exp().clamp(max=max_behaviour_weight),
                                           logprob), 0.0)
    loss = -torch.where(kept, include * weight * surrogate, 0.0).sum() / count

    with torch.no_grad():
        def mean(x: torch.Tensor) -> float:  # over the units the loss counts
            return torch.where(kept, include * x, 0.0).sum().item() / count.item()

        # (per chunk: a chunk kept if any of its units is)
        chunks = kept if kept.shape == log_weight.shape else \
            kept.flatten(log_weight.ndim).any(-1)
        chunk_kept = log_weight[chunks]
        stats = {
            "clip_fraction": mean(((ratio - 1.0).abs() > clip).to(ratio.dtype)),
            # k3 estimator of KL(proximal || current), always >= 0; unbiased where the
            # behaviour policy is the proximal one (staleness 0), else on the behaviour's
            # samples, unweighted: a diagnostic.
            "approx_kl": mean((ratio - 1.0) - log_ratio),
            # over the units the loss counts (env faults, GRPO's unscored episodes out)
            "behaviour_weight_mean": mean(weight),
            "behaviour_weight_max": weight[kept].max().item() if kept.any() else 1.0,
            "behaviour_weight_min": weight[kept].min().item() if kept.any() else 1.0,
            # the spread of log(proximal / behaviour) per chunk, before the cap: at staleness
            # 0 the inference rank's and the learner's numerics alone (bf16 kernels), which
            # grows as the policy's noise shrinks (1 / sigma)
            "behaviour_log_weight_std": chunk_kept.std().item() if chunk_kept.numel() > 1
            else 0.0,
        }
    return loss, stats


def value_loss(value: torch.Tensor, old_value: torch.Tensor, returns: torch.Tensor,
               clip: float | None = 0.2, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Clipped value loss (CleanRL): 0.5 * mean(max((v - R)^2, (v_clipped - R)^2)).

    v_clipped keeps the new value within ``clip`` of ``old_value``: the learner's at the start
    of the version's training (objective.Proximal), as CleanRL's at its update's start.
    ``clip=None`` turns clipping off: 0.5 * mean((v - R)^2). `mask`: the steps to include.
    """
    old_value = old_value.detach()
    returns = returns.detach()
    error = (value - returns) ** 2
    if clip is not None:
        error = torch.max(error, (old_value + (value - old_value).clamp(-clip, clip)
                                  - returns) ** 2)
    return 0.5 * masked_mean(error, mask)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of `x` over the elements where `mask` (like x, or a leading part of it) holds."""
    if mask is None:
        return x.mean()
    include = expand_like(mask.to(x.dtype), x)
    return (x * include).sum() / include.sum().clamp(min=1.0)


def normalize_advantages(adv: torch.Tensor, mask: torch.Tensor | None = None,
                         eps: float = 1e-8) -> torch.Tensor:
    """Zero-mean, unit-std advantages (per minibatch), statistics over the `mask`ed-in
    elements only. A single element is only centred."""
    kept = adv if mask is None else adv[mask.bool()]
    if kept.numel() < 2:  # std of one sample is undefined
        return adv - (kept.mean() if kept.numel() else 0.0)
    return (adv - kept.mean()) / (kept.std() + eps)
