"""Learning progress as the weight root sees it: a line every few seconds and a JSONL record
per micro-batch.

    [hpcvla] update 12/200 | 812 trained steps/s | success 0.45 (last 200 eps) | return 3.1 |
             staleness 0.6 | held-out 0.41 (v10) | ETA 2m10s

(`held-out`: the newest evaluation on held-out states during training, eval.every.)

The ETA is the remaining versions at the rate of the recent ones (the last few version
boundaries), not of the whole run: start-up and the first, slower versions would make it fall
for minutes. It shows `--` until three versions have ended.

Success, return and episode length come from episodes that ended inside trained segments (each
learner's last `window` of them; env faults left out), pooled over the learners at every
version's end (`pool`: a learner's producers run some of the envs, and under a multi-task
suite some of the tasks); staleness from the policy versions the root's learner trained on. The
JSONL records hold the loss statistics of each micro-batch's last epoch: clip fraction, KL,
explained variance of the critic, return and value scale. Trained env steps count
all learners: each trains an equal share of every version, so the root's count times the
number of learners. The same numbers go to TensorBoard (`metrics/tensorboard.py`) when a
board is given, a point per version: the mean of its records, the rolling figures,
throughput, staleness and the data plane's fill at its end.
The trained steps/s are those of the versions of the last RATE_WINDOW_S, not of the run since
its start (a slowdown hours in would hardly move that).
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from hpcvla.files import open_log
from hpcvla.metrics.episode_metrics import KEY, EpisodeMetrics, figures_in
from hpcvla.metrics.task_success import TaskSuccess
from hpcvla.metrics.tensorboard import RunBoard


RECENT_VERSIONS = 8  # version boundaries the ETA's rate spans (at least 3)
RATE_WINDOW_S = 30.0  # the trained steps/s shown: over the versions that ended this recently


class Progress:
    def __init__(self, path, total_updates: int, chunk_len: int, every_s: float,
                 enabled: bool, window: int = 200, learners: int = 1,
                 board: RunBoard | None = None, t0: float | None = None,
                 evaluated: bool = False, spec=None):
        """`t0`: the epoch seconds its records' `time` counts from (the timelines' origin;
        default now); `evaluated`: held-out evaluations report to it (on_held_out); `spec`:
        the env's (EnvSpec), success counted per task too where it has several tasks, and
        its episode metrics."""
        self.total, self.chunk_len, self.every_s, self.enabled = total_updates, chunk_len, \
            every_s, enabled
        self.learners = learners
        self.successes: deque = deque(maxlen=window)
        self.returns: deque = deque(maxlen=window)
        self.lengths: deque = deque(maxlen=window)  # in chunks
        self.staleness: deque = deque(maxlen=window)
        self.updates = self.steps = self.micro_batches = self.fault_episodes = 0
        self.first_update = self.first_steps = 0  # where this (possibly resumed) run began
        self.start = self.last_print = time.monotonic()
        # what the timelines' origin is ahead of this one (records' `time` counts from it)
        self.origin_s = 0.0 if t0 is None else max(0.0, time.time() - t0)
        self.recent: deque = deque(maxlen=RECENT_VERSIONS)  # (time, update) at version ends
        self.rated: deque = deque()  # (time, trained env steps) at version ends: the rate's
        # version -> trained env steps at its end, for the held-out evaluations (which report
        # in version order): kept from the last one reported on, where there are any
        self.steps_at: dict[int, int] = {0: 0}
        self.evaluated = evaluated
        self.held_out: tuple[int, float | None] | None = None  # newest (version, success)
        # line-buffered: a world that dies keeps every record up to its last micro-batch
        # (a restart's record of the work lost reads the last one)
        self._file = open_log(path, buffering=1) if (enabled and path) else None
        self.board = board if enabled else None
        # sums a vector over the learners: collective, at every version's end (where there
        # are several learners); the pooled figures shown after it
        self.pool: Callable[[np.ndarray], np.ndarray] | None = None
        self._pooled: dict | None = None
        self._version_stats: list[dict] = []  # this version's records, drawn at its end
        self.tasks = TaskSuccess.of(spec, window) if spec is not None else None
        self.metrics = EpisodeMetrics.of(spec, window) if spec is not None else None
        self._task_counts: np.ndarray | None = None  # every learner's, at the last version's end

    def resume(self, updates: int, trained_env_steps: int) -> None:
        """Counters continue from a checkpoint."""
        self.updates = self.first_update = updates
        self.steps = self.first_steps = trained_env_steps
        self.steps_at[updates] = trained_env_steps

    def _record_head(self) -> dict:
        """What every metrics.jsonl record begins with: seconds since this start's clock, the
        policy version being trained, the trained env steps, and the version this start began
        from (a start resumed from a checkpoint older than the last one logged trains those
        versions again: its records stand for them)."""
        return {"time": round(time.monotonic() - self.start + self.origin_s, 3),
                "update": min(self.updates + 1, self.total),
                "trained_env_steps": self.steps, "from_version": self.first_update}

    def on_segments(self, batch: dict, staleness: float = 0.0) -> None:
        """A micro-batch's segments arrived: count their steps and finished episodes (not
        those an env fault ended: they say nothing of the policy)."""
        ended = batch["done"] & ~batch["env_fault"]
        self.fault_episodes += int((batch["done"] & batch["env_fault"]).sum())
        self.successes.extend(batch["success"][ended].tolist())
        self.returns.extend(batch["episode_return"][ended].tolist())
        self.lengths.extend(batch["episode_length"][ended].tolist())
        if self.tasks:
            self.tasks.add(batch, ended)
        if self.metrics:
            self.metrics.add(batch, ended)
        self.staleness.append(staleness)
        self.steps += batch["done"].size * self.chunk_len * self.learners
        self.micro_batches += 1

    def rolling(self) -> dict:
        """The rolling figures shown (line, records, TensorBoard): every learner's window,
        pooled at the last version's end (before it, none), or this learner's where it is
        the only one."""
        if self.pool is not None:
            return self._pooled or {"success_rate": None, "mean_return": None,
                                    "mean_episode_chunks": None, "episodes": 0,
                                    **(self.metrics.means(np.zeros(2 * len(self.metrics.names)))
                                       if self.metrics else {})}
        return {"success_rate": self.success_rate, "mean_return": self.mean_return,
                "mean_episode_chunks": self.mean_episode_chunks, "episodes": len(self.successes),
                **(self.metrics.means() if self.metrics else {})}

    def on_micro_batch(self, stats: dict) -> None:
        """A micro-batch's last training pass: one metrics.jsonl record of its statistics."""
        shown = self.rolling()
        rollout = {k: v for k, v in shown.items() if k != "episodes"}
        if self._file:
            record = {**self._record_head(), **{k: None if v is None else _digits(v)
                                                for k, v in rollout.items()},
                      "episodes": shown["episodes"],
                      **{k: _digits(v) for k, v in stats.items()}}
            self._file.write(json.dumps(record) + "\n")
        if self.board:
            self._version_stats.append(stats)

    def on_held_out(self, version: int, report: dict, video: str | None = None) -> None:
        """A held-out evaluation of policy `version` (roles/evaluator.py): a line now, a
        metrics.jsonl record (under `held_out`; per task where there are several),
        TensorBoard's `heldout/*` at the trained env steps of that version (and its video),
        and the figure on every progress line after."""
        if not self.enabled:
            return
        steps = self.steps_at.get(version, self.steps)
        for older in [v for v in self.steps_at if v < version]:
            del self.steps_at[older]
        self.held_out = (version, report["success_rate"])
        low, high = report["success_ci95"]
        # which protocol, at which horizon: libero's benchmark or the run's own states
        protocol = {k: v for k, v in report.get("protocol", {}).items()
                    if k in ("name", "steps")}
        said = "".join(f", {protocol[key]} {word}" for key, word in (("name", "protocol"),
                                                                   ("steps", "steps"))
                       if key in protocol)
        print(f"[hpcvla] held-out evaluation of version {version}: success "
              f"{figure(report['success_rate'], 3)} (95 % {low:.3f}-{high:.3f}) over "
              f"{report['episodes']} episodes ({report['actions']} actions"
              + said
              + "), mean return "
              f"{figure(report['mean_return'])}" + (
                  f" ({report['env_faults']} left out: env faults)"
                  if report.get("env_faults") else "")
              + (f"; video {video}" if video else "") + (
                  "" if report.get("held_out", True) else "; the training's own starts "
                  "(env.train_states=benchmark): not held out"),
              file=sys.stdout, flush=True)
        scalars = {k: v for k, v in report.items() if k in (
            "success_rate", "mean_return", "success_at_end") or k.startswith(KEY)}
        if self._file:
            record = {**self._record_head(),
                      "held_out": {"version": version, "trained_env_steps": steps, **scalars,
                                   **{k: report[k] for k in ("success_ci95", "episodes",
                                                             "actions", "env_faults")},
                                   **({"protocol": protocol} if protocol else {}),
                                   **({"per_task": report["per_task"]}
                                      if len(report.get("per_task", ())) > 1 else {})}}
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self.board:
            self.board.scalars(scalars, steps, group="heldout")
            if video:
                self.board.video("heldout/video", video, steps)
            self.board.flush()

    def on_update(self, updates: int, gauges: dict[str, float] | None = None) -> None:
        """Version `updates` ended; collective on the learners where `pool` is set.
        `gauges`: the data plane's fill at its end (SegmentQueues.gauges), drawn under perf/."""
        tasks = self.tasks.counts() if self.tasks else np.zeros((2, 0))
        if self.pool is not None:
            n = len(self.successes)
            metrics = self.metrics.sums() if self.metrics else np.zeros(0)
            total = self.pool(np.array([sum(self.successes), sum(self.returns),
                                        sum(self.lengths), n, *tasks.ravel(), *metrics],
                                       dtype=np.float64))
            tasks = total[4:4 + tasks.size].reshape(tasks.shape)
            episodes = int(total[3])
            self._pooled = {k: float(v / episodes) if episodes else None for k, v in zip(
                ("success_rate", "mean_return", "mean_episode_chunks"), total[:3])}
            self._pooled["episodes"] = episodes
            if self.metrics:
                self._pooled.update(self.metrics.means(total[4 + tasks.size:]))
        self._task_counts = tasks
        self.updates = updates
        if self.evaluated:
            self.steps_at[updates] = self.steps
        now = time.monotonic()
        self.recent.append((now, updates))
        rate = self._rate(now)
        if self.board:  # every version's, drawn as it happens; written out at each line
            self._draw_version()
            self.board.scalars({"trained_env_steps_per_s": rate, "staleness": np.mean(
                self.staleness) if self.staleness else 0.0, "update": updates,
                **(gauges or {})}, self.steps, group="perf")
        if self.enabled and (now - self.last_print >= self.every_s or updates == self.total):
            self.last_print = now
            eta, shown = self.eta_s(), self.rolling()
            print(f"[hpcvla] update {updates}/{self.total} | {rate:.0f} trained "
                  f"steps/s | success {figure(shown['success_rate'])} (last "
                  f"{shown['episodes']} eps) | return {figure(shown['mean_return'])} | "
                  + "".join(f"{name} {figure(value)} | "
                            for name, value in figures_in(shown).items())
                  + "staleness "
                  f"{np.mean(self.staleness) if self.staleness else 0:.2f} | "
                  + (f"held-out {figure(self.held_out[1])} (v{self.held_out[0]}) | "
                     if self.held_out else "") + "ETA "
                  + (f"{int(eta // 60)}m{int(eta % 60):02d}s" if eta is not None else "--"),
                  file=sys.stdout, flush=True)
            if self._file:
                self._file.flush()
            if self.board:
                self.board.flush()

    def _draw_version(self) -> None:
        """TensorBoard's (and W&B's) point of the version that ended: the rolling figures and
        the mean of each statistic over its records (a micro-batch's last epoch each), at its
        trained env steps: one point a version, where `learner.epochs` > 1 would put every
        record of a version at one step."""
        assert self.board is not None
        stats = self._version_stats
        keys = dict.fromkeys(k for record in stats for k in record)
        means = {k: float(np.mean([r[k] for r in stats if k in r])) for k in keys}
        shown = {k: v for k, v in self.rolling().items() if k != "episodes"}
        self.board.scalars({**shown, **means}, self.steps)
        if self.tasks and self._task_counts is not None:
            self.board.scalars(self.tasks.scalars(self._task_counts), self.steps,
                               group="train_task")
        self._version_stats = []

    def _rate(self, now: float) -> float:
        """Trained env steps per second over the versions that ended in the last
        RATE_WINDOW_S (at least the last two boundaries), or since this start before a
        second version ended: a slowdown hours into a run shows within the window."""
        self.rated.append((now, self.steps))
        while len(self.rated) > 2 and now - self.rated[1][0] >= RATE_WINDOW_S:
            self.rated.popleft()
        (first, begun), (last, done) = self.rated[0], self.rated[-1]
        if len(self.rated) < 2 or last <= first:
            return (self.steps - self.first_steps) / max(now - self.start, 1e-9)
        return (done - begun) / (last - first)

    def eta_s(self) -> float | None:
        """Seconds to the last version at the recent versions' rate; None before three
        versions have ended."""
        if self.updates >= self.total:
            return 0.0
        if len(self.recent) < 3:
            return None
        (first, begun), (last, done) = self.recent[0], self.recent[-1]
        return (last - first) / (done - begun) * (self.total - done)

    @property
    def success_rate(self) -> float | None:
        """Over the last `window` episodes that ended; None before the first ends."""
        return float(np.mean(self.successes)) if self.successes else None

    @property
    def mean_return(self) -> float | None:
        return float(np.mean(self.returns)) if self.returns else None

    @property
    def mean_episode_chunks(self) -> float | None:
        """The episodes' mean length in action chunks (env.chunk_len steps each, the last
        one whole where success ended it inside)."""
        return float(np.mean(self.lengths)) if self.lengths else None

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
        if self.board:
            self.board.close()


def figure(value: float | None, digits: int = 2) -> str:
    """A figure as the progress, final and evaluation lines print it: `-` where no episode
    counts (before any ended; an evaluation whose every episode was an env fault)."""
    return "-" if value is None else f"{value:.{digits}f}"


def standing_records(records: list[dict]) -> list[dict]:
    """The metrics.jsonl records (in file order) that stand: a start that resumed behind the
    versions logged (a crash between checkpoints) trained those versions again, and its
    records (a smaller `from_version` than the last record's `update`) replace the earlier
    start's from its `from_version` on, as TensorBoard's purge does (`resumed_at`)."""
    out: list[dict] = []
    for record in records:
        start, last = record.get("from_version"), out[-1] if out else {}
        # a new start: another from_version, or the same one again (its clock from 0)
        new = start != last.get("from_version") or record.get("time", 0) < last.get("time", 0)
        if out and start is not None and new:
            out = [r for r in out if r.get("update", 0) <= start]
        out.append(record)
    return out


def _digits(value) -> float:
    """A figure as metrics.jsonl keeps it: 7 significant digits (a VLA's warmed-up learning
    rate of 9.1e-7, a KL of 3e-8: decimal places would round them to 1e-06 and 0)."""
    return float(f"{float(value):.7g}")


def settled(records: list[dict], least: int = 20) -> list[dict]:
    """The rolling-success records whose window holds `least` episodes (or as many as it
    ever held): a rate of one or two episodes is noise a chart would draw as the curve's
    start (a resumed start's window begins empty again: its first records are left out too,
    a gap in the curve rather than a spike)."""
    full = min(least, max((m.get("episodes") or 0 for m in records), default=0))
    return [m for m in records if (m.get("episodes") or 0) >= full]
