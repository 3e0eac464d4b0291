"""Held-out episodes: an env batch and a policy on the env's evaluation states, built once and
run as often as asked: by `hpcvla eval` (evaluate.py) and, during training, by the evaluator
rank or between versions (evaluator.py).

The env names the states (`VectorEnv.evaluation_states`): ids 0, 1, 2, ... where every id is
its own initial state (reach, ManiSkill), the suite's (task, fixed state) pairs taken task by
task in turn for LIBERO. They are all of the evaluation split, ids below EVAL_STATE_IDS,
which training never starts from (envs/base.py). An episode the env ended by a fault
(`env_fault`) is no verdict on the policy: it is left out and counted.

ManiSkill's evaluation conventions are reported beside this one: its evaluation runs every
episode to the horizon (ignore_terminations) and reports `success_once` (the task done at any
step) and `success_at_end` (done at the last step). For a ManiSkill env the episodes here run
the same way (`VectorEnv.run_to_horizon`): `success_rate` is then success_once, the same
outcome as an episode that ends at its first success (the same steps up to it), and
`success_at_end` is measured too.

Several ranks share the states in batches of `envs`: batch b on rank b mod N. A batch is the
same states in the same env slots whatever N is, and its sampling generator is seeded from
(seed, the batch's first state index) inside a forked torch generator (a training rank's own
exploration noise goes on untouched), so the same states and seed give the same per-episode
outcomes on 1 rank and on N.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

import numpy as np
import torch

from hpcvla.config.env import WITHOUT_EMULATION
from hpcvla.config.evaluation import OWN_PROTOCOL
from hpcvla.config.families import simulator
from hpcvla.envs import env_class, env_kwargs, make_env
from hpcvla.envs.base import is_evaluation_state
from hpcvla.metrics.episode_metrics import metric_key
from hpcvla.metrics.stats import known_mean, wilson_interval
from hpcvla.process.watchdog import deadline
from hpcvla.seeds import held_out_seed

if TYPE_CHECKING:
    from hpcvla.config.schema import Config
    from hpcvla.envs.base import VectorEnv
    from hpcvla.policies.base import Policy

# An episode's film: (step, camera image) per chunk, then (step, None) when it ended
Film: TypeAlias = list[tuple[int, np.ndarray | None]]


class Episode(NamedTuple):
    """One evaluation episode's outcome; `position` is its state's index in the states run."""
    position: int
    success: bool
    ret: float
    env_fault: bool
    success_at_end: bool
    steps: int
    # the env's episode metrics (EnvSpec.episode_metrics), NaN where not known
    metrics: dict[str, float] | None = None


def envs_at_once(cfg: Config, envs: int, episodes: int) -> int:
    """The envs an evaluation steps together (what its ranks' memory is planned for, and
    what its sampled actions' seeds go by): `envs`, no more than it has episodes: `episodes`,
    or under a benchmark's eval.protocol its states, which `episodes` does not change."""
    if cfg.eval.protocol != OWN_PROTOCOL:
        episodes = env_class(cfg.env).protocol_episodes(cfg.env, cfg.eval)
    return max(1, min(envs, episodes))


class EvaluationStopped(Exception):
    """HeldOut.run was told to stop before it had run every batch."""


class HeldOut:
    """The env's first `episodes` evaluation states (or eval.protocol's), `envs` at a time,
    one episode each, with `policy` (or the policy the config builds on `device`). `video` K:
    the first K episodes of every task are filmed."""

    def __init__(self, cfg: Config, episodes: int, envs: int, seed: int,
                 device: torch.device | str, policy: Policy | None = None, video: int = 0):
        from hpcvla.factory import build_policy  # the policy exactly as training builds it
        cfg, protocol, states = protocol_of(cfg)
        kwargs = env_kwargs(cfg.env)
        traits = simulator(cfg.env.name)
        if traits.emulated:  # no emulated latency, no injected faults
            kwargs.update(WITHOUT_EMULATION)
        self.seed, self.envs = seed, envs_at_once(cfg, envs, episodes)
        self.held_out = cfg.env.train_states == "sampled"  # else trained from these states
        # a build or step that never returns: loud (its envs are inline, whatever
        # env.isolation says of the training's)
        self.step_deadline_s = cfg.env.step_timeout_s
        # a batch's reset from its states may build their scenes (LIBERO: each task's)
        self.reset_deadline_s = max(cfg.env.step_timeout_s, cfg.env.build_timeout_s) \
            if cfg.env.step_timeout_s and cfg.env.build_timeout_s else 0.0
        with deadline(cfg.env.build_timeout_s):
            self.env = make_env(cfg.env.name, self.envs, seed, **kwargs)
        self.env.run_to_horizon = traits.evaluation_to_horizon  # ManiSkill's conventions
        if protocol:  # LIBERO's scripts count primitive steps: the last chunk may be cut
            self.env.step_limit = protocol.get("step_limit")
        self.policy = policy if policy is not None else build_policy(cfg, self.env.spec, device)
        self.ids, self.tasks = states or self.env.evaluation_states(episodes)
        assert all(is_evaluation_state(int(i)) for i in self.ids), "evaluation states only"
        self.filmed = {p for p, n in enumerate(_ordinals(self.tasks)) if n < video}
        self.protocol = protocol or {"name": OWN_PROTOCOL, "env": cfg.env.name,
                                     "steps": cfg.env.max_episode_chunks * cfg.env.chunk_len}

    def run(self, deterministic: bool, rank: int = 0, ranks: int = 1,
            video_dir: Path | None = None, stop: Callable[[], bool] | None = None
            ) -> tuple[list[Episode], list[str]]:
        """This rank's batches, one episode per state: their Episodes and the videos written
        (to `video_dir`, where the batch holds a filmed state). Raises EvaluationStopped
        where `stop()` says so before a round of batches (a stop signal: the job's lead time
        is its checkpoint's, not an evaluation's); every rank asks it as often, its own batch
        in the round or none (a collective `stop` agrees among them)."""
        mine: list[Episode] = []
        videos: list[str] = []
        devices = [self.policy.device] if self.policy.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for round_ in range(-(-len(self.ids) // (ranks * self.envs))):
                if stop is not None and stop():
                    raise EvaluationStopped
                first = (round_ * ranks + rank) * self.envs
                if first >= len(self.ids):
                    continue
                torch.manual_seed(held_out_seed(self.seed, first))
                outcomes, frames = _run_batch(self.env, self.policy,
                                              self.ids[first:first + self.envs],
                                              deterministic, first,
                                              self.filmed if video_dir else set(),
                                              (self.reset_deadline_s, self.step_deadline_s))
                mine += outcomes
                videos += [_write_video(video_dir, *frames[e.position], self.ids[e.position],
                                        self.tasks[e.position], e.success)
                           for e in outcomes if video_dir is not None and e.position in frames]
        return mine, videos

    def report(self, episodes: list[Episode], deterministic: bool) -> dict[str, object]:
        """The result of every rank's episodes: success with its 95 % (Wilson) interval,
        per task and per episode; an episode the env ended by a fault is left out, counted
        (and, beside, counted as a failure, as the references' scripts count it)."""
        episodes = sorted(episodes, key=lambda e: e.position)  # (the states' order)
        kept = [e for e in episodes if not e.env_fault]
        per_task: defaultdict[str, list[bool]] = defaultdict(list)
        for e in kept:
            per_task[self.tasks[e.position]].append(e.success)
        outcomes, ids = [e.success for e in kept], self.ids
        metrics: defaultdict[str, list[float]] = defaultdict(list)  # (episode_<name>: a mean)
        for e in kept:
            for name, value in (e.metrics or {}).items():
                if np.isfinite(value):
                    metrics[metric_key(name)].append(value)
        return {"split": "evaluation", "init_state_ids": [int(ids.min()), int(ids.max())],
                "states": self.env.evaluation_kind, "held_out": self.held_out,
                "actions": self.policy.action_mode(deterministic),
                "episodes": len(kept), "success_rate": known_mean(outcomes),
                "success_ci95": _wilson(outcomes),
                "mean_return": known_mean([e.ret for e in kept]),
                **{name: float(np.mean(values)) for name, values in metrics.items()},
                "env_faults": len(episodes) - len(kept),
                # what fixes the sampled actions' draws: the seed and the batches
                "seed": self.seed, "envs": self.envs,
                # as OFT's and openpi's scripts count them: an episode that faulted, failed
                "success_rate_faults_failed": float(np.mean([e.success and not e.env_fault
                                                             for e in episodes])),
                **({"success_once": known_mean(outcomes),
                    "success_at_end": known_mean([e.success_at_end for e in kept])}
                   if self.env.run_to_horizon else {}),
                "per_task": {task: {"episodes": len(s), "success_rate": float(np.mean(s)),
                                    "success_ci95": _wilson(s)} for task, s in per_task.items()},
                "per_episode": [{"init_state_id": int(ids[e.position]),
                                 "task": self.tasks[e.position], "success": e.success,
                                 "return": e.ret, "steps": e.steps, "env_fault": e.env_fault,
                                 **{metric_key(k): None if e.env_fault or not np.isfinite(v)
                                    else v for k, v in (e.metrics or {}).items()}}
                                for e in episodes],  # (None: not known; JSON has no NaN)
                "protocol": self.protocol}

    def close(self) -> None:
        self.env.close()


def protocol_of(cfg: Config) -> tuple[Config, dict[str, Any] | None,
                                      tuple[np.ndarray, list[str]] | None]:
    """The config an evaluation runs and, under a benchmark's eval.protocol, what the
    protocol fixes and its (ids, task labels), from the simulator that has it
    (VectorEnv.benchmark_protocol); else None and None."""
    if cfg.eval.protocol == OWN_PROTOCOL:
        return cfg, None, None
    return env_class(cfg.env).benchmark_protocol(cfg)


def _run_batch(env: VectorEnv, policy: Policy, batch: np.ndarray, deterministic: bool,
               first: int, filmed: set[int], deadlines: tuple[float, float] = (0.0, 0.0)
               ) -> tuple[list[Episode], dict[int, tuple[str, Film]]]:
    """One episode from each state of `batch` (the env's first len(batch) slots; the others
    repeat states, and their outcomes are dropped); returns the Episode of each, and for those
    in `filmed` their instruction and frames (position -> (instruction, [(step, image)])): the
    camera observation each chunk was chosen from, and (step, None) when the episode ended.
    `deadlines`: the reset's and each step's (0: none)."""
    n = env.num_envs
    reset_deadline, step_deadline = deadlines
    with deadline(reset_deadline):
        obs = env.reset(init_state_ids=np.resize(batch, n))
    running = np.ones(n, bool)
    success, ret = np.zeros(n, bool), np.zeros(n, np.float32)
    fault, success_at_end = np.zeros(n, bool), np.zeros(n, bool)
    steps = np.zeros(n, np.int64)
    metrics = {name: np.full(n, np.nan) for name in env.spec.episode_metrics}
    said = env.instructions()
    frames: dict[int, tuple[str, Film]] = {first + i: (said[i], []) for i in range(len(batch))
                                           if first + i in filmed}
    step = 0
    while running.any():  # each env's first episode; auto-reset ones are ignored
        for position, (_, film) in frames.items():
            if running[position - first]:
                film.append((step, _camera(obs, position - first)))
        with torch.no_grad():
            actions = policy.act(policy.obs_to_tensors(obs, policy.device),
                                 deterministic).actions
        with deadline(step_deadline):
            result = env.step(actions.cpu().numpy())
        step += env.spec.chunk_len
        ended = running & (result.terminated | result.truncated)
        success[ended], ret[ended] = result.success[ended], result.episode_return[ended]
        fault[ended] = result.env_fault[ended]
        steps[ended] = result.episode_length[ended].astype(np.int64) * env.spec.chunk_len
        if env.step_limit is not None:  # the chunk the limit fell in ran only up to it
            steps[ended] = np.minimum(steps[ended], env.step_limit)
        if result.success_at_end is not None:
            success_at_end[ended] = result.success_at_end[ended]
        for name, values in metrics.items():
            values[ended] = result.metrics[name][ended] if result.metrics else np.nan
        for position, (_, film) in frames.items():
            if ended[position - first]:  # the episode's length, for the last caption
                film.append((step, None))
        running &= ~ended
        obs = result.obs
    return [Episode(first + i, bool(success[i]), float(ret[i]), bool(fault[i]),
                    bool(success_at_end[i]), int(steps[i]),
                    {name: float(values[i]) for name, values in metrics.items()} or None)
            for i in range(len(batch))], frames


def _camera(obs: dict[str, np.ndarray], i: int) -> np.ndarray:
    """Env i's camera images side by side (the third-person camera, then the wrist's)."""
    return np.concatenate([obs[k][i] for k in ("image", "wrist_image") if k in obs], axis=1)


def _ordinals(tasks: list[str]) -> list[int]:
    """Each state's index among the states of its task."""
    seen: defaultdict[str, int] = defaultdict(int)
    out = []
    for task in tasks:
        out.append(seen[task])
        seen[task] += 1
    return out


def _write_video(video_dir: Path, instruction: str, film: Film, state_id: int | np.integer,
                 task: str, success: bool) -> str:
    """One episode's frames as `<task>-state<id>-<success|failure>.mp4` (video.episode_video)."""
    from hpcvla.metrics.video import episode_video
    outcome = "success" if success else "failure"
    seen = [(step, image) for step, image in film if image is not None]
    slug = re.sub(r"[^A-Za-z0-9]+", "_", task).strip("_")[:60] or "task"
    return episode_video(Path(video_dir) / f"{slug}-state{int(state_id)}-{outcome}.mp4",
                         [image for _, image in seen], [step for step, _ in seen],
                         f"state {state_id}", instruction, outcome, film[-1][0])


def _wilson(outcomes: list[bool]) -> list[float]:
    return [round(x, 4) for x in wilson_interval(sum(outcomes), len(outcomes))]
