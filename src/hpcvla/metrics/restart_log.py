"""A run's restarts inside the allocation, one JSON line each in its `restarts.jsonl`: the
file's one name, the append that `python -m hpcvla.job.restarts record` (jobs/launch.sh) writes
with, and the reader that puts the list into summary.json (roles/outputs.py)."""

from __future__ import annotations

import json
from pathlib import Path

from hpcvla.files import open_log, read_log

FILE = "restarts.jsonl"


def append(run_dir: Path, entry: dict) -> None:
    """Add one restart's record to the run's file."""
    with open_log(Path(run_dir) / FILE) as f:
        f.write(json.dumps(entry) + "\n")


def recorded(run_dir: Path) -> list[dict]:
    """The restarts of a run so far (for summary.json)."""
    path = Path(run_dir) / FILE
    return read_log(path) if path.exists() else []
