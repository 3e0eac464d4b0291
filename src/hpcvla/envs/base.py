"""The vectorized environment interface every simulator implements.

A `VectorEnv` runs `num_envs` independent copies of one task in lock step. One `step()`
executes an *action chunk*: `chunk_len` primitive actions per env, as emitted by a
vision-language-action policy. Observations are dicts of batched numpy arrays whose per-env
shapes and dtypes are declared up front in an `EnvSpec`, so a simulator process can lay them out
in shared memory (roles/simulator.slot_dtypes) before the first step. Episodes auto-reset: the
caller never resets an individual env (GRPO's grouped restart holds the auto-resets of the step
before it, `hold_resets`, and resets every env itself).

Initial states are split in two, and this module is the rule's home: init_state_ids below
EVAL_STATE_IDS are the evaluation split (`hpcvla eval` runs ids 0, 1, 2, ...:
`VectorEnv.evaluation_states`), and training never starts from one. Training starts come
from `training_state_ids`, in [EVAL_STATE_IDS, STATE_IDS): GRPO's grouped restarts
(envs/groups.py), and the random starts of envs whose simulator is seeded by a number
(ManiSkill's reset seed, LIBERO's placement samplers). reach draws its random starts from
each env's own stream instead, which is never an id's stream (seeds.py). What an id
means is each env's: a layout's stream (reach), ManiSkill's reset seed, a LIBERO fixed
initial state (evaluation) or a sampler placement (training).
"""

from __future__ import annotations

import abc
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from hpcvla.config.evaluation import EVAL_STATE_IDS
from hpcvla.config.learning import OBSERVATION_FIELDS
from hpcvla.seeds import env_rng

STATE_IDS = 2 ** 31  # every init_state_id is below this (ManiSkill's reset seeds are int32)


class RestartBudget:
    """The restarts of one shard's worker, or the rebuilds of one env slot: at most `limit`
    within any `window_s` seconds (env.max_restarts, env.restart_window_s; 0: over the world's
    life), and at most `limit` in a row without a step between (`worked`). A fault that
    recurs within the window, or at every try however slowly (a build that always hangs, cut
    at env.build_timeout_s), is a bug to fix, not to retry; a rare one, which a run of days
    meets every few hours, must not add up to the job's end."""

    def __init__(self, limit: int, window_s: float = 0.0, clock=time.monotonic):
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._times: deque[float] = deque()  # of the restarts within the window
        self._in_a_row = 0  # since the last step that worked

    def worked(self) -> None:
        """A step went through: the restarts before it were not in vain."""
        self._in_a_row = 0

    def spend(self) -> bool:
        """Whether one more restart is within the budget; counts it if so."""
        now = self.clock()
        while self.window_s and self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.limit or self._in_a_row >= self.limit:
            return False
        self._times.append(now)
        self._in_a_row += 1
        return True

    def tally(self) -> str:
        """The restarts counted against the budget, e.g. `2/5 in 3600 s`."""
        within = f" in {self.window_s:g} s" if self.window_s else ""
        return f"{len(self._times)}/{self.limit}{within}"

    def spent(self) -> str:
        """What `spend` refused: how many, over what, and the settings."""
        if self._in_a_row >= self.limit:
            return (f"{self._in_a_row} times in a row without a step between "
                    f"(env.max_restarts={self.limit})")
        over = f"in the last {self.window_s:g} s" if self.window_s else "already"
        return (f"{len(self._times)} times {over} (env.max_restarts={self.limit}, "
                f"env.restart_window_s={self.window_s:g})")


def training_state_ids(rng: np.random.Generator, n: int | None = None):
    """One init_state_id (n None) or `n` of them from the training split, drawn from `rng`."""
    ids = rng.integers(EVAL_STATE_IDS, STATE_IDS, n)
    return int(ids) if n is None else ids


def is_evaluation_state(init_state_id: int) -> bool:
    return 0 <= init_state_id < EVAL_STATE_IDS


@dataclass(frozen=True)
class EnvSpec:
    """Static description of a vectorized env (per-env shapes, no batch dimension)."""

    # name -> (shape, numpy dtype str, e.g. "|u1"); names among OBSERVATION_FIELDS, which is
    # how the policies find them (a field by another name would be carried and read by none)
    obs: dict[str, tuple[tuple[int, ...], str]]
    action_dim: int  # continuous action dims per primitive step
    chunk_len: int  # primitive steps executed per env.step() call (an action chunk)
    max_episode_chunks: int  # truncation horizon, in chunks
    # instruction vocabulary; token id = index; id 0 is padding "". A published checkpoint's
    # processor reads the prompt back from the ids (text.detokenize): lower-case words
    # without punctuation, cut at the `instruction` field's length, words outside the
    # vocabulary dropped; an env builds the vocabulary from all its tasks' instructions
    vocab: tuple[str, ...]
    # what an action means where the simulator has a choice (ManiSkill's control mode);
    # "" for an env with one controller. Demonstrations are checked against it.
    controller: str = ""
    # which gripper value opens (LIBERO's env.gripper_action: closed_high is the simulator's
    # -1 open / +1 closed, open_high OFT's +1 open / 0 closed); "" where there is no choice.
    # Demonstrations in the other convention are converted or refused.
    gripper: str = ""
    # the reward it pays where the simulator has a choice (ManiSkill's env.reward); "" where
    # there is one. Prior data's recorded rewards are checked against it.
    reward: str = ""
    # whether success ends an episode (ManiSkill's env.success_ends_episode=false: the horizon
    # alone does). Prior data's recorded episode ends are checked against it.
    success_ends_episode: bool = True
    # the instructions of the tasks its envs run, in the suite's order (LIBERO's), each
    # tokenized into the `instruction` observation: training success is counted per task
    # where there are several (metrics/task_success.py); () for an env of one task
    tasks: tuple[str, ...] = ()
    # the simulator's own figures of an episode beside its success and return (ManiSkill's
    # `grasped`: the object held at some step), one float per episode that ends
    # (StepResult.metrics): segments carry them (`metric.<name>`), and the training metrics
    # show each as `episode_<name>`, a mean over the episodes of the window as success is
    episode_metrics: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = sorted(set(self.obs) - set(OBSERVATION_FIELDS))
        if unknown:
            raise ValueError(f"EnvSpec.obs: {', '.join(unknown)} is no observation field the "
                             f"policies read ({', '.join(OBSERVATION_FIELDS)}): map the "
                             "simulator's camera or state onto one of them "
                             "(config/learning.OBSERVATION_FIELDS)")

    @property
    def state_dim(self) -> int:
        """Dims of the `state` observation, 0 when the env gives none."""
        return self.obs["state"][0][0] if "state" in self.obs else 0


class StepResult(NamedTuple):
    """What `VectorEnv.step` returns; every array has leading dimension num_envs."""

    obs: dict[str, np.ndarray]  # obs AFTER the step; already the next episode's first obs if done
    reward: np.ndarray  # float32, summed over the chunk
    terminated: np.ndarray  # bool, success ended the episode
    truncated: np.ndarray  # bool, horizon reached or the env failed (an env fault)
    success: np.ndarray  # bool, the episode that just ended was a success (False when not done)
    episode_return: np.ndarray  # float32, return of the episode that just ended (0 when not done)
    episode_length: np.ndarray  # int32, chunks in the episode that just ended (0 when not done)
    # bool, the env failed (crashed, hung, retired): the episode ended truncated, and not by
    # anything the policy did, so learners mask the step out and success counts skip it
    env_fault: np.ndarray
    # bool, the task was done at the last step of the episode that just ended (ManiSkill's
    # success_at_end): `success` itself where episodes end at success; None from an env that
    # cannot run episodes past success (`run_to_horizon`)
    success_at_end: np.ndarray | None = None
    # The observation each episode the horizon cut (`horizon_cut`) ended at, before its
    # auto-reset, from an env that keeps them (VectorEnv.keep_final_obs): PPO values it to
    # bootstrap that episode's last step. Rows of other envs hold any observation; None when
    # the horizon cut none, or the env does not keep them.
    final_obs: dict[str, np.ndarray] | None = None
    # int32, the chunk's primitive steps each env's episode ran: chunk_len, or fewer where the
    # episode ended inside the chunk (a success; eval's step limit), 0 where none ran (an env
    # fault before the chunk). Dumps sum them (an episode's `env_steps`), so that a reader
    # knows which of its last chunk's actions ran. Every env gives them (the default is for
    # the field's place after the optional ones).
    chunk_steps: np.ndarray | None = None
    # float32 (num_envs,) each of spec.episode_metrics, of the episode that just ended (0
    # when not done; NaN where it is not known: left out of the means); None from an env
    # that declares none
    metrics: dict[str, np.ndarray] | None = None


def check_observation(env: "VectorEnv", obs: dict[str, np.ndarray]) -> None:
    """Stop on an observation that is not what `env.spec` declares (its fields, num_envs
    rows of each shape and dtype): the shared slots and segments are laid out from the spec,
    and numpy would cast into them silently (a float image in [0, 1] into uint8: 0s)."""
    wrong = []
    for key, (shape, dtype) in env.spec.obs.items():
        if key not in obs:
            wrong.append(f"{key} missing")
            continue
        value = np.asarray(obs[key])
        if value.dtype != np.dtype(dtype) or value.shape != (env.num_envs, *shape):
            wrong.append(f"{key} {value.dtype} {value.shape}, declared {np.dtype(dtype)} "
                         f"{(env.num_envs, *shape)}")
    if wrong:
        raise ValueError(f"{type(env).__name__}'s observation is not what its spec declares "
                         f"({'; '.join(wrong)}): envs/base.py, EnvSpec")


def horizon_cut(truncated: np.ndarray, env_fault: np.ndarray) -> np.ndarray:
    """The envs whose episode a step's horizon ended, of its `truncated` and `env_fault`
    (a StepResult's, or the outcome a simulator reports): truncated, not by an env fault."""
    return truncated & ~env_fault


def final_observations(result: StepResult) -> dict[str, np.ndarray]:
    """`result.final_obs`, which every env gives where its horizon ended episodes."""
    if result.final_obs is None:
        raise RuntimeError("an env ended episodes at the horizon without their last "
                           "observation (StepResult.final_obs, VectorEnv.keep_final_obs), "
                           "which PPO bootstraps from")
    return result.final_obs


def episode_ends(success: np.ndarray, done_once: np.ndarray, at_end: np.ndarray,
                 horizon: np.ndarray, failed: np.ndarray, run_to_horizon: bool):
    """How a chunk step's episodes end, for every env: (terminated, truncated, success,
    success_at_end) of StepResult from the chunk's `success` (done at some step of it),
    `done_once` (done at some step of the episode so far), `at_end` (done at the chunk's last
    step), `horizon` (max_episode_chunks reached) and `failed` (an env fault). Success ends an
    episode, unless `run_to_horizon` (VectorEnv), when only the horizon or a fault does."""
    if run_to_horizon:
        terminated, truncated = np.zeros_like(success), horizon | failed
        ended = truncated & ~failed
        return terminated, truncated, done_once & ended, at_end & ended
    terminated = success & ~failed
    return terminated, ~terminated & (horizon | failed), terminated.copy(), terminated.copy()


class VectorEnv(abc.ABC):
    """`num_envs` copies of a task stepped together, with auto-reset.

    Optional hooks, with defaults here (an env overrides what applies to it):
    `failures`, the (env id, what happened) of every env fault so far (envs/serial.py,
    envs/isolated.py); `latency_sleep` and `last_latency_s`, an emulated step latency (envs/
    reach.py): with latency_sleep False the env does not sleep it but reports the last step's
    in last_latency_s, and the simulator rank holds that step's observation back as long;
    `run_to_horizon` (envs/serial.py, envs/maniskill_gpu.py), set by `hpcvla eval` for
    ManiSkill's conventions, and by a ManiSkill env trained with env.success_ends_episode=false:
    an episode does not end at success but at its horizon, as ManiSkill's evaluation and its
    SAC baseline run it (ignore_terminations); `success` is then whether the task was done at
    any step (success_once) and `success_at_end` whether at the last. Rewards after the first
    success count only where training's episodes count them (`rewards_after_success`)."""

    num_envs: int
    spec: EnvSpec
    failures: Sequence[tuple[int, str]] = ()  # an env that records faults sets its own list
    latency_sleep: bool = True
    last_latency_s: float = 0.0
    run_to_horizon: bool = False
    # whether the rewards after an episode's first success count (with run_to_horizon): a
    # ManiSkill env trained with env.success_ends_episode=false, whose success state pays (dense:
    # 1 a step), evaluated as it trained
    rewards_after_success: bool = False
    # whether `step` returns the horizon-ended episodes' last observations (StepResult.
    # final_obs): a copy, or a render, that only PPO's algorithm.bootstrap_truncated reads
    keep_final_obs: bool = False
    # whether episodes that end stay where they ended, not auto-reset (`hold_resets`)
    holding_resets: bool = False
    # `hpcvla eval`'s eval.protocol=libero (envs/serial.py): an episode is truncated after this
    # many primitive steps, in the middle of a chunk if need be, as LIBERO's evaluation
    # scripts count max_steps; None: after max_episode_chunks whole chunks
    step_limit: int | None = None
    # Optional: a static method spec_of(**constructor kwargs) -> EnvSpec, for an env whose
    # spec is known without building a simulator (libero); env_spec builds one otherwise.
    spec_of = None
    # what an evaluation state is, for `hpcvla eval`'s report
    evaluation_kind = "one initial state per init_state_id"

    # What the configured env (the config's `env` section) needs, asked of its class before
    # any env is built (envs/registry.py): each simulator answers for itself.
    @classmethod
    def config_kwargs(cls, env_cfg) -> dict:
        """Its constructor arguments from the env section, beyond the ones every env takes."""
        return {}

    @classmethod
    def config_problems(cls, env_cfg) -> list[tuple[str, object, str]]:
        """What pre-flight refuses (field, value, what would be valid): the task or suite it
        cannot run here. Its package is checked first (registry.SIMULATOR_PACKAGES)."""
        return []

    # A benchmark's own evaluation protocol (eval.protocol, SimulatorTraits.benchmark: its
    # fixed states, step limit, task choice): a simulator that has one answers the three below.
    @classmethod
    def protocol_problems(cls, env_cfg, eval_cfg) -> list[tuple[str, object, str]]:
        """What its benchmark's evaluation protocol (eval.protocol) cannot run of the eval
        settings, as config_problems says them."""
        return []

    @classmethod
    def protocol_episodes(cls, env_cfg, eval_cfg) -> int:
        """The episodes eval.protocol's benchmark runs, one per fixed state, known before any
        env is built (the evaluating ranks' envs and memory are planned for them)."""
        raise NotImplementedError(f"{cls.__name__} has no benchmark protocol")

    @classmethod
    def benchmark_protocol(cls, cfg) -> tuple[Any, dict, tuple[np.ndarray, list[str]]]:
        """eval.protocol's benchmark: the config its evaluation runs (a copy: the step limit
        as the horizon, the tasks it loads), the protocol's record for the report (`name`,
        `steps` an episode may run, `describe`: one line saying what it fixes; `step_limit`
        where a chunk past the limit is cut: VectorEnv.step_limit), and its states'
        init_state_ids with each one's task label, in the order it runs them."""
        raise NotImplementedError(f"{cls.__name__} has no benchmark protocol")

    @classmethod
    def uses_gpu(cls, env_cfg) -> bool:
        """Whether it renders or simulates on a GPU where there is one (devices.py gives its
        ranks one)."""
        return False

    @abc.abstractmethod
    def reset(self, seeds: np.ndarray | None = None,
              init_state_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Reset all envs. `seeds` (num_envs,) reseeds each env's RNG; `init_state_ids`
        (num_envs,) makes each initial state a pure function of its id."""

    def _seed_envs(self, seeds) -> None:
        """Each env's own stream of random episode starts, from its env seed."""
        self._rngs = [env_rng(s) for s in seeds]

    def _begin_reset(self, seeds, init_state_ids) -> None:
        """What every `reset` does first: one entry per env in each per-env array, and the
        envs' streams reseeded from `seeds` where given."""
        for name, arr in (("seeds", seeds), ("init_state_ids", init_state_ids)):
            if arr is not None and np.shape(arr) != (self.num_envs,):
                raise ValueError(f"reset: {name} must have shape ({self.num_envs},), "
                                 f"got {np.shape(arr)}")
        if seeds is not None:
            self._seed_envs(seeds)

    @abc.abstractmethod
    def step(self, actions: np.ndarray) -> StepResult:
        """Execute one action chunk, `actions` of shape (num_envs, chunk_len, action_dim)."""

    # Split step (gym's vector API): a simulator rank starts every shard whose actions are in,
    # then collects the ones that finished. In-process envs do the work in step_wait, so this
    # is `step`; envs in worker processes (envs/isolated.py) step concurrently in between.
    def step_async(self, actions: np.ndarray) -> None:
        """Start a step of `actions`; collect it with `step_wait`."""
        self._pending_actions = actions

    def step_ready(self) -> bool:
        """True when `step_wait` would not wait (always, in-process)."""
        return True

    def step_wait(self) -> StepResult:
        """The outcome of the step `step_async` started."""
        actions, self._pending_actions = self._pending_actions, None
        return self.step(actions)

    def hold_resets(self, hold: bool) -> None:
        """While `hold`, an episode that ends is not auto-reset: its env returns the
        observation it ended at (and steps on from it) until `reset`. For a caller that resets
        every env itself right after such a step (GRPO's grouped restart, envs/groups.py): a
        LIBERO or ManiSkill reset costs a large part of a chunk's step."""
        self.holding_resets = hold

    def end_episodes_at_success(self, ends: bool) -> None:
        """env.success_ends_episode, for a simulator that offers it: False runs every episode
        to its horizon with every step's reward counted (`run_to_horizon`,
        `rewards_after_success`)."""
        self.run_to_horizon = self.rewards_after_success = not ends

    def evaluation_states(self, episodes: int) -> tuple[np.ndarray, list[str]]:
        """`episodes` init_state_ids that `hpcvla eval` runs, and the task of each (for per
        task results), all from the evaluation split (module docstring). Default: ids 0, 1,
        2, ..., each its own initial state of one task."""
        if episodes > EVAL_STATE_IDS:
            raise ValueError(f"at most {EVAL_STATE_IDS} evaluation states, not {episodes}")
        return np.arange(episodes), ["all"] * episodes

    @abc.abstractmethod
    def instructions(self) -> list[str]:
        """The current language instruction of every env."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release simulator resources."""

    def begin_close(self) -> None:
        """Start closing, for an env that closes elsewhere (a worker process): `close_all`
        closes such envs together, not one after another."""


def close_all(envs: Sequence[VectorEnv]) -> None:
    """Close every env of `envs`; the ones that close elsewhere all start first."""
    for env in envs:
        env.begin_close()
    for env in envs:
        env.close()
