"""The off-policy learner's objective over a batch of transitions sampled from its replay
buffer (transitions.py fields), built from sac.py's losses: one gradient step of SAC trains
the critics, the actor and the temperature together,

    loss, stats = soft_actor_critic_loss(alg, policy, batch, target_entropy)

and after the optimizer step `update_targets(policy, alg.tau)` moves the target critics.

The policy brings its encoder (`features`), its reparameterised actions (`soft_actions`) and the
critics policies/soft_critics.py adds. As in pixel SAC (SAC-AE, DrQ) the critic's loss trains
the shared encoder and the actor's reads its features detached: the actor's gradient reaches the
actor's head only, and the temperature moves by its own loss. The temperature is the policy's
`sac_log_alpha`; the critics inside the actor's loss are frozen (policies/soft_critics.py), so
each loss moves only what it is meant to, and one backward pass serves all three.

The Bellman target reads the next observation through the online encoder; only the Q heads
have Polyak copies (DrQ-v2's scheme, RLinf's `target_update_type=q_head_only`). SAC-AE, DrQ,
RLPD's pixel learner and RLinf's default keep a target encoder too: a copy of the encoder
and its optimizer-free update per step, which the encoders here (a small CNN, DSRL's noise
encoder) have not needed. Unlike RLPD (10 critics, the actor on their mean), the critics
are twins, the actor taking their minimum.
"""

from __future__ import annotations

import contextlib

import torch

from hpcvla.algorithms.sac import (actor_loss, critic_loss, polyak_update, soft_target,
                                   temperature_loss)
from hpcvla.algorithms.transitions import NEXT


def soft_actor_critic_loss(alg, policy, batch: dict[str, torch.Tensor], target_entropy: float,
                           critics_only: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """SAC's loss of a batch of transitions (tensors on the policy's device) under the
    `algorithm` settings (`gamma`, per chunk); the statistics logged with it. `critics_only`
    (algorithm.critic_warmup): the critics' loss alone, on detached features."""
    obs = {k[4:]: v for k, v in batch.items() if k.startswith("obs.")}
    following = {k[len(NEXT):]: v for k, v in batch.items() if k.startswith(NEXT)}
    alpha = policy.sac_log_alpha.exp().detach()
    with torch.no_grad():
        next_features = policy.features(following)
        next_actions, next_logprob = policy.soft_actions(next_features)
        next_q1, next_q2 = policy.soft_q(next_features, next_actions, target=True)
        target = soft_target(batch["reward"], batch["terminal"], next_q1, next_q2,
                             next_logprob, alpha, alg.gamma)
    features = policy.features(obs)
    q1, q2 = policy.soft_q(features.detach() if critics_only else features,
                           batch["actions"].flatten(1))
    critic = critic_loss(q1, q2, target)
    # during the warm-up the actor's and temperature's terms are statistics only: no graph
    with torch.no_grad() if critics_only else contextlib.nullcontext():
        actions, logprob = policy.soft_actions(features.detach())
        actor = actor_loss(logprob, *policy.soft_q(features.detach(), actions, frozen=True),
                           alpha)
        temperature = temperature_loss(policy.sac_log_alpha, logprob, target_entropy)
    stats = {"critic_loss": float(critic.detach()), "actor_loss": float(actor.detach()),
             "alpha": float(alpha), "entropy": float(-logprob.detach().mean()),
             "q_mean": float(q1.detach().mean()), "target_mean": float(target.mean()),
             # where the actor acts: DSRL's noise against its sampler's N(0, 1) prior (1.0)
             "action_rms": float(actions.detach().square().mean().sqrt())}
    return (critic if critics_only else critic + actor + temperature), stats


def update_targets(policy, tau: float) -> None:
    """Polyak-average the target critics toward the online ones (after an optimizer step)."""
    polyak_update(policy.value_q_target.parameters(), policy.value_q.parameters(), tau)


__all__ = ["soft_actor_critic_loss", "update_targets"]
