"""Training success per task of a multi-task suite (EnvSpec.tasks: LIBERO's with
env.suite_task=-1): a task's ended episodes told apart by the tokens of their instruction
observation, the last `window` of each task kept, as the run's rolling success keeps its last
episodes. The learners' counts are summed where the rolling figures are pooled (a learner's
producers run some of the envs, and so some of the tasks); TensorBoard draws each task's at
every version's end and summary.json holds the run's last (`per_task_success`)."""

from __future__ import annotations

from collections import deque

import numpy as np

from hpcvla.text import tokenize


class TaskSuccess:
    def __init__(self, tasks: tuple[str, ...], vocab: tuple[str, ...], length: int,
                 window: int):
        """`tasks`: the suite's instructions, in its order (tasks that share one, as
        libero_90's 90 share 74, are counted together, under the first's place); `vocab` and
        `length`: how the env tokenizes them into its `instruction` observation."""
        self.tasks = tuple(dict.fromkeys(tasks))
        self.places = [tasks.index(t) for t in self.tasks]  # each one's first task index
        self._index = {tokenize(t, vocab, length).tobytes(): i for i, t in enumerate(self.tasks)}
        self._outcomes = [deque(maxlen=window) for _ in self.tasks]

    @classmethod
    def of(cls, spec, window: int) -> TaskSuccess | None:
        """For an env `spec` of several tasks with an instruction observation; else None."""
        if len(set(spec.tasks)) < 2 or "instruction" not in spec.obs:
            return None
        return cls(spec.tasks, spec.vocab, spec.obs["instruction"][0][0], window)

    def add(self, batch: dict, ended: np.ndarray) -> None:
        """The episodes that `ended` (T, n) in a micro-batch of segments: each one's task is
        that of the instruction it acted on (its last step's observation)."""
        if "obs.instruction" not in batch:  # (a learner that records no observations)
            return
        rows = np.ascontiguousarray(batch["obs.instruction"][ended], dtype=np.int32)
        for row, success in zip(rows, batch["success"][ended]):
            task = self._index.get(row.tobytes())
            if task is not None:
                self._outcomes[task].append(bool(success))

    def counts(self) -> np.ndarray:
        """(2, tasks) float64: each task's successes and episodes in its window."""
        return np.array([[sum(o) for o in self._outcomes],
                         [len(o) for o in self._outcomes]], dtype=np.float64)

    def outcomes(self) -> dict[str, list[int]]:
        """{instruction: [successes, episodes]} of this learner's windows (summary.json's
        per rank, pooled by pooled_rates)."""
        return {task: [int(s), int(n)] for task, s, n in zip(self.tasks, *self.counts())}

    def scalars(self, counts: np.ndarray) -> dict[str, float | None]:
        """TensorBoard's `task_<i>` success of `counts` (every learner's: `counts()` summed),
        i the task's place in the suite (summary.json's per_task_success names them)."""
        return {f"task_{i:02d}": float(s / n) if n else None
                for i, s, n in zip(self.places, *counts)}


def pooled_rates(outcomes: list[dict[str, list[int]]]) -> dict[str, dict]:
    """{instruction: {"success_rate" (None where no episode ended), "episodes"}} of every
    learner's `TaskSuccess.outcomes()`, in the suite's order."""
    total: dict[str, list[int]] = {}
    for learner in outcomes:
        for task, (successes, episodes) in learner.items():
            s, n = total.setdefault(task, [0, 0])
            total[task] = [s + successes, n + episodes]
    return {task: {"success_rate": s / n if n else None, "episodes": n}
            for task, (s, n) in total.items()}
