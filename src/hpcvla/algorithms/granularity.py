"""Granularity of log-probs and rewards: chunk, action or token.

A policy emits an action chunk of H actions of D dims. Its log-prob factorises over the H x D
*tokens* (one per action dim: a bin for the token policy, a Gaussian coordinate for the flow
policy), so it can be scored at three granularities:

* chunk:  one log-prob per chunk, the sum over all tokens         (B,)
* action: one per action of the chunk, the sum over its D tokens  (B, H)
* token:  one per token                                           (B, H, D)

PPO at a finer granularity takes the ratio (and its clip) per unit and averages the clipped
surrogate over units, each unit using the advantage of its chunk (`expand_like`); the
behaviour policy's log-prob that rollouts record stays per chunk (ppo.decoupled_ppo_loss
explains how the staleness weight then uses it). Rewards, values and advantages stay per
chunk: the simulators reward chunks, and a chunk's units share one observation. A finer unit
the env never ran (its episode ended inside the chunk) is left out (executed_units).
"""

from __future__ import annotations

import torch

from hpcvla.config.policy import GRANULARITIES



def reduce_units(terms: torch.Tensor, granularity: str) -> torch.Tensor:
    """Per-token terms (B, H, D) -> (B,) chunk, (B, H) action or (B, H, D) token sums."""
    if granularity == "chunk":
        return terms.sum(dim=(-2, -1))
    if granularity == "action":
        return terms.sum(dim=-1)
    if granularity == "token":
        return terms
    raise ValueError(f"granularity {granularity!r}: expected one of {', '.join(GRANULARITIES)}")


def expand_like(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Broadcast `x`, whose shape is a leading part of target's, over target's extra
    (unit) dims: a per-chunk advantage applied to each of the chunk's units."""
    if target.shape[:x.ndim] != x.shape:
        raise ValueError(f"shape {tuple(x.shape)} is not a leading part of "
                         f"{tuple(target.shape)}")
    return x.reshape(*x.shape, *([1] * (target.ndim - x.ndim))).expand_as(target)


def executed_units(chunk_steps: torch.Tensor, logprob: torch.Tensor) -> torch.Tensor:
    """Which units of `logprob`, (T, N, H) actions or (T, N, H, D) tokens, the env ran: the
    actions h < chunk_steps (T, N), the chunk's steps its episode ran (a success or a time
    limit stops a chunk early). The others are no outcome of the policy: the finer
    granularities leave them out of the policy gradient. Per chunk, (T, N), a unit is the
    chunk sampled whole, and its weight stays the exact ratio of what was sampled."""
    actions = torch.arange(logprob.shape[chunk_steps.ndim], device=logprob.device)
    return expand_like(actions < chunk_steps.to(logprob.device).unsqueeze(-1), logprob)


def sum_to(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """Sum the trailing dims of `x` away until it has `ndim` dims (units -> chunk)."""
    return x.sum(dim=tuple(range(ndim, x.ndim))) if x.ndim > ndim else x


__all__ = ["GRANULARITIES", "reduce_units", "expand_like", "executed_units", "sum_to"]
