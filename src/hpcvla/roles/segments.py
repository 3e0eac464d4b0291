"""Trajectory segments: what an inference rank assembles per env shard and a learner trains on.

A segment group holds `T` consecutive chunk-steps of the `n` envs of one shard (they step
together), as one record (see transport/records.py) with fields

    obs.<name>       (T, n, *shape)    observation the action was chosen for
    actions          (T, n, H, A) f4   the action chunk
    logprob, value   (T, n) f4         behaviour policy log-prob and value
    reward           (T, n) f4         reward of the chunk
    done             (T, n) bool       the episode ended with this chunk (no bootstrap across):
                                       terminated | truncated
    terminated       (T, n) bool       ...by the task (success)
    truncated        (T, n) bool       ...by the horizon or a fault
    env_fault        (T, n) bool       ...because the env failed: masked out of training and
                                       of the success counts (algorithms/objective.py,
                                       metrics/progress.py)
    success          (T, n) bool       the episode that ended was a success
    episode_return   (T, n) f4         return of the episode that ended here (0 otherwise)
    episode_length   (T, n) i4         its length in chunks (0 otherwise)
    chunk_steps      (T, n) i4         primitive steps of the chunk its episode ran
                                       (StepResult.chunk_steps)
    metric.<name>    (T, n) f4         each of the env's episode metrics, of the episode
                                       that ended here (0 otherwise; EnvSpec.episode_metrics)
    truncation_value (T, n) f4         V of the observation the horizon ended the episode at
                                       (envs/base.horizon_cut), which PPO bootstraps the
                                       step from (algorithm.bootstrap_truncated); 0 otherwise
    version          (T,) i8           policy version that acted at each step
    bootstrap_value  (n,) f4           value of the observation after the last step
    next_obs.<name>  (n, *shape)       that observation itself, for an off-policy learner
                                       (algorithms/transitions.py); only where asked for
    meta             (5,) i8           producer rank, slot, group index, envs, learner batch
                                       (transport/segment_meta.py names them)

`SegmentBuilder` is fed one step at a time: `record_outcome` (the outcome_fields the simulator
reports with its next observation), then `add_step` after the policy acted; `finish` returns
the group once the next step's value (the bootstrap) is known.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from hpcvla.metrics.episode_metrics import FIELD as METRIC  # "metric." + a metric's name
from hpcvla.transport.segment_meta import SegmentMeta

if TYPE_CHECKING:
    from hpcvla.envs.base import StepResult
    from hpcvla.policies.base import Policy

# One segment group (a record): field name -> array, the fields above
SegmentGroup: TypeAlias = dict[str, np.ndarray]

# What a simulator reports of an action chunk with the next observation (StepResult fields)
OUTCOME_FIELDS = {"reward": ((), "<f4"), "terminated": ((), "|b1"), "truncated": ((), "|b1"),
                  "env_fault": ((), "|b1"), "success": ((), "|b1"),
                  "episode_return": ((), "<f4"), "episode_length": ((), "<i4"),
                  "chunk_steps": ((), "<i4")}

# An observation slot's fields of the horizon-ended episodes' last observations: "final." + key
# (roles/simulator.py writes them where PPO bootstraps truncations, roles/inference.py reads)
FINAL = "final."


def outcome_fields(metrics: Sequence[str] = ()) -> dict[str, tuple[tuple[int, ...], str]]:
    """OUTCOME_FIELDS and a float32 field for each of the env's episode `metrics`."""
    return {**OUTCOME_FIELDS, **{METRIC + name: ((), "<f4") for name in metrics}}


def outcome_of(result: StepResult, metrics: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The outcome_fields of a StepResult, every one of which a simulator must give (a None
    would reach a numpy assignment as a TypeError naming neither the env nor the field),
    `metrics` those its spec declares (StepResult.metrics)."""
    given = result.metrics or {}
    missing = [k for k in OUTCOME_FIELDS if getattr(result, k) is None] + \
        [f"metrics[{name!r}]" for name in metrics if name not in given]
    if missing:
        raise ValueError(f"the env's StepResult lacks {', '.join(missing)}: every env gives "
                         "every outcome field and the episode metrics its spec declares, one "
                         "per env (envs/base.py, StepResult)")
    return {**{k: getattr(result, k) for k in OUTCOME_FIELDS},
            **{METRIC + name: given[name] for name in metrics}}


def truncation_values(policy: Policy, cut: np.ndarray,
                      final_obs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The `truncation_value` of a step's envs: V of `final_obs` (the last observations of
    the episodes the horizon ended, the envs `cut`, in order) at those envs, 0 elsewhere."""
    out = np.zeros(cut.shape, np.float32)
    value = policy.value(policy.obs_to_tensors(dict(final_obs), policy.device))
    out[cut] = value.float().cpu().numpy()
    return out


class SegmentBuilder:
    def __init__(self, obs_spec: Mapping[str, tuple[tuple[int, ...], str]], n_envs: int,
                 chunk_len: int, action_dim: int, segment_len: int, producer: int, slot: int,
                 metrics: Sequence[str] = ()):
        """`metrics`: the env's episode metrics (EnvSpec.episode_metrics)."""
        self.T, self.n, self.t = segment_len, n_envs, 0
        self.producer, self.slot, self.groups = producer, slot, 0
        T, n = segment_len, n_envs
        self.buf = {f"obs.{k}": np.zeros((T, n, *shape), dtype) for k, (shape, dtype)
                    in obs_spec.items()}
        self.buf.update(actions=np.zeros((T, n, chunk_len, action_dim), np.float32),
                        logprob=np.zeros((T, n), np.float32), value=np.zeros((T, n), np.float32),
                        done=np.zeros((T, n), bool), version=np.zeros(T, np.int64),
                        truncation_value=np.zeros((T, n), np.float32))
        self.outcomes = outcome_fields(metrics)
        self.buf.update({k: np.zeros((T, n), dt) for k, (_, dt) in self.outcomes.items()})
        self.batch = 0  # learner batch (= policy version) this segment belongs to, set at start

    def record_outcome(self, outcome: Mapping[str, np.ndarray],
                       truncation_value: np.ndarray | None = None) -> None:
        """Outcome of the previous step's action (outcome_fields, a mapping), reported with
        the new observation, and the value of the episodes the horizon ended (0 elsewhere;
        None: none valued)."""
        if self.t == 0:
            return  # nothing acted yet in this group (outcomes were stored before emission)
        b, i = self.buf, self.t - 1
        for key in self.outcomes:
            b[key][i] = outcome[key]
        b["done"][i] = b["terminated"][i] | b["truncated"][i]
        b["truncation_value"][i] = 0.0 if truncation_value is None else truncation_value

    @property
    def acted(self) -> bool:
        """Whether an outcome is due: a step of this group has acted (record_outcome)."""
        return self.t > 0

    @property
    def full(self) -> bool:
        return self.t == self.T

    def finish(self, bootstrap_value: np.ndarray,
               next_obs: Mapping[str, np.ndarray] | None = None) -> SegmentGroup:
        """The completed group (copies), given V(next observation) and, for an off-policy
        learner, that observation (`next_obs`); starts a new group."""
        group = {k: v.copy() for k, v in self.buf.items()}
        group["bootstrap_value"] = np.asarray(bootstrap_value, np.float32).copy()
        for k, v in (next_obs or {}).items():
            group[f"next_obs.{k}"] = np.array(v)
        group["meta"] = np.array(SegmentMeta(self.producer, self.slot, self.groups, self.n,
                                             self.batch), np.int64)
        self.groups += 1
        self.t = 0
        return group

    def add_step(self, obs: Mapping[str, np.ndarray], actions: np.ndarray, logprob: np.ndarray,
                 value: np.ndarray, version: int) -> None:
        b, t = self.buf, self.t
        for k, v in obs.items():
            b[f"obs.{k}"][t] = v
        b["actions"][t], b["logprob"][t], b["value"][t] = actions, logprob, value
        b["version"][t] = version
        self.t += 1
