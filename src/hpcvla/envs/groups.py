"""Episode groups for GRPO: every `every` chunk-steps, all envs restart together, each group
of `group_size` consecutive envs from one shared initial state.

GRPO compares episodes that started from the same state (algorithms/grpo.py). The pipeline
ships fixed-length trajectory segments, so with `every` = segment length = the task horizon
(`max_episode_chunks`), each segment column starts with a fresh grouped episode that ends
inside the segment (success or truncation); what an env does after its episode ended (it
auto-resets) is masked out by the learner. The restart replaces the observation of the
segment's last step: GRPO needs no bootstrap value, so nothing is lost (and the step before
it holds the inner env's auto-resets: `VectorEnv.hold_resets`). An episode the restart
cuts short (one begun after an earlier end in the segment) ends there, truncated, with its
return so far, so that a dump or a reader of `done` never joins it to the next episode.

Initial state ids come from this wrapper's own generator (seeded per shard), so groups of
different shards and of successive segments start from different states, and from the
training split (envs/base.py): a group never starts from an evaluation state.
"""

from __future__ import annotations

import numpy as np

from hpcvla.envs.base import StepResult, VectorEnv, training_state_ids

_GROUP_STREAM = 0x6E0  # mixed into the seed: ids differ from the env's own seed stream


class GroupedRestarts(VectorEnv):
    def __init__(self, env: VectorEnv, every: int, group_size: int, seed: int):
        if env.num_envs % group_size:
            raise ValueError(f"group_size {group_size} must divide num_envs {env.num_envs}")
        self.env, self.every, self.group_size = env, every, group_size
        self.num_envs, self.spec = env.num_envs, env.spec
        self.rng = np.random.default_rng([seed, _GROUP_STREAM])
        self.steps = 0
        self._return = np.zeros(self.num_envs, np.float32)  # of each env's running episode
        self._length = np.zeros(self.num_envs, np.int32)

    def __getattr__(self, name):  # whatever else the wrapped env has
        return getattr(self.env, name)

    @property
    def failures(self):
        return self.env.failures

    @property
    def latency_sleep(self) -> bool:
        return self.env.latency_sleep

    @property
    def last_latency_s(self) -> float:
        return self.env.last_latency_s

    def grouped_ids(self) -> np.ndarray:
        """One fresh initial state id per group, repeated for its members."""
        ids = training_state_ids(self.rng, self.num_envs // self.group_size)
        return np.repeat(ids, self.group_size)

    def reset(self, seeds=None, init_state_ids=None) -> dict[str, np.ndarray]:
        self.steps = 0
        self._return[:], self._length[:] = 0.0, 0
        if init_state_ids is None:
            init_state_ids = self.grouped_ids()
        return self.env.reset(seeds=seeds, init_state_ids=init_state_ids)

    def step(self, actions: np.ndarray) -> StepResult:
        self._hold_at_restart()
        return self._regroup(self.env.step(actions))

    def step_async(self, actions: np.ndarray) -> None:
        self._hold_at_restart()
        self.env.step_async(actions)

    def _hold_at_restart(self) -> None:
        """The step before a grouped restart leaves the episodes it ends where they ended:
        the restart resets every env right after (an auto-reset would be a second reset)."""
        restart = (self.steps + 1) % self.every == 0
        if restart != self.env.holding_resets:
            self.env.hold_resets(restart)

    def step_ready(self) -> bool:
        return self.env.step_ready()

    def step_wait(self) -> StepResult:
        return self._regroup(self.env.step_wait())

    def _regroup(self, result: StepResult) -> StepResult:
        self.steps += 1
        done = result.terminated | result.truncated
        running, length = self._return + result.reward, self._length + 1
        if self.steps % self.every:
            self._return, self._length = np.where(done, 0.0, running), np.where(done, 0, length)
            return result
        # the outcome of this step stands; the next observation is a grouped restart, which
        # ends the episodes still running here: their episode metrics are not known (NaN:
        # left out of the means), the env's own count of them starting anew with the reset
        cut = ~done
        self._return[:], self._length[:] = 0.0, 0
        metrics = {name: np.where(cut, np.nan, value).astype(np.float32)
                   for name, value in (result.metrics or {}).items()} or None
        return result._replace(  # (no final observations: GRPO bootstraps nothing)
            obs=self.env.reset(init_state_ids=self.grouped_ids()), final_obs=None,
            metrics=metrics,
            truncated=result.truncated | cut,
            episode_return=np.where(cut, running, result.episode_return).astype(np.float32),
            episode_length=np.where(cut, length, result.episode_length).astype(np.int32))

    def instructions(self) -> list[str]:
        return self.env.instructions()

    def close(self) -> None:
        self.env.close()
