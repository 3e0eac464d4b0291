"""Per-rank timeline of busy spans per stage (JSONL), and counters.

    timeline = Timeline(path, rank=3, role="inference")
    with timeline.span("infer"):
        ...
    timeline.close()

A span may hold others (a checkpoint inside the version's publish, a full ring lane's wait
inside a send): `busy` counts each span's own seconds, those of the spans inside it going to
theirs, so the stages of a rank whose spans are one after another add up to at most its time
(a sharded simulator records its shards' `simulate` spans side by side, env.shards of them at
once). Spans are the rank's main thread's.

Each line: {"rank", "role", "stage", "start", "end"} with times in seconds since the run's
common start (wall-clock `time.time()` against a start rank 0 broadcasts, so comparable across
ranks of one node; across nodes they are as synchronised as the nodes' clocks), after a first
line {"rank", "role", "opened"}: that start in epoch seconds (a resumed run appends each
start's spans, timed from its own start, to the same file). Everything not
inside a span is idle time. Lines are buffered and flushed every `flush_every` spans so the file
is readable during a run. Spans that end after `keep_s` (run.timeline_s) are counted, not
written: a rank's file stops growing (an inference rank writes ~0.3 GB a day of spans).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager

from hpcvla.files import open_log


class Timeline:
    def __init__(self, path, rank: int, role: str, t0: float | None = None,
                 flush_every: int = 200, keep_s: float = float("inf")):
        self.rank, self.role = rank, role
        self.t0 = time.time() if t0 is None else t0
        self.busy = defaultdict(float)   # stage -> seconds
        self.counts = defaultdict(int)   # stage -> spans
        self.first: dict[str, tuple[float, float]] = {}  # stage -> its first span
        self.last: dict[str, tuple[float, float]] = {}  # stage -> its last span
        self._file = open_log(path) if path else None
        self._lines: list[str] = [json.dumps({"rank": rank, "role": role,
                                              "opened": round(self.t0, 6)})] if path else []
        self._flush_every, self._keep_s = flush_every, keep_s
        self._open: list[float] = []  # per open span, innermost last: its nested spans' seconds

    def now(self) -> float:
        return time.time() - self.t0

    @contextmanager
    def span(self, stage: str):
        start = self.now()
        self._open.append(0.0)
        try:
            yield
        finally:
            self.record(stage, start, self.now(), nested=self._open.pop())

    def record(self, stage: str, start: float, end: float, nested: float = 0.0) -> None:
        """A span of `stage` from `start` to `end`; `nested`: the seconds of spans inside it,
        counted under theirs."""
        self.busy[stage] += end - start - nested
        if self._open:  # inside an open span: not that span's own time
            self._open[-1] += end - start
        self.counts[stage] += 1
        self.first.setdefault(stage, (start, end))
        self.last[stage] = (start, end)
        if self._file and end <= self._keep_s:
            self._lines.append(json.dumps({"rank": self.rank, "role": self.role, "stage": stage,
                                           "start": round(start, 6), "end": round(end, 6)}))
            if len(self._lines) >= self._flush_every:
                self.flush()

    def flush(self) -> None:
        if self._file and self._lines:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
            self._lines.clear()

    def close(self) -> None:
        self.flush()
        if self._file:
            self._file.close()
            self._file = None
