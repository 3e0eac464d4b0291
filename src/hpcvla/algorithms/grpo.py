"""GRPO (group-relative policy optimisation) for episodic robot tasks, critic-free.

A *group* is a set of episodes started from the same initial state (the env's
`reset(init_state_ids=...)`). Each episode gets a score (its success, or its return); its
advantage is its score minus the group's mean, divided by the group's standard deviation
(`normalize_std=False` keeps only the centring, as Dr. GRPO argues). A group whose scores are
all equal (all successes, all failures: std 0) gives every member advantage 0, no signal but
full cost and a division by zero: such *degenerate* groups are filtered out and counted
(SimpleVLA-RL, RLinf). Every chunk of an episode takes the episode's advantage, and the loss
is PPO's decoupled clipped objective (ppo.decoupled_ppo_loss) with filtered episodes masked
out, so staleness is handled exactly as for PPO.

Trajectories arrive as (T, N) arrays of chunk-steps (time x env, as the learner sees them);
`episodes_of` numbers the episodes in them, `per_episode` reduces a step field per episode
(the success flag or reward summed, the initial state id taken at the first step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcvla.algorithms.granularity import expand_like
from hpcvla.algorithms.ppo import decoupled_ppo_loss
from hpcvla.config.learning import GROUP_LOSS_MEANS


@dataclass
class GroupAdvantages:
    advantages: torch.Tensor  # (E,) float32; 0 for filtered episodes
    keep: torch.Tensor  # (E,) bool; False for episodes of degenerate groups
    groups: int  # distinct groups seen
    degenerate_groups: int  # of which filtered (all scores equal)


def group_advantages(scores: torch.Tensor, group_ids: torch.Tensor,
                     valid: torch.Tensor | None = None, normalize_std: bool = True,
                     eps: float = 1e-6) -> GroupAdvantages:
    """Group-relative advantages of episodes: scores (E,), group_ids (E,) ints, `valid` (E,)
    the episodes to use (e.g. the complete ones; default all; the others get keep False and
    do not enter their group's statistics). The std is the population std (ddof 0); a group
    is degenerate when it is <= `eps`, which includes a group of one valid episode."""
    scores = scores.detach().double()
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    weight = valid.double()
    groups, member = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, member, weight)
    mean = torch.zeros_like(count).index_add_(0, member, weight * scores) / count.clamp(min=1)
    centred = scores - mean[member]
    std = (torch.zeros_like(count).index_add_(0, member, weight * centred ** 2)
           / count.clamp(min=1)).sqrt()
    present = count > 0
    degenerate = present & (std <= eps)
    keep = valid & ~degenerate[member]
    advantages = centred / std[member].clamp(min=eps) if normalize_std else centred
    return GroupAdvantages(advantages=(advantages * keep).float(), keep=keep,
                           groups=int(present.sum()), degenerate_groups=int(degenerate.sum()))


def episodes_of(dones: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Number the episodes in (T, N) chunk-steps: returns index (T, N) (episode of each
    step; env columns one after the other, in time order) and complete (E,) (the episode
    ended inside the window; the last one of a column may still be running)."""
    dones = dones.bool()
    T, N = dones.shape
    # a new episode starts after every done; columns are numbered consecutively
    starts = torch.cat([torch.zeros(1, N, dtype=torch.long), dones[:-1].long()]).cumsum(0)
    per_column = starts[-1] + 1
    offset = torch.cat([torch.zeros(1, dtype=torch.long), per_column.cumsum(0)[:-1]])
    index = starts + offset[None, :]
    complete = torch.zeros(int(per_column.sum()), dtype=torch.bool)
    complete[index[dones]] = True
    return index, complete


def per_episode(values: torch.Tensor, index: torch.Tensor, episodes: int,
                reduce: str = "sum") -> torch.Tensor:
    """Reduce a (T, N) step field per episode: "sum" (rewards, success flags) or "first"
    (what the episode started with, e.g. its initial state id)."""
    flat_index, flat = index.reshape(-1), values.reshape(-1)
    if reduce == "sum":
        return torch.zeros(episodes, dtype=flat.dtype).index_add_(0, flat_index, flat)
    if reduce == "first":
        # index grows along time in each column, so the first step of an episode is the
        # smallest time-major position with that index
        order = torch.arange(index.shape[0])[:, None].expand_as(index).reshape(-1) \
            * index.shape[1] + torch.arange(index.shape[1]).repeat(index.shape[0])
        first = torch.full((episodes,), order.numel(), dtype=torch.long)
        first = first.scatter_reduce(0, flat_index, order, reduce="amin")
        return values.reshape(-1)[first]
    raise ValueError(f"reduce {reduce!r}: expected 'sum' or 'first'")


def first_episode_advantages(done: torch.Tensor, step_scores: torch.Tensor, group_size: int,
                             normalize_std: bool = True, faults: torch.Tensor | None = None
                             ) -> tuple[GroupAdvantages, torch.Tensor]:
    """GRPO advantages of (T, N) segments whose every column starts a grouped episode at
    t = 0 (envs/groups.py restarts them so): column c belongs to group c // group_size, its
    first episode is scored by summing `step_scores` (success flags or rewards) over it;
    later (auto-reset) episodes, unfinished ones and those an env fault ended (`faults`,
    (T, N)) are not kept, nor counted in their group. Returns the advantages and the episode
    index of each step, as `grpo_loss` takes them."""
    index, complete = episodes_of(done)
    episodes = complete.numel()
    first = torch.zeros(episodes, dtype=torch.bool)
    first[index[0]] = True
    column_group = torch.div(torch.arange(done.shape[1]), group_size,
                             rounding_mode="floor").expand_as(index)
    groups = per_episode(column_group, index, episodes, reduce="first")
    scores = per_episode(step_scores.double(), index, episodes, reduce="sum")
    valid = complete & first
    if faults is not None:
        valid &= per_episode(faults.long(), index, episodes, reduce="sum") == 0
    return group_advantages(scores, groups, valid=valid,
                            normalize_std=normalize_std), index


def grpo_loss(logprob, proximal_logprob, behaviour_logprob, episodes: GroupAdvantages,
              index: torch.Tensor, clip: float = 0.2, max_behaviour_weight: float = 2.0,
              mean_over: str = "steps", dual_clip: float = 3.0,
              units: torch.Tensor | None = None):
    """GRPO's policy loss over (T, N) chunk-steps (or finer units, (T, N, *units)): each
    step takes its episode's advantage (`index` from `episodes_of`); steps of episodes not
    kept (degenerate group, or not valid, e.g. unfinished) are masked out. Same decoupled
    objective and diagnostics as PPO. The advantages may live on the CPU (they are index
    bookkeeping); they follow `logprob` to its device.

    `mean_over`: "steps" averages the loss over every step of the kept episodes (DAPO's
    token mean), so an episode weighs by its length: where success ends an episode, a
    failure that runs to the time limit outweighs the successes of its group. "episodes"
    averages each kept episode's steps first, then the episodes (DeepSeekMath's GRPO): every
    episode weighs the same. "constant" sums the kept steps' losses over every step the
    (T, N) micro-batch holds, kept or not (Dr. GRPO's constant normalizer): each step weighs
    as in "steps", and as every micro-batch has the same divisor, the learners' average of
    their micro-batches is this sum over the whole batch, though each micro-batch trains as
    it streams in (the other two are means per micro-batch). The clip fraction and
    approximate KL are averaged over the kept units (by episode under "episodes"); the
    behaviour weights' mean and max are over every unit. `units` (bool, like a finer
    `logprob`): the units left in (granularity.executed_units), the others out as a step
    not kept."""
    if mean_over not in GROUP_LOSS_MEANS:
        raise ValueError(f"mean_over {mean_over!r}: expected one of {GROUP_LOSS_MEANS}")
    device = logprob.device
    keep = episodes.keep.float().cpu()
    if mean_over == "episodes":  # each unit weighs 1 / its episode's (a step 1 / its steps)
        counted = torch.ones(index.shape) if units is None else \
            units.flatten(index.ndim).sum(-1).float().cpu()  # the units that ran, each step
        length = torch.zeros(keep.numel()).index_add_(0, index.reshape(-1).cpu(),
                                                      counted.reshape(-1))
        keep = keep / length.clamp(min=1)
    mask = keep.to(device)[index.to(device)]
    if units is not None:
        mask = expand_like(mask, units) * units
    loss, stats = decoupled_ppo_loss(logprob, proximal_logprob, behaviour_logprob,
                                     episodes.advantages.to(device)[index.to(device)], clip,
                                     max_behaviour_weight, mask=mask, dual_clip=dual_clip)
    if mean_over == "constant":  # the kept units' mean times their share: their sum / all
        loss = loss * mask.mean()
    return loss, stats


__all__ = ["GroupAdvantages", "group_advantages", "episodes_of", "per_episode",
           "first_episode_advantages", "grpo_loss"]
