"""A producer's HDF5 trajectory dump file as it is written (metrics/dump.py documents the
layout and reads it): its header made, or a resumed run's file appended to, and the finished
episodes appended every flush (`DumpFile`), in the writer process of metrics/dump_writer.py or,
for `hpcvla demos`, in the recording process itself.

A file may be given a most size (`max_bytes`: its share of run.dump_max_gib): once a flush
leaves it at that size or past it, it takes no more episodes. It then holds every episode up
to a point (at most one flush past the size) and counts the finished ones it did not write in
its `episodes_not_written` attribute; a resumed run under a larger share writes on."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from hpcvla.metrics.dump import (COMPRESSION, FORMAT, LIBVER, STEP_FIELDS, DumpError,
                                 attr_text, open_dump, open_hdf5, text_attrs)


MAX_PENDING = 512  # episodes a writer holds before it appends them (~1-2 s of its work)


class DumpFile:
    """One producer's dump file: made with its header, or appended to when it exists (a
    resumed run); episodes queued by `add_episode` are appended by `flush`. A flush
    compresses its episodes into a staging file beside the dump first, then opens the dump
    only to copy them in (HDF5 copies the compressed chunks as they are) and closes it: the
    dump is open for writing, and a process killed then leaves it unreadable, for the
    copy alone, not for the compression's seconds (a writer behind the rank would otherwise
    keep it open nearly all the time)."""

    def __init__(self, path, producer: int, source: str, env: str, chunk_len: int,
                 config_yaml: str, max_bytes: int = 0, fresh: bool = False):
        self.path, self.producer, self.max_bytes = Path(path), producer, max_bytes
        self.pending: list[tuple[dict, dict]] = []  # finished, not yet written
        self.segments = self.written = self.total = self.not_written = 0
        self.full = False  # at its most size: it takes no more episodes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.staging = self.path.with_name(self.path.name + ".staging")
        self.staging.unlink(missing_ok=True)  # a killed writer's: never part of the dump
        self.start = 0  # this start's number in the file (starts/<n>)
        # `fresh`: the file at `path` is this writer's to begin (a name its caller claimed
        # with an empty file: `hpcvla demos --out`), never a resumed run's to append to
        if fresh or not (self.path.exists() and self._resumed(config_yaml)):
            with open_hdf5(self.path, "w", libver=LIBVER) as f:
                f.attrs.update(text_attrs(dict(
                    format=FORMAT, source=source, producer_rank=producer, env=env,
                    chunk_len=chunk_len, config=config_yaml, complete=False, segments=0,
                    open_episode_steps=0, episodes_not_written=0)))
                data = f.create_group("data")
                data.attrs.update(text_attrs(dict(total=0, env_args=json.dumps(
                    {"env_name": env, "type": "hpcvla", "env_kwargs": {"chunk_len": chunk_len}}))))
                _record_start(f, self.start, config_yaml)
        self._check_size()

    def _resumed(self, config_yaml: str) -> bool:
        """A resumed run (run.resume) appends to its dump, recording its start (its config
        `config_yaml`); one that cannot be read (e.g. a process killed as it appended) is
        moved aside, and the run goes on with a new one."""
        try:
            with open_dump(self.path) as f:
                self.written, self.segments = len(f["data"]), int(f.attrs["segments"])
                self.total = int(f["data"].attrs["total"])
                self.not_written = int(f.attrs.get("episodes_not_written", 0))
        except DumpError as err:
            aside, n = self.path.with_name(self.path.name + ".unreadable"), 1
            while aside.exists():  # an earlier start's, kept too
                n += 1
                aside = self.path.with_name(f"{self.path.name}.unreadable{n}")
            self.path.rename(aside)
            print(f"hpcvla: producer rank {self.producer}: {err}; moved aside to {aside} "
                  "(if the run was killed while appending, HDF5's `h5clear -s` may restore "
                  "it) and a new dump begun", file=sys.stderr, flush=True)
            return False
        with self._append() as f:
            f.attrs["complete"] = False
            if "starts" not in f:  # a file before starts/: its one start, from the root's
                _record_start(f, 0, attr_text(f.attrs.get("config", "")), began="",
                              open_steps=int(f.attrs.get("open_episode_steps", 0)))
            self.start = len(f["starts"])
            _record_start(f, self.start, config_yaml)
        return True

    def add_episode(self, steps: dict, attrs: dict) -> None:
        """Queue an episode for the next flush; MAX_PENDING of them are appended at once, so
        that a run producing faster than the writer keeps up waits for it as it goes (the
        rank's queue fills behind it) instead of piling up episodes its stop then waits for.
        A full file counts the episode instead."""
        if self.full:
            self.not_written += 1
            return
        self.pending.append((steps, attrs))
        if len(self.pending) >= MAX_PENDING:
            self.flush(self.segments)

    def _append(self):
        """The file opened to append (an h5py.File), without HDF5's file lock (open_hdf5): a
        reader that holds one (h5py's default, a notebook's `h5py.File(path)`) must never hold
        the run up, and a writer that waited for it lost every episode since when the run
        ended first. Such a reader kept open across an append may read stale or inconsistent
        metadata (errors), never affecting the run."""
        return open_hdf5(self.path, "a", libver=LIBVER)

    def flush(self, segments: int, open_steps: int | None = None) -> None:
        """Append the queued episodes and record `segments` (groups received). `open_steps`
        (closing): also record the steps of episodes still open and mark the file complete,
        in the same open. A full file is opened again only to close it: every open for writing
        is a moment in which a killed writer leaves it unreadable."""
        if self.full and not self.pending and open_steps is None:
            return
        names = [f"demo_{self.written + i}" for i in range(len(self.pending))]
        if self.pending:
            with open_hdf5(self.staging, "w", libver=LIBVER) as staged:
                for name, (steps, attrs) in zip(names, self.pending):
                    demo = staged.create_group(name)
                    demo.attrs.update(text_attrs({**attrs, "start": self.start}))
                    for key in (k for k in steps if k.startswith("obs/")):
                        _dataset(demo, key, steps[key])
                    for field, step_name in STEP_FIELDS.items():
                        value = steps[field]
                        _dataset(demo, step_name,
                                 value.astype(np.uint8) if value.dtype == bool else value)
        with self._append() as f:
            data = f["data"]
            if names:
                with open_hdf5(self.staging) as staged:
                    for name in names:
                        staged.copy(staged[name], data, name=name)
            self.written += len(names)
            self.total += sum(attrs["num_samples"] for _, attrs in self.pending)
            data.attrs["total"] = self.total
            f.attrs["segments"] = self.segments = segments
            f.attrs["episodes_not_written"] = self.not_written
            if open_steps is not None:
                f["starts"][str(self.start)].attrs["open_episode_steps"] = open_steps
                f.attrs["open_episode_steps"] = sum(
                    int(start.attrs["open_episode_steps"]) for start in f["starts"].values())
                f.attrs["complete"] = True
        self.staging.unlink(missing_ok=True)
        self.pending.clear()
        self._check_size()

    def _check_size(self) -> None:
        """Past `max_bytes` the file takes no more episodes: said once, naming the setting."""
        size = self.path.stat().st_size
        if self.max_bytes and not self.full and size >= self.max_bytes:
            self.full = True
            print(f"hpcvla: producer rank {self.producer}: its trajectory dump {self.path} "
                  f"holds {size / 2**30:.3g} GiB, its share of run.dump_max_gib "
                  f"({self.max_bytes / 2**30:.3g} GiB a producer): the episodes after its "
                  f"{self.written} are not written (the file counts them: "
                  "episodes_not_written); a run resumed with a larger run.dump_max_gib writes "
                  "on", file=sys.stderr, flush=True)

    def close(self, segments: int, open_steps: int) -> None:
        """Write what is queued, record the steps of episodes still open and mark the file
        complete."""
        self.flush(segments, open_steps=open_steps)


def _record_start(f, n: int, config_yaml: str, began: str | None = None,
                  open_steps: int = 0) -> None:
    """starts/<n>: what a start of the run (its first, or a resume's) wrote under: its config
    (a resume may change any setting; readers check each start's), when it began, its steps
    of episodes open at its close (set then)."""
    f.require_group("starts").create_group(str(n)).attrs.update(text_attrs(dict(
        config=config_yaml, open_episode_steps=open_steps,
        began=time.strftime("%Y-%m-%dT%H:%M:%S%z") if began is None else began)))


def _dataset(group, name: str, value: np.ndarray) -> None:
    value = np.ascontiguousarray(value)
    chunks = (min(len(value), 64), *value.shape[1:]) if value.ndim else None
    group.create_dataset(name, data=value, chunks=chunks, shuffle=value.itemsize > 1,
                         **COMPRESSION)
