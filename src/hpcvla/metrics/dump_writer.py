"""Writing a trajectory dump (metrics/dump.py documents the layout and reads it): a producer's
segment groups cut into episodes (`TrajectoryDump`), the finished ones queued and appended to
the HDF5 file every flush, in the producer's own process (`DumpFile`: `hpcvla demos`) or in a
helper process of the producer rank (`DumpProcess`: training runs).

Why a process: h5py holds the GIL while gzip compresses a dataset, so a dump written by the
inference rank itself, or by a thread of it, takes the rank's time: a third to two thirds of
its steps at 96 px with a wrist camera (`hpcvla bench dump` measures it). The rank only cuts
episodes from its segments and hands them over; the writer (process/worker.py: no MPI, dies
with its rank, leaves stop signals to it) compresses and writes them.

    rank: DumpProcess                            writer: python -m hpcvla.metrics.dump_writer
    __init__  -> ("open", path, ...)             DumpFile(...) -> ("ok", segments) or error
    add_episode -> queue -> sender thread ->     ("episode", steps, attrs): queued
    flush(segments) -> queue -> ... ->           ("flush", segments): appended
    close(segments, open) -> ... ->              ("close", ...): appended, file complete, "ok"

The sender thread keeps the rank's send off its own clock while the writer is busy appending;
at most `max_bytes` (and MAX_QUEUED episodes) wait for it, and the writer appends every
MAX_PENDING episodes as well as every flush: a run that produces faster than the writer
compresses waits for it as it goes (the writer sets its pace), and its stop waits for a
backlog of at most those, a few seconds of the writer's work, not for everything a flush
interval and 256 MB hold (minutes of short episodes). A writer that fails (its error, sent
back), dies (the connection closes) or cannot be sent to makes the rank's next dump call
raise DumpError naming the file and why: a run never goes on without the dump it asked for."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from hpcvla.metrics.dump import (COMPRESSION, FORMAT, LIBVER, STEP_FIELDS, DumpError,
                                 attr_text, open_dump, open_hdf5, text_attrs)
from hpcvla.process import worker
from hpcvla.transport.segment_meta import SegmentMeta


class TrajectoryDump:
    """Cuts the segment groups one producer sends (roles/segments.py) into per-env episodes
    and has the finished ones written to HDF5 (metrics/dump_writer.py): by a writer process
    (`in_process=False`: a producer rank's, whose time it would take) or by this process.

    `shard_seed(slot)` is the seed of the env shard behind `slot` (the `seed` attribute);
    `vocab` turns instruction tokens into text."""

    def __init__(self, path, producer: int, obs_keys, vocab, shard_seed, env: str,
                 chunk_len: int, config_yaml: str = "", flush_s: float = 10.0,
                 source: str = "run", start_version: int = 0, in_process: bool = True):
        self.path, self.producer, self.obs_keys = Path(path), producer, list(obs_keys)
        self.vocab, self.shard_seed, self.flush_s = vocab, shard_seed, flush_s
        self.start_version = start_version
        self.open: dict[tuple[int, int], list[dict]] = {}  # (slot, env) -> step pieces
        self.episodes: dict[tuple[int, int], int] = Counter()
        self.file = (DumpFile if in_process else DumpProcess)(
            path, producer, source, env, chunk_len, config_yaml)
        self.segments = self.file.segments  # a resumed run's count goes on
        self.last_flush = time.monotonic()

    def add_segment(self, group: dict) -> None:
        """One segment group as sent to a learner: T steps of the n envs of one slot."""
        meta = SegmentMeta.of(group)
        slot, batch = meta.slot, meta.batch
        done = group["done"]
        T = done.shape[0]
        version = np.broadcast_to(group["version"][:, None], done.shape)
        steps = {f"obs/{k}": group[f"obs.{k}"] for k in self.obs_keys}
        steps.update(actions=group["actions"], reward=group["reward"], done=done,
                     terminated=group["terminated"], truncated=group["truncated"],
                     env_fault=group["env_fault"],
                     logprob=group["logprob"], value=group["value"], version=version,
                     staleness=batch - version, success=group["success"],
                     episode_return=group["episode_return"],
                     truncation_value=group["truncation_value"],
                     chunk_steps=group["chunk_steps"])
        for env in range(done.shape[1]):
            pieces, start = self.open.setdefault((slot, env), []), 0
            for end in np.flatnonzero(done[:, env]) + 1:  # an episode ends at step end - 1
                pieces.append({k: v[start:end, env] for k, v in steps.items()})
                self._finish(slot, env)
                pieces, start = self.open.setdefault((slot, env), []), end
            if start < T:
                pieces.append({k: v[start:, env] for k, v in steps.items()})
        self.segments += 1
        if time.monotonic() - self.last_flush >= self.flush_s:
            self.flush()

    def _finish(self, slot: int, env: int) -> None:
        pieces = self.open.pop((slot, env))
        steps = {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
        tokens = steps.get("obs/instruction")
        attrs = {"num_samples": len(steps["reward"]), "env_id": f"p{self.producer}/s{slot}/e{env}",
                 "producer_rank": self.producer, "slot": slot, "env_index": env,
                 "seed": int(self.shard_seed(slot)), "episode": self.episodes[(slot, env)],
                 "start_version": self.start_version,
                 "instruction": "" if tokens is None else
                 " ".join(self.vocab[t] for t in tokens[0] if t),
                 "policy_version": int(steps["version"][0]),
                 "staleness": int(steps["staleness"].max()),
                 "success": bool(steps["success"][-1]),
                 "return": float(steps["episode_return"][-1]),
                 "env_fault": bool(steps["env_fault"][-1]),
                 "truncation_value": float(steps["truncation_value"][-1]),
                 "env_steps": int(steps["chunk_steps"].sum())}
        self.episodes[(slot, env)] += 1
        self.add_episode(steps, attrs)

    def add_episode(self, steps: dict, attrs: dict) -> None:
        """Hand one finished episode over for the next flush: `steps` holds `obs/<key>` for
        every obs key and every STEP_FIELDS field, T rows each; `attrs` the demo's attributes
        (num_samples is set here). For episodes that come from elsewhere than a producer's
        segments, such as a scripted expert's (imitation/recording.py)."""
        written = [f"obs/{k}" for k in self.obs_keys] + list(STEP_FIELDS)
        missing = [k for k in written if k not in steps]
        if missing:
            raise ValueError(f"add_episode: steps lack {', '.join(missing)}")
        self.file.add_episode({k: steps[k] for k in written},
                              {**attrs, "num_samples": len(steps["reward"])})

    def flush(self) -> None:
        """Append the finished episodes now."""
        self.last_flush = time.monotonic()
        self.file.flush(self.segments)

    def close(self) -> None:
        """Write what is finished, record the steps of episodes still open and mark the file
        complete."""
        self.file.close(self.segments, sum(len(p["reward"]) for pieces in self.open.values()
                                           for p in pieces))


MAX_PENDING = 512  # episodes a writer holds before it appends them (~1-2 s of its work)
MAX_QUEUED = 512  # episodes a rank hands over before the writer takes them in


class DumpFile:
    """One producer's dump file: made with its header, or appended to when it exists (a
    resumed run); episodes queued by `add_episode` are appended by `flush`. A flush
    compresses its episodes into a staging file beside the dump first, then opens the dump
    only to copy them in (HDF5 copies the compressed chunks as they are) and closes it: the
    dump is open for writing, and a process killed then leaves it unreadable, for the
    copy alone, not for the compression's seconds (a writer behind the rank would otherwise
    keep it open nearly all the time)."""

    def __init__(self, path, producer: int, source: str, env: str, chunk_len: int,
                 config_yaml: str):
        self.path, self.producer = Path(path), producer
        self.pending: list[tuple[dict, dict]] = []  # finished, not yet written
        self.segments = self.written = self.total = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.staging = self.path.with_name(self.path.name + ".staging")
        self.staging.unlink(missing_ok=True)  # a killed writer's: never part of the dump
        self.start = 0  # this start's number in the file (starts/<n>)
        if self.path.exists() and self._resumed(config_yaml):
            return
        with open_hdf5(self.path, "w", libver=LIBVER) as f:
            f.attrs.update(text_attrs(dict(
                format=FORMAT, source=source, producer_rank=producer, env=env,
                chunk_len=chunk_len, config=config_yaml, complete=False, segments=0,
                open_episode_steps=0)))
            data = f.create_group("data")
            data.attrs.update(text_attrs(dict(total=0, env_args=json.dumps(
                {"env_name": env, "type": "hpcvla", "env_kwargs": {"chunk_len": chunk_len}}))))
            _record_start(f, self.start, config_yaml)

    def _resumed(self, config_yaml: str) -> bool:
        """A resumed run (run.resume) appends to its dump, recording its start (its config
        `config_yaml`); one that cannot be read (e.g. a process killed as it appended) is
        moved aside, and the run goes on with a new one."""
        try:
            with open_dump(self.path) as f:
                self.written, self.segments = len(f["data"]), int(f.attrs["segments"])
                self.total = int(f["data"].attrs["total"])
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
        rank's queue fills behind it) instead of piling up episodes its stop then waits for."""
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
        in the same open."""
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
            if open_steps is not None:
                f["starts"][str(self.start)].attrs["open_episode_steps"] = open_steps
                f.attrs["open_episode_steps"] = sum(
                    int(start.attrs["open_episode_steps"]) for start in f["starts"].values())
                f.attrs["complete"] = True
        self.staging.unlink(missing_ok=True)
        self.pending.clear()

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


class DumpProcess:
    """DumpFile's calls, run by a writer process (module docstring)."""

    def __init__(self, path, producer: int, source: str, env: str, chunk_len: int,
                 config_yaml: str, max_bytes: int = 256 << 20):
        self.path, self.producer, self.max_bytes = Path(path), producer, max_bytes
        self.remind_s = 60.0  # how often a producer held up by a full queue says so
        self._queue: list[tuple[tuple, int]] = []  # (message, bytes), oldest first
        self._queued_bytes, self._queued_episodes, self._failure = 0, 0, ""
        self._ready = threading.Condition()
        self._proc, self._conn = worker.start("hpcvla.metrics.dump_writer")
        try:
            self._conn.send(("open", str(path), producer, source, env, chunk_len, config_yaml))
            self.segments = self._answer()
        except BaseException:  # the writer could not begin the file: it ends, and so does this
            self._proc.kill()
            self._proc.wait()
            self._conn.close()
            raise
        self._sender = threading.Thread(target=self._send_loop, name="dump sender",
                                        daemon=True)
        self._sender.start()

    def add_episode(self, steps: dict, attrs: dict) -> None:
        self._put(("episode", steps, attrs), sum(v.nbytes for v in steps.values()))

    def flush(self, segments: int) -> None:
        self._put(("flush", segments), 0)

    def close(self, segments: int, open_steps: int) -> None:
        """Everything handed over written, the file complete; the writer ended."""
        self._put(("close", segments, open_steps), 0)
        self._sender.join()
        self._raise_failure()
        self._answer()
        self._proc.wait()
        self._conn.close()

    def _put(self, message: tuple, nbytes: int) -> None:
        with self._ready:
            waited = 0.0
            episode = message[0] == "episode"
            while self._queue and not self._failure and (
                    self._queued_bytes + nbytes > self.max_bytes or
                    episode and self._queued_episodes >= MAX_QUEUED):
                if not self._ready.wait(self.remind_s):  # the writer sets the pace
                    waited += self.remind_s
                    print(f"hpcvla: producer rank {self.producer} has waited {waited:.0f} s for "
                          f"its dump writer (pid {self._proc.pid}) to take in "
                          f"{self._queued_bytes / 1e6:.0f} MB queued for {self.path} (a slow "
                          "or hung file system; the rank's work waits with it)",
                          file=sys.stderr, flush=True)
            self._raise_failure()
            self._queue.append((message, nbytes))
            self._queued_bytes += nbytes
            self._queued_episodes += episode
            self._ready.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                message, nbytes = self._queue[0]
            try:
                if self._conn.poll():  # the writer's error, sent back unasked
                    self._fail(self._gone())
                    return
                self._conn.send(message)
            except Exception as err:  # noqa: BLE001 - also MemoryError pickling an episode:
                # said, not a close waiting forever for the answer to a message never sent
                self._fail(self._gone() if isinstance(err, (OSError, EOFError))
                           else f"sending to its writer: {err!r}")
                return
            with self._ready:
                self._queue.pop(0)
                self._queued_bytes -= nbytes
                self._queued_episodes -= message[0] == "episode"
                self._ready.notify_all()
            if message[0] == "close":
                return

    def _gone(self) -> str:
        """Why the writer is gone: the error it sent before it ended (a send that met its
        closed end may come before the error is read), else how it ended."""
        try:
            if self._conn.poll():
                status, why = self._conn.recv()
                if status == "error":
                    return why
        except (OSError, EOFError):
            pass
        return f"the dump writer died ({worker.exit_status(self._proc)})"

    def _fail(self, why: str) -> None:
        with self._ready:
            self._failure = why
            self._ready.notify_all()

    def _raise_failure(self) -> None:
        if self._failure:
            raise DumpError(f"{self.path}: producer rank {self.producer}: {self._failure}")

    def _answer(self):
        """The writer's answer to the request just sent; DumpError if it failed or died."""
        try:
            status, value = self._conn.recv()
        except (OSError, EOFError):
            self._fail(self._gone())
            self._raise_failure()
        if status == "error":
            self._fail(value)
            self._raise_failure()
        return value


def _serve(conn: Connection) -> None:
    """Writer side: DumpFile's calls as they come; the first error is sent back, and ends it."""
    dump = None
    while True:
        try:
            method, *args = conn.recv()
        except EOFError:  # the rank is gone: what it handed over is lost with it
            return
        try:
            if method == "open":
                dump = DumpFile(*args)
                conn.send(("ok", dump.segments))
            elif method == "episode":
                dump.add_episode(*args)
            elif method == "flush":
                dump.flush(*args)
            else:  # close
                dump.close(*args)
                conn.send(("ok", None))
                return
        except Exception as err:  # noqa: BLE001 - the rank raises it, naming the file
            conn.send(("error", f"{type(err).__name__}: {err}"))
            return


if __name__ == "__main__":
    if worker.entered(int(sys.argv[2])):
        _serve(Connection(int(sys.argv[1])))
    worker.leave()
