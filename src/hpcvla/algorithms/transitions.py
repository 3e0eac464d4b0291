"""Transitions for an off-policy learner (SAC, sac.py), cut from segment groups
(roles/segments.py): one per env and chunk-step, (observation, action chunk, reward, next
observation, terminal), flat along a transition axis, in the layout replay.ReplayBuffer holds.

A group's rows are consecutive chunk-steps of the same envs, so the next observation of row t
is row t + 1's, and the last row's is the group's `next_obs.*` (the observation the builder
saw when it finished the group). Dropped, and counted as such:

* steps whose env failed (env_fault): no outcome of the policy (as the on-policy learner
  masks them);
* steps whose episode was cut by the horizon (truncated, not terminated): the simulator
  resets the env with that step, so the observation after it belongs to the next episode,
  and a bootstrap from it would be wrong; the episode's own last observation is not kept.

A terminated step bootstraps nothing (its next observation is never read); every other kept
step bootstraps from its next observation (sac.soft_target).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

NEXT = "next_obs."  # the prefix of a group's observation after its last row


def transition_specs(obs_spec: Mapping[str, tuple[tuple[int, ...], str]], chunk_len: int,
                     action_dim: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{field: (per-transition shape, dtype)} of one transition: what a replay buffer of
    them holds (and what its size before launch is counted from)."""
    specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for name, (shape, dtype) in obs_spec.items():
        specs[f"obs.{name}"] = specs[f"{NEXT}{name}"] = (tuple(shape), np.dtype(dtype))
    specs.update(actions=((chunk_len, action_dim), np.dtype(np.float32)),
                 reward=((), np.dtype(np.float32)), terminal=((), np.dtype(bool)))
    return specs


def transitions_of(group: Mapping[str, np.ndarray], obs_names, action_field: str = "actions"
                   ) -> tuple[dict[str, np.ndarray], int]:
    """The kept transitions of a segment group (T rows of n envs) as {field: (N, ...)}, in the
    order of transition_specs, and how many of its T x n steps were dropped (module
    docstring). `obs_names`: the observation fields (the env's, not a policy's extras);
    `action_field`: the group's field that is SAC's action (a steered flow policy's is the
    noise it recorded, policies/noise_actor.py)."""
    T, n = group["reward"].shape
    keep = ~(group["env_fault"] | (group["truncated"] & ~group["terminated"]))
    out: dict[str, np.ndarray] = {}
    for name in obs_names:
        rows = group[f"obs.{name}"]
        following = np.concatenate([rows[1:], group[f"{NEXT}{name}"][None]])
        out[f"obs.{name}"], out[f"{NEXT}{name}"] = rows[keep], following[keep]
    out["actions"] = group[action_field][keep].astype(np.float32, copy=False)
    out["reward"] = group["reward"][keep].astype(np.float32, copy=False)
    out["terminal"] = group["terminated"][keep]
    return out, T * n - int(keep.sum())


def demonstration_transitions(obs: Mapping[str, np.ndarray], actions: np.ndarray,
                              outcomes: Mapping[str, np.ndarray], episode: np.ndarray
                              ) -> tuple[dict[str, np.ndarray], int]:
    """The transitions of recorded episodes (prior data): chunk-step rows `obs` {field: (N,
    ...)}, `actions` (N, H, A), `outcomes` (N,) each (rewards, terminated, truncated,
    env_fault: demonstrations/hpcvla_dump.OUTCOMES), `episode` (N,) the episode of each row,
    whose rows are consecutive. Cut as segment groups are (transitions_of); an episode's
    last row has no next observation in the file, so it is kept only where the task ended
    the episode (terminal: nothing is bootstrapped from it). No rows (a reader's empty share
    of the files): no transitions."""
    if not len(episode):
        return {**{f"{prefix}{k}": v[:0] for k, v in obs.items() for prefix in ("obs.", NEXT)},
                "actions": actions[:0].astype(np.float32), "reward": np.zeros(0, np.float32),
                "terminal": np.zeros(0, bool)}, 0
    parts, dropped = [], 0
    starts = np.flatnonzero(np.r_[True, episode[1:] != episode[:-1]])
    for first, end in zip(starts, np.r_[starts[1:], len(episode)]):
        rows = slice(first, end)
        terminated = outcomes["terminated"][rows, None].astype(bool)
        truncated = outcomes["truncated"][rows, None].astype(bool)
        truncated[-1] |= ~terminated[-1]  # no successor recorded: not bootstrapped from
        group = {f"obs.{k}": v[rows, None] for k, v in obs.items()}
        group.update({f"{NEXT}{k}": v[end - 1:end] for k, v in obs.items()})  # never read
        group.update(actions=actions[rows, None], reward=outcomes["rewards"][rows, None],
                     terminated=terminated, truncated=truncated,
                     env_fault=outcomes["env_fault"][rows, None].astype(bool))
        kept, lost = transitions_of(group, list(obs))
        parts.append(kept)
        dropped += lost
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, dropped


__all__ = ["NEXT", "transition_specs", "transitions_of", "demonstration_transitions"]
