"""When this rank reached each step of its start and of its stop, in seconds since the job was
launched: what a full-size run spends before it trains and after it is told to stop.

    phases.mark("communicators")        # a step this rank just finished
    phases.of_rank(timeline)            # {step: seconds since launch}, in order

The origin is `HPCVLA_LAUNCHED_AT` (epoch seconds: `hpcvla train` and the job scripts export
the time they started the world), else this process's own start. Steps come from marks set
where they happen (imports, communicators, the memory plan, a simulator's envs, the policy
build, the transport, the engine, all ranks set up, the stop signal, the end) and from the
first or last span of a stage in the rank's timeline: the first forward pass (`infer`), the
first version trained (the first `publish` starts), a newer version loaded by an inference
rank (`load_weights`), the last version trained (training's end: the last `publish` starts),
the last checkpoint written (`checkpoint`). summary.json keeps every
rank's and, per step, the slowest rank's (roles/outputs.py).
"""

from __future__ import annotations

import os
import time

LAUNCHED_AT = "HPCVLA_LAUNCHED_AT"

# step: (timeline stage, its first span's "start" or "end", or its last span's "last start" or
# "last end"). A version's publish holds its checkpoint: the last version trained is the last
# publish's start (training's end), the last checkpoint written the last checkpoint's end.
FROM_TIMELINE = {"first_act": ("infer", "end"),
                 "first_version_trained": ("publish", "start"),
                 "first_version_published": ("publish", "end"),
                 "first_new_weights_loaded": ("load_weights", "end"),
                 "last_version_trained": ("publish", "last start"),
                 "last_checkpoint_written": ("checkpoint", "last end")}

_marks: dict[str, float] = {}


def launched_at() -> float:
    """Epoch seconds of the launch: HPCVLA_LAUNCHED_AT, else this process's start."""
    if os.environ.get(LAUNCHED_AT):
        return float(os.environ[LAUNCHED_AT])
    return _process_start()


def _process_start() -> float:
    """This process's start in epoch seconds, to the kernel's clock tick. Not psutil's
    create_time: it adds the start to /proc/stat's boot time, whole seconds, and so put the
    launch up to a second early (every step that much late)."""
    try:
        with open("/proc/self/stat") as stat:  # field 22, after the command's ")"
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        import psutil
        return psutil.Process().create_time()


def mark(step: str, at: float | None = None) -> None:
    """This rank finished `step` now (or at epoch time `at`); the first mark of a step stays."""
    _marks.setdefault(step, time.time() if at is None else at)


def last() -> str:
    """The latest step this rank marked ("" before any)."""
    return max(_marks, key=_marks.__getitem__, default="")


def of_rank(timeline=None) -> dict[str, float]:
    """Seconds since launch of every step this rank went through, in the order reached."""
    at = dict(_marks)
    if timeline is not None:
        for step, (stage, which) in FROM_TIMELINE.items():
            if stage in timeline.first:
                (start, end), (last_start, last_end) = timeline.first[stage], \
                    timeline.last[stage]
                at[step] = timeline.t0 + {"start": start, "end": end, "last start": last_start,
                                          "last end": last_end}[which]
    origin = launched_at()
    return {step: round(t - origin, 3) for step, t in sorted(at.items(), key=lambda kv: kv[1])}


def slowest(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Per step, the latest rank to reach it (the one the job waited for), in order."""
    out: dict[str, float] = {}
    for steps in per_rank:
        for step, seconds in steps.items():
            out[step] = max(out.get(step, seconds), seconds)
    return dict(sorted(out.items(), key=lambda kv: kv[1]))
