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
"""

from __future__ import annotations

import torch


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    bootstrap_value: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one segment: returns (advantages, returns).

    Args:
        rewards, values, dones: (T, N) or (T,); ``dones[t]`` true means the episode ended at
            step t, so nothing is bootstrapped across it.
        bootstrap_value: (N,) or scalar, V of the observation after the last step (ignored
            where ``dones[-1]`` is true).
    No gradients flow through the result (targets are constants).
    """
    rewards = rewards.detach().float()
    values = values.detach().float()
    not_done = 1.0 - dones.detach().float()
    next_value = torch.as_tensor(bootstrap_value, device=values.device).detach().float().expand_as(values[0])
    advantages = torch.zeros_like(values)
    last = torch.zeros_like(values[0])
    for t in reversed(range(values.shape[0])):
        delta = rewards[t] + gamma * next_value * not_done[t] - values[t]
        last = delta + gamma * lam * not_done[t] * last
        advantages[t] = last
        next_value = values[t]
    return advantages, advantages + values


def decoupled_ppo_loss(
    logprob: torch.Tensor,
    proximal_logprob: torch.Tensor,
    behaviour_logprob: torch.Tensor,
    advantages: torch.Tensor,
    clip: float = 0.2,
    max_behaviour_weight: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO-clip loss (to minimise) and diagnostics.

    loss = -mean(w * min(r * A, clip(r, 1 - clip, 1 + clip) * A)) with
    r = exp(logprob - proximal_logprob) and w = min(exp(proximal - behaviour), max_behaviour_weight)
    (detached). Truncating w bounds the variance that very stale samples can inject.
    """
    proximal_logprob = proximal_logprob.detach()
    advantages = advantages.detach()
    log_ratio = logprob - proximal_logprob
    ratio = log_ratio.exp()
    surrogate = torch.min(ratio * advantages, ratio.clamp(1.0 - clip, 1.0 + clip) * advantages)
    weight = (proximal_logprob - behaviour_logprob.detach()).exp().clamp(max=max_behaviour_weight)
    loss = -(weight * surrogate).mean()

    with torch.no_grad():
        stats = {
            "clip_fraction": ((ratio - 1.0).abs() > clip).float().mean().item(),
            # k3 estimator of KL(proximal || current): unbiased and always >= 0.
            "approx_kl": ((ratio - 1.0) - log_ratio).mean().item(),
            "behaviour_weight_mean": weight.mean().item(),
            "behaviour_weight_max": weight.max().item(),
        }
    return loss, stats


def value_loss(value: torch.Tensor, old_value: torch.Tensor, returns: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    """Clipped value loss (CleanRL): 0.5 * mean(max((v - R)^2, (v_clipped - R)^2)).

    v_clipped keeps the new value within ``clip`` of the value recorded with the data.
    """
    old_value = old_value.detach()
    returns = returns.detach()
    unclipped = (value - returns) ** 2
    clipped = (old_value + (value - old_value).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.max(unclipped, clipped).mean()


def normalize_advantages(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero-mean, unit-std advantages (per minibatch). A single element is only centred."""
    if adv.numel() < 2:  # std of one sample is undefined
        return adv - adv.mean()
    return (adv - adv.mean()) / (adv.std() + eps)
