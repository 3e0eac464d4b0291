"""Files written whole or not at all, and logs appended a whole line at a time. What hpcvla
rewrites in place (summary.json, eval.jsonl, a checkpoint's per-learner sidecars, a rank's
card and failure note for its launcher) goes to a temporary file beside it, renamed over it
once written: a reader (a resumed run, another node's rank, the launcher) sees the old file
or the new one, never a cut one. A full disk or an exceeded quota mid-write, or a node lost
before its write-back, cut a run's summary.json short, with every earlier start's record,
and the next resume failed at its end on it."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Callable


def replace_text(path: Path | str, text: str) -> None:
    """Write `text` to `path` whole or not at all (above). An error names the path: a write's
    EDQUOT/ENOSPC/EFBIG says only what happened, not to which file."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temporary, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())  # on disk before its name is: a lost node's too
        os.replace(temporary, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise _naming(err, path) from err


def _naming(err: OSError, path: Path) -> OSError:
    """A write's error as one that names the file it was writing."""
    return OSError(err.errno, f"writing {path}: {err.strerror}", str(path))


def open_log(path: Path | str, buffering: int = -1) -> LogFile:
    """`path` opened to append lines (metrics.jsonl, a timeline, restarts.jsonl), its last
    line ended first where a rank killed mid-write, or a node lost before its write-back, cut
    it: a resumed world's first record glued to it was lost too, and readers stopped there."""
    handle = open(path, "a+b")
    try:
        if handle.seek(0, os.SEEK_END):
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.write(b"\n")
    finally:
        handle.close()
    return LogFile(Path(path), buffering)


class LogFile:
    """A log open to append (open_log): written, flushed and closed as a text file is, its
    errors naming it (a full disk's or an exceeded quota's EDQUOT/ENOSPC says only what
    happened: a rank's metrics, timeline and dump may sit on three file systems)."""

    def __init__(self, path: Path, buffering: int):
        self.path, self._handle = path, open(path, "a", buffering=buffering)

    def write(self, text: str) -> int:
        return self._named(self._handle.write, text)

    def flush(self) -> None:
        self._named(self._handle.flush)

    def close(self) -> None:
        self._named(self._handle.close)

    def _named(self, call: Callable, *args):
        try:
            return call(*args)
        except OSError as err:
            raise _naming(err, self.path) from err

    def __enter__(self) -> LogFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_log(path: Path | str, tail_bytes: int | None = None) -> list:
    """The records of a log of JSON lines (`tail_bytes`: of the whole lines among its last
    that many bytes: a run of days writes GBs of metrics.jsonl, which a launcher read whole,
    into the batch node's memory, at every failure); a line a killed rank or a lost node cut
    short (open_log ends it before the next start appends) is passed over."""
    with open(path, "rb") as handle:
        end = handle.seek(0, os.SEEK_END)
        start = 0 if tail_bytes is None else max(0, end - tail_bytes)
        handle.seek(start)
        lines = handle.read().decode(errors="replace").splitlines()
    records = []
    for line in lines[1:] if start else lines:  # (the first may be another line's end)
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
