"""The learner's objective over a micro-batch of segment groups (roles/segments.py fields,
stacked along the env axis): first its advantages, then the loss that scores the current
policy against them.

The advantages depend only on what was recorded (rewards, the behaviour policy's values, done
and fault flags), never on the weights being trained, so they are computed once, when the
micro-batch arrives, and every epoch reuses them (as CleanRL computes GAE once per batch):

    adv = advantages_of(alg, batch, device)        # PPO: GAE, normalised; GRPO: group scores
    loss, stats, proximal = policy_loss(alg, model, batch, adv, proximal)

The first pass's log-probs and values (`Proximal`, the weights of the version's start) are
what every later epoch clips around: the ratio's (decoupled PPO) and the value clip's.

`alg` is the config's `algorithm` section: with the policy's log-prob granularity (the units
its ratio is taken over), nothing else of the run decides the objective.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hpcvla.algorithms.granularity import executed_units, expand_like, sum_to
from hpcvla.algorithms.grpo import GroupAdvantages, first_episode_advantages, grpo_loss
from hpcvla.algorithms.ppo import (decoupled_ppo_loss, gae, masked_mean, normalize_advantages,
                                   value_loss)


class Proximal(NamedTuple):
    """A micro-batch scored by the learner's weights when this version's training began (its
    first pass), detached: the log-probs the PPO ratio is clipped around and the values the
    value clip is (as CleanRL's values at its update's start; the values the behaviour policy
    recorded are versions older under asynchrony, and a critic that had since moved by more
    than the clip would get no gradient from them)."""
    logprob: torch.Tensor
    value: torch.Tensor


class Advantages(NamedTuple):
    """A micro-batch's advantages. PPO: `advantages` (T, N), normalised over the steps no env
    fault ended (algorithm.advantage_norm: here over the micro-batch's; `batch`: the learner
    normalises them over every learner's batch, roles/learner.batch_normalized), and the GAE
    `returns` (T, N), both on the learner's device. GRPO: `episodes`, the group-relative
    advantage of each episode, and `index` (T, N), the episode of each step (bookkeeping, on
    the CPU)."""
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    episodes: GroupAdvantages | None = None
    index: torch.Tensor | None = None


def _on(device, batch: dict, keys=None) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).to(device, non_blocking=True)
            for k, v in batch.items() if keys is None or k in keys}


def advantages_of(alg, batch: dict, device) -> Advantages:
    """The advantages of a micro-batch (arrays or tensors) under the `algorithm` settings. A
    step whose env failed (env_fault) is no outcome of the policy: it gets none (masked
    out)."""
    kind = alg.traits.advantage
    if kind not in ("gae", "group"):
        raise ValueError(f"algorithm.name={alg.name}: its advantage {kind!r} is none of this "
                         "learner's (gae, group); an off-policy algorithm trains in "
                         "roles/off_policy.py")
    if kind == "group":  # no critic: each episode against its group's
        score = "success" if alg.group_score == "success" else "reward"
        b = _on(device, batch, ("done", score, "env_fault"))
        episodes, index = first_episode_advantages(  # bookkeeping: on the CPU
            b["done"].cpu(), b[score].cpu(), alg.group_size, alg.group_normalize_std,
            b["env_fault"].cpu())
        return Advantages(episodes=episodes, index=index)
    b = _on(device, batch, ("reward", "value", "done", "bootstrap_value", "env_fault",
                            "truncation_value"))
    faults = b["env_fault"]
    advantages, returns = gae(b["reward"], b["value"], b["done"], b["bootstrap_value"],
                              alg.gamma, alg.gae_lambda, faults, b.get("truncation_value"))
    if alg.advantage_norm == "micro_batch":  # (batch: the learner's, over every learner's)
        advantages = normalize_advantages(advantages, ~faults)
    return Advantages(advantages=advantages, returns=returns)


def policy_loss(alg, model, batch: dict, advantages: Advantages | None = None,
                proximal: Proximal | None = None, value_only: bool = False
                ) -> tuple[torch.Tensor, dict, Proximal]:
    """The PPO or GRPO loss of a micro-batch of segment groups, stacked along the env axis,
    given its `advantages` (advantages_of; computed here when None, for one-off callers) and
    its first pass's `proximal` (None: this is the first; the third value returned is it).
    `model` is the engine (or a policy): model(obs, actions) = policy.evaluate.
    `value_only`: PPO's value loss alone (the critic's extra passes)."""
    T, N = batch["logprob"].shape
    if advantages is None:
        advantages = advantages_of(alg, batch, model.device)
    batch = _on(model.device, batch)
    fault = batch["env_fault"]

    def scored(x):  # (T, N, ...) -> (T * N, ...), a failed env's step without NaN or inf
        # (a NaN action, observation or recorded chunk may be why it failed): its unit is
        # masked out, and a NaN there would reach the gradient through the forward. Finite
        # values stay: a recorded field may have its own domain (flow's noisy-step time t,
        # 0 < t < 1, of which 0 gives 0/0)
        if x.is_floating_point():
            bad = fault.reshape(T, N, *[1] * (x.ndim - 2)) & ~torch.isfinite(x)
            x = torch.where(bad, 0.0, x)
        return x.reshape(T * N, *x.shape[2:])
    obs = {k[4:]: scored(v) for k, v in batch.items() if k.startswith("obs.")}
    logprob, value, entropy = model(obs, scored(batch["actions"]))
    # logprob/entropy may be finer than chunks (policy.logprob_granularity): (T, N, *units)
    logprob, value, entropy = (x.reshape(T, N, *x.shape[1:]) for x in (logprob, value, entropy))
    behaviour = batch["logprob"]
    # Decoupled PPO (AReaL): clip around the proximal policy (the learner's weights when this
    # version's training began), importance-weight to the behaviour policy that acted.
    if proximal is None:
        proximal = Proximal(logprob.detach(), value.detach())
    mask = ~batch["env_fault"]  # a failed env's step is masked out everywhere
    # finer units than chunks: the actions its episode ran (granularity.executed_units)
    ran = executed_units(batch["chunk_steps"], logprob) if logprob.ndim > 2 else None
    if alg.traits.advantage == "group":  # no critic: the value head is not trained
        pg_loss, stats = grpo_loss(logprob, proximal.logprob, behaviour, advantages.episodes,
                                   advantages.index, alg.clip, alg.max_behaviour_weight,
                                   alg.group_loss_mean, alg.dual_clip, ran)
        v_loss = torch.zeros((), device=logprob.device)
        episodes = advantages.episodes
        stats.update(degenerate_groups=episodes.degenerate_groups / max(episodes.groups, 1))
        # the entropy bonus on the steps the policy gradient keeps, not on restarted
        # episodes' or degenerate groups' (faults are not kept either)
        mask = episodes.keep.to(mask.device)[advantages.index.to(mask.device)]
    else:
        recorded, returns = batch["value"], advantages.returns
        pg_loss, stats = decoupled_ppo_loss(
            logprob, proximal.logprob, behaviour, advantages.advantages, alg.clip,
            alg.max_behaviour_weight, mask if ran is None else expand_like(mask, ran) & ran,
            alg.dual_clip)
        v_loss = value_loss(value, proximal.value, returns,
                            alg.clip if alg.value_clip else None, mask)
        stats.update(critic_health(recorded[mask], returns[mask]))
        if value_only:
            return (alg.value_coef * v_loss, dict(stats, value_loss=float(v_loss.detach())),
                    proximal)
    # the bonus is the chunk's entropy at every log-prob granularity (units summed): its size
    # is the same at any; the policy loss, a mean over units, is 1/units of chunk's (the
    # granularity's help says so)
    entropy = masked_mean(sum_to(entropy, 2), mask)
    loss = pg_loss + alg.value_coef * v_loss - alg.entropy_coef * entropy
    stats.update(pg_loss=float(pg_loss.detach()), value_loss=float(v_loss.detach()),
                 entropy=float(entropy.detach()))
    return loss, stats, proximal


def critic_health(values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
    """How well the values the behaviour policy recorded predicted the returns: explained
    variance 1 - Var(R - V) / Var(R) (1 perfect, 0 a constant baseline, < 0 worse than
    one), and both scales."""
    var = float(returns.var()) if returns.numel() > 1 else 0.0
    residual = float((returns - values).var()) if returns.numel() > 1 else 0.0
    return {"explained_variance": 1.0 - residual / var if var > 0 else 0.0,
            "return_mean": float(returns.mean()) if returns.numel() else 0.0,
            "return_std": var ** 0.5, "value_mean": float(values.mean()) if values.numel() else 0.0}
