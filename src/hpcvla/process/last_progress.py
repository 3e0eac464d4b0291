"""The run's last progress, as a launcher names it beside a world's failure: the newest
record of an update (`hpcvla train`, metrics/progress.py) or an SFT step (imitation/sft.py) in
the run's metrics.jsonl. A line the dying rank cut short, or a record of another kind (a
held-out evaluation's), is passed over."""

from __future__ import annotations

import json
import os
from pathlib import Path

TAIL_BYTES = 1 << 20  # ~2,000 progress records: the newest is among them


def last_progress(run_dir_file: Path) -> str:
    """What the newest progress record of the run whose directory `run_dir_file` names says."""
    try:
        metrics = Path(run_dir_file.read_text()) / "metrics.jsonl"
        lines = tail_lines(metrics)
    except OSError:
        return "no progress recorded"
    last = next(filter(None, map(_progress, reversed(lines))), None)
    if last is None:
        return f"no progress recorded yet ({metrics})"
    if "step" in last:  # `hpcvla sft`'s
        return (f"last progress: SFT step {last['step']}, {last['trained_chunks']} chunks "
                f"trained, {last['time']:.0f} s into training ({metrics})")
    return (f"last progress: policy version {last['update']}, {last['trained_env_steps']} "
            f"trained env steps, {last['time']:.0f} s into training ({metrics})")


def tail_lines(path: Path, size: int = TAIL_BYTES) -> list[str]:
    """The whole lines among the last `size` bytes of `path`: a run of days writes GBs of
    metrics.jsonl, which a launcher read whole, into the batch node's memory, at every
    failure."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(max(0, end - size))
        lines = f.read().decode(errors="replace").splitlines()
    return lines[1:] if end > size else lines  # the first may be another line's end


def _progress(line: str) -> dict | None:
    """A metrics.jsonl line's record where it is progress, else None."""
    try:
        record = json.loads(line)
    except ValueError:  # cut short
        return None
    if not isinstance(record, dict):
        return None
    wanted = ("step", "trained_chunks") if "step" in record else ("update", "trained_env_steps")
    return record if all(key in record for key in (*wanted, "time")) else None
