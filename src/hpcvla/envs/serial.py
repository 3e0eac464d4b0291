"""Vectorizing simulators that run one environment per instance (ManiSkill3 on CPU, LIBERO).

`SerialVectorEnv` holds `num_envs` single environments ("slots") in this process and steps
them one after the other; a simulator rank is one core, and the MPI ranks are the parallelism.
Measured here (Debian 12, 2 cores): an extra in-process ManiSkill env costs ~5 MB and an extra
LIBERO env ~270 MB (its scene's model and renderer are shared), while a worker subprocess would
cost a second interpreter with torch and the simulator (~800 MB for ManiSkill) and could not run
any faster on cores the ranks already fill. In-process is therefore how slots run; a whole
vector env (a shard) can still be put in a worker process for fault isolation
(`env.isolation=process`, envs/isolated.py), which is what a hang or a crash needs.

A slot implements:
    instruction: str                     the language instruction of its current episode
    reset(rng, init_state_id) -> None    new episode: from `rng`, or a pure function of the id
                                         (training draws from `rng` stay out of the
                                         evaluation split: envs/base.py)
    step(action (action_dim,)) -> (reward, success)   one primitive action
    observe() -> dict                    per-env observation with every spec field but
                                         "instruction"; rendered once per chunk, not per step
    close() -> None
    episode_metrics() -> dict[str, float]  where its spec declares episode metrics: those of
                                         the episode it ran since its reset

The base class executes action chunks (clipped to [-1, 1], the controllers' normalized range; a
chunk stops early on success, unless `run_to_horizon`: envs/base.py), sums rewards over the
chunk, truncates after `max_episode_chunks` chunks (or `step_limit` primitive steps: envs/base.py),
auto-resets finished envs, tokenizes
instructions, and isolates failures: a slot that raises is reported with its env id on stderr
and in `failures`, rebuilt and reset (its episode ends truncated, flagged `env_fault`; after a
failed reset at its next step, unrun: the rebuilt slot's random start is not the episode
asked for), while the other envs go on. A slot that cannot be rebuilt is retired: it returns
zero observations and a truncated, faulted step from then on, so learners train nothing of
it and success counts skip it. A slot that fails again after `max_rebuilds` rebuilds
within `rebuild_window_s` or in a row (env.max_restarts, env.restart_window_s:
base.RestartBudget), or the last slot retired, raises: the rank stops the job, named, rather
than train on faults alone.
"""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from hpcvla.envs.base import (EnvSpec, RestartBudget, StepResult, VectorEnv, episode_ends,
                              horizon_cut)
from hpcvla.seeds import env_seeds
from hpcvla.text import tokenize


def require(module: str, package: str, env_name: str):
    """Import `module`, or fail saying which package is missing and how to install it."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"env.name={env_name} needs the Python package `{package}` (import {module!r} "
            f"failed: {err}). Install the simulators with `make install` (see README.md), "
            f"or `pip install -r requirements.txt` in {sys.prefix}.") from err


def chunk_actions(actions, num_envs: int, spec) -> np.ndarray:
    """A step's (num_envs, chunk_len, action_dim) actions, checked, as the simulators take
    them (executed_actions)."""
    shape = (num_envs, spec.chunk_len, spec.action_dim)
    actions = np.asarray(actions, dtype=np.float32)
    if actions.shape != shape:
        raise ValueError(f"step: actions must have shape {shape}, got {actions.shape}")
    return executed_actions(actions)


def executed_actions(actions) -> np.ndarray:
    """What every simulator's controller takes of `actions`: float32 clipped to [-1, 1], NaN
    as 0 (a policy's are drawn unbounded; a run's dump records them so)."""
    return np.clip(np.nan_to_num(np.asarray(actions, dtype=np.float32)), -1.0, 1.0)


class SerialVectorEnv(VectorEnv):
    """`num_envs` single-env slots stepped in turn; see the module docstring."""

    def __init__(self, num_envs: int, seed: int, spec: EnvSpec, instruction_len: int,
                 make_slot: Callable[[int], object], first_env: int = 0, name: str = "env",
                 first_slot=None, max_rebuilds: int = 5, rebuild_window_s: float = 0.0):
        if num_envs < 1 or spec.chunk_len < 1 or spec.max_episode_chunks < 1:
            raise ValueError(f"{name}: num_envs, chunk_len and max_episode_chunks must be >= 1")
        self.num_envs, self.spec, self.name = num_envs, spec, name
        self.instruction_len, self.first_env = instruction_len, first_env
        self._make_slot = make_slot
        self._seed_envs(env_seeds(seed, num_envs))
        self.failures: list[tuple[int, str]] = []  # (env id, error) of every failure so far
        self.retired: set[int] = set()  # slot indices that could not be rebuilt
        # each slot's, before the rank gives up
        self._rebuilds = [RestartBudget(max_rebuilds, rebuild_window_s) for _ in range(num_envs)]
        self._chunks = np.zeros(num_envs, dtype=np.int32)
        self._steps = np.zeros(num_envs, dtype=np.int64)  # primitive steps of the episode
        self._return = np.zeros(num_envs, dtype=np.float32)
        self._done_once = np.zeros(num_envs, dtype=bool)  # the task was done this episode
        self._reset_failed = np.zeros(num_envs, dtype=bool)  # its episode never began
        self._obs = {k: np.zeros((num_envs, *shape), dtype=dt)
                     for k, (shape, dt) in spec.obs.items()}
        self._slots: list = [first_slot] if first_slot is not None else []  # built already
        try:
            for i in range(len(self._slots), num_envs):
                self._slots.append(make_slot(i))
        except BaseException:
            self.close()
            raise
        self.reset()

    # ---- failures ---------------------------------------------------------------------

    def _guarded(self, i: int, what: str, call: Callable):
        """`call()`, or None after reporting and replacing a slot that raised."""
        if i in self.retired:
            return None
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - one env's failure must not stop the rest
            self._replace(i, what, err)
            return None

    def _replace(self, i: int, what: str, err: Exception) -> None:
        env_id = self.first_env + i
        self.failures.append((env_id, f"{what}: {err!r}"))
        if not self._rebuilds[i].spend():
            raise RuntimeError(f"{self.name} env {env_id} failed in {what}: {err!r}; rebuilt "
                               f"{self._rebuilds[i].spent()}, giving up: a fault that always "
                               "recurs is a bug to fix, not bad luck")
        print(f"hpcvla: {self.name} env {env_id} failed in {what}: {err!r}; rebuilding it "
              f"({self._rebuilds[i].tally()}; the other envs go on)", file=sys.stderr,
              flush=True)
        try:
            self._slots[i].close()
        except Exception:  # noqa: BLE001 - it is broken already
            pass
        try:
            self._slots[i] = self._make_slot(i)
            self._slots[i].reset(self._rngs[i], None)
            self._write_obs(i)
        except Exception as again:  # noqa: BLE001
            self.retired.add(i)
            self.failures.append((env_id, f"rebuild: {again!r}"))
            if len(self.retired) == self.num_envs:
                raise RuntimeError(f"{self.name}: every env of envs {self.first_env}.."
                                   f"{self.first_env + self.num_envs - 1} could not be rebuilt"
                                   f" (env {env_id}: {again!r}); nothing is left to train on")
            print(f"hpcvla: {self.name} env {env_id} could not be rebuilt ({again!r}); it is "
                  "retired and returns empty observations", file=sys.stderr, flush=True)
            for field in self._obs.values():
                field[i] = 0

    # ---- episodes ---------------------------------------------------------------------

    def _write_obs(self, i: int) -> None:
        slot = self._slots[i]
        obs = slot.observe()  # may hold more than the spec asks for (e.g. state when off)
        for key, field in self._obs.items():
            if key != "instruction":
                field[i] = obs[key]
        if "instruction" in self._obs:
            self._obs["instruction"][i] = tokenize(slot.instruction, self.spec.vocab,
                                                   self.instruction_len)

    def _start_episode(self, i: int, init_state_id: int | None = None) -> None:
        """A failed reset leaves the slot rebuilt on a random start, not the episode asked
        for: its next step ends it as an env fault (no chunk run), never scored as that."""
        self._chunks[i], self._return[i], self._done_once[i] = 0, 0.0, False
        self._steps[i] = 0
        started = self._guarded(i, "reset", lambda: (
            self._slots[i].reset(self._rngs[i], init_state_id), self._write_obs(i)))
        self._reset_failed[i] = started is None

    def _batch(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self._obs.items()}

    def reset(self, seeds: np.ndarray | None = None,
              init_state_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        self._begin_reset(seeds, init_state_ids)
        for i in range(self.num_envs):
            self._start_episode(i, None if init_state_ids is None else int(init_state_ids[i]))
        return self._batch()

    def instructions(self) -> list[str]:
        return [slot.instruction for slot in self._slots]

    def step(self, actions: np.ndarray) -> StepResult:
        n, chunk = self.num_envs, self.spec.chunk_len
        actions = chunk_actions(actions, n, self.spec)
        reward = np.zeros(n, dtype=np.float32)
        success = np.zeros(n, dtype=bool)  # done at some step of the chunk
        at_end = np.zeros(n, dtype=bool)  # done at the chunk's last step
        failed = np.zeros(n, dtype=bool)
        steps_before = self._steps.copy()
        for i in range(n):
            if self._reset_failed[i]:
                self._reset_failed[i], failed[i] = False, True
                continue

            def run_chunk(i=i):
                left = chunk if self.step_limit is None else self.step_limit - self._steps[i]
                for t in range(min(chunk, left)):
                    r, ok = self._slots[i].step(actions[i, t])
                    self._steps[i] += 1
                    reward[i] += r if self.rewards_after_success or not self._done_once[i] \
                        else 0.0
                    at_end[i] = ok
                    if ok:
                        success[i] = self._done_once[i] = True
                        if not self.run_to_horizon:
                            break
                self._write_obs(i)
                self._rebuilds[i].worked()
                return True
            failed[i] = self._guarded(i, "step", run_chunk) is None
        self._chunks += 1
        self._return += reward
        horizon = self._chunks >= self.spec.max_episode_chunks
        if self.step_limit is not None:
            horizon |= self._steps >= self.step_limit
        terminated, truncated, success, at_end = episode_ends(
            success, self._done_once, at_end, horizon, failed, self.run_to_horizon)
        done = terminated | truncated
        episode_return = np.where(done, self._return, 0.0).astype(np.float32)
        episode_length = np.where(done, self._chunks, 0).astype(np.int32)
        ran = (self._steps - steps_before).astype(np.int32)
        final_obs = self._batch() if self.keep_final_obs and \
            horizon_cut(truncated, failed).any() else None
        metrics = {name: np.zeros(n, np.float32) for name in self.spec.episode_metrics}
        for i in np.flatnonzero(done):
            if metrics and not failed[i]:  # (a failed env's episode counts nowhere)
                for name, value in self._slots[i].episode_metrics().items():
                    metrics[name][i] = value
            if failed[i] or self.holding_resets:  # rebuilt and reset already, or held
                self._chunks[i], self._return[i], self._done_once[i] = 0, 0.0, False
                self._steps[i] = 0
            else:
                self._start_episode(i)
        return StepResult(self._batch(), reward, terminated, truncated, success,
                          episode_return, episode_length, failed, at_end, final_obs, ran,
                          metrics or None)

    def close(self) -> None:
        for slot in self._slots:
            try:
                slot.close()
            except Exception:  # noqa: BLE001 - closing must not raise over another error
                pass
        self._slots = []
