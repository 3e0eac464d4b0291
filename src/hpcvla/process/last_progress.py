"""The run's last progress, as a launcher names it beside a world's failure: the newest
record of an update (`hpcvla train`, metrics/progress.py) or an SFT step (imitation/sft.py) in
the run's metrics.jsonl. A line the dying rank cut short, or a record of another kind (a
held-out evaluation's), is passed over."""

from __future__ import annotations

from pathlib import Path

from hpcvla.files import read_log

TAIL_BYTES = 1 << 20  # ~2,000 progress records: the newest is among them


def last_progress(run_dir_file: Path) -> str:
    """What the newest progress record of the run whose directory `run_dir_file` names says."""
    try:
        metrics = Path(run_dir_file.read_text()) / "metrics.jsonl"
        records = read_log(metrics, TAIL_BYTES)
    except OSError:
        return "no progress recorded"
    last = next(filter(_is_progress, reversed(records)), None)
    if last is None:
        return f"no progress recorded yet ({metrics})"
    if "step" in last:  # `hpcvla sft`'s
        return (f"last progress: SFT step {last['step']}, {last['trained_chunks']} chunks "
                f"trained, {last['time']:.0f} s into training ({metrics})")
    return (f"last progress: policy version {last['update']}, {last['trained_env_steps']} "
            f"trained env steps, {last['time']:.0f} s into training ({metrics})")


def _is_progress(record) -> bool:
    """Whether a metrics.jsonl record is progress (a line cut short is none: read_log)."""
    if not isinstance(record, dict):
        return False
    wanted = ("step", "trained_chunks") if "step" in record else ("update", "trained_env_steps")
    return all(key in record for key in (*wanted, "time"))
