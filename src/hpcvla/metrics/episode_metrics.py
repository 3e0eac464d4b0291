"""A simulator's own figures of an episode in training (EnvSpec.episode_metrics: ManiSkill's
`grasped`, the object held at some step): each metric's values over the last `window` episodes
that ended inside trained segments (env faults left out), as the rolling success keeps its
own, a value that is not known (NaN: an episode GRPO's grouped restart cut short) left out of
them. The learners' sums are pooled with the rolling figures; metrics.jsonl, TensorBoard
(`rollout/episode_<name>`, beside the success rate) and summary.json show each as
`episode_<name>`, a mean."""

from __future__ import annotations

from collections import deque

import numpy as np

FIELD = "metric."  # a metric's segment field: FIELD + its name (roles/segments.py)
# a metric's key among the figures shown (metrics.jsonl, summary.json, TensorBoard, the dumps'
# episode attributes, evaluation results): KEY + its name
KEY = "episode_"


def metric_key(name: str) -> str:
    return KEY + name


def figures_in(record: dict) -> dict:
    """The episode metrics among a record's figures (`episode_<name>` keys), by name."""
    return {k.removeprefix(KEY): v for k, v in record.items() if k.startswith(KEY)}


class EpisodeMetrics:
    def __init__(self, names: tuple[str, ...], window: int):
        self.names = names
        self._values = {name: deque(maxlen=window) for name in names}

    @classmethod
    def of(cls, spec, window: int) -> EpisodeMetrics | None:
        """For an env `spec` that declares episode metrics; else None."""
        return cls(tuple(spec.episode_metrics), window) if spec.episode_metrics else None

    def add(self, batch: dict, ended: np.ndarray) -> None:
        """The values of the episodes that `ended` (T, n) in a micro-batch of segments."""
        for name, kept in self._values.items():
            values = batch[FIELD + name][ended]
            kept.extend(values[np.isfinite(values)].tolist())

    def sums(self) -> np.ndarray:
        """Each metric's sum over its window, then each one's count: what the learners pool."""
        return np.array([sum(v) for v in self._values.values()] +
                        [len(v) for v in self._values.values()], dtype=np.float64)

    def windows(self) -> dict[str, list[float]]:
        """{name: [sum, count]} of this window (summary.json pools them)."""
        sums, k = self.sums(), len(self.names)
        return {name: [float(sums[i]), float(sums[k + i])] for i, name in enumerate(self.names)}

    def means(self, sums: np.ndarray | None = None) -> dict[str, float | None]:
        """`episode_<name>`: the mean of each metric, of `sums` (pooled) or of this window;
        None before a value is known."""
        sums = self.sums() if sums is None else sums
        k = len(self.names)
        return _means(self.names, sums[:k], sums[k:])


def pooled(windows: list[dict[str, list[float]]]) -> dict[str, float | None]:
    """`episode_<name>`: each metric's mean over every learner's window (`windows()` of
    each: summary.json pools them)."""
    names = tuple(dict.fromkeys(name for window in windows for name in window))
    totals, counts = ([sum(w[name][i] for w in windows if name in w) for name in names]
                      for i in (0, 1))
    return _means(names, totals, counts)


def _means(names, totals, counts) -> dict[str, float | None]:
    return {metric_key(name): float(total / count) if count else None
            for name, total, count in zip(names, totals, counts)}
