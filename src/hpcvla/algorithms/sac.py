"""Soft actor-critic (Haarnoja et al. 2018, with twin critics and automatic temperature) at
action-chunk level: the soft Bellman target, the critic, actor and temperature losses, and the
Polyak update of the target critics.

As in ppo.py, one "step" is one action chunk: the critics score (observation, chunk) pairs,
the log-probability is the chunk's (finer log-probs, granularity.py, are summed to it), and
the reward is the chunk's, summed over its low-level steps by the simulator (envs/base.py's
StepResult.reward). The discount is per chunk, as the config's `algorithm.gamma` and ppo.gae
take it: a one-chunk transition bootstraps with `discount = gamma`; `gamma ** k` for a
transition of k chunks, or a per-transition tensor where they differ.

Pure functions of tensors, like the rest of algorithms/: the learner owns the networks and the
optimisers, and each loss here is what one of its optimisers minimises.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hpcvla.algorithms.granularity import sum_to


def soft_target(reward: torch.Tensor, terminal: torch.Tensor, next_q1: torch.Tensor,
                next_q2: torch.Tensor, next_logprob: torch.Tensor,
                alpha: float | torch.Tensor, discount: float | torch.Tensor) -> torch.Tensor:
    """The soft Bellman target of twin critics with target networks (constant, no gradient):

        y = r + discount * (1 - terminal) * (min(q1', q2') - alpha * logp')

    Args:
        reward, terminal: (B,); `terminal` true where the task ended the episode (success): no
            bootstrap. A step a horizon or a fault cut never comes here (transitions.py drops
            it: the episode's last observation is not recorded), so `terminal` false means
            bootstrap.
        next_q1, next_q2: (B,) the target critics at (next observation, a' ~ policy).
        next_logprob: (B,) or finer (B, *units), log pi(a' | next observation), summed to the
            chunk.
        alpha: the entropy temperature (a tensor is detached).
        discount: float or (B,): the bootstrap's discount, gamma per chunk (module docstring).
    Taking the smaller critic counters the overestimation a max over actions breeds (TD3).
    """
    with torch.no_grad():
        next_logprob = sum_to(next_logprob.detach(), next_q1.ndim)
        soft_value = torch.minimum(next_q1, next_q2) - _constant(alpha) * next_logprob
        not_terminal = 1.0 - terminal.to(soft_value.dtype)
        return reward.to(soft_value.dtype) + _constant(discount) * not_terminal * soft_value


def critic_loss(q1: torch.Tensor, q2: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Twin-critic loss: MSE(q1, y) + MSE(q2, y), each the plain mean of squared errors (no
    0.5 factor, as CleanRL's and RLPD's SAC; ppo.value_loss's 0.5 is a different convention).
    The target is detached: gradients reach only the online critics, never through y."""
    target = target.detach()
    return ((q1 - target) ** 2).mean() + ((q2 - target) ** 2).mean()


def actor_loss(logprob: torch.Tensor, q1: torch.Tensor, q2: torch.Tensor,
               alpha: float | torch.Tensor) -> torch.Tensor:
    """Actor loss: mean(alpha * logp - min(q1, q2)), with a ~ pi reparameterised so the
    gradient flows through the critics' inputs. `logprob` (B,) or finer, summed to the chunk.
    alpha is a constant here: the temperature has its own loss (temperature_loss)."""
    logprob = sum_to(logprob, q1.ndim)
    return (_constant(alpha) * logprob - torch.minimum(q1, q2)).mean()


def temperature_loss(log_alpha: torch.Tensor, logprob: torch.Tensor,
                     target_entropy: float) -> torch.Tensor:
    """Automatic temperature: -mean(log_alpha * (logp + target_entropy)), logp detached.

    Its gradient on log_alpha is -mean(logp + target_entropy) = entropy - target_entropy: a
    descent step raises alpha when the policy's entropy (-logp) is below the target and
    lowers it above. Optimising log_alpha keeps alpha = exp(log_alpha) positive."""
    logprob = sum_to(logprob.detach(), 1)
    return -(log_alpha * (logprob + target_entropy)).mean()


def target_entropy(action_dim: int, chunk_len: int = 1, per_dim: float = -1.0) -> float:
    """The target entropy of a chunk of `chunk_len` actions of `action_dim` dims: `per_dim`
    times its dimensions; SAC's convention (-1) gives -(chunk_len * action_dim). The chunk's
    log-prob is a sum over all its dims, so its target grows with every one of them."""
    if action_dim <= 0 or chunk_len <= 0:
        raise ValueError(f"action_dim {action_dim} and chunk_len {chunk_len}: expected > 0")
    return float(per_dim * chunk_len * action_dim)


def polyak_update(target: Iterable[torch.Tensor], online: Iterable[torch.Tensor],
                  tau: float) -> None:
    """In place, target = (1 - tau) * target + tau * online, pairwise over the two iterables
    (e.g. `target_critic.parameters()`, `critic.parameters()`, in the same order). A slowly
    moving target keeps the Bellman target from chasing the critic it trains."""
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau {tau}: expected within [0, 1]")
    pairs = list(zip(target, online, strict=True))  # checked whole before any is moved
    for n, (t, o) in enumerate(pairs):
        if t.shape != o.shape:
            raise ValueError(f"tensor {n}: target shape {tuple(t.shape)} != online shape "
                             f"{tuple(o.shape)}")
    with torch.no_grad():
        for t, o in pairs:
            t.lerp_(o.to(t.dtype), tau)  # t + tau * (o - t)


def _constant(x: float | torch.Tensor) -> float | torch.Tensor:
    """A coefficient that takes no gradient: a tensor detached, a number as it is."""
    return x.detach() if isinstance(x, torch.Tensor) else x


__all__ = ["soft_target", "critic_loss", "actor_loss", "temperature_loss",
           "target_entropy", "polyak_update"]
