"""Writing a trajectory dump (metrics/dump.py documents the layout and reads it): a producer's
segment groups cut into episodes (`TrajectoryDump`), the finished ones queued and appended to
the HDF5 file every flush (`DumpFile`, metrics/dump_file.py), in the producer's own process
(`hpcvla demos`) or in a helper process of the producer rank (`DumpProcess`: training runs).

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
at most `queue_bytes` (and MAX_QUEUED episodes) wait for it, and the writer appends every
MAX_PENDING episodes (dump_file.py) as well as every flush: a run that produces faster than
the writer compresses waits for it as it goes (the writer sets its pace), and its stop waits
for a backlog of at most those, a few seconds of the writer's work, not for everything a
flush interval and 256 MB hold (minutes of short episodes). A writer that fails (its error, sent
back), dies (the connection closes) or cannot be sent to makes the rank's next dump call
raise DumpError naming the file and why: a run never goes on without the dump it asked for
(all of it, or up to its share of run.dump_max_gib: dump_file.py)."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from hpcvla.metrics.dump import STEP_FIELDS, DumpError
from hpcvla.metrics.dump_file import DumpFile
from hpcvla.metrics.episode_metrics import FIELD as METRIC, metric_key
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
                 source: str = "run", start_version: int = 0, in_process: bool = True,
                 max_bytes: int = 0, fresh: bool = False):
        self.path, self.producer, self.obs_keys = Path(path), producer, list(obs_keys)
        self.vocab, self.shard_seed, self.flush_s = vocab, shard_seed, flush_s
        self.start_version = start_version
        self.open: dict[tuple[int, int], list[dict]] = {}  # (slot, env) -> step pieces
        self.episodes: dict[tuple[int, int], int] = Counter()
        self.file = (DumpFile if in_process else DumpProcess)(
            path, producer, source, env, chunk_len, config_yaml, max_bytes, fresh)
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
                     chunk_steps=group["chunk_steps"],
                     **{k: v for k, v in group.items() if k.startswith(METRIC)})
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
                 "env_steps": int(steps["chunk_steps"].sum()),
                 # the env's episode metrics (EnvSpec.episode_metrics): episode_<name>
                 **{metric_key(k.removeprefix(METRIC)): float(v[-1])
                    for k, v in steps.items() if k.startswith(METRIC)}}
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


MAX_QUEUED = 512  # episodes a rank hands over before the writer takes them in


class DumpProcess:
    """DumpFile's calls, run by a writer process (module docstring)."""

    def __init__(self, path, producer: int, source: str, env: str, chunk_len: int,
                 config_yaml: str, max_bytes: int = 0, fresh: bool = False,
                 queue_bytes: int = 256 << 20):
        self.path, self.producer, self.queue_bytes = Path(path), producer, queue_bytes
        self.remind_s = 60.0  # how often a producer held up by a full queue says so
        self._queue: list[tuple[tuple, int]] = []  # (message, bytes), oldest first
        self._queued_bytes, self._queued_episodes, self._failure = 0, 0, ""
        self._ready = threading.Condition()
        self._proc, self._conn = worker.start("hpcvla.metrics.dump_writer")
        try:
            self._conn.send(("open", str(path), producer, source, env, chunk_len, config_yaml,
                             max_bytes, fresh))
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
        waited = 0.0
        self._sender.join(self.remind_s)
        while self._sender.is_alive():  # the writer sets the pace
            waited += self.remind_s
            self._say_waited(waited, "to take in the rest of")
            self._sender.join(self.remind_s)
        self._raise_failure()
        self._answer()
        self._proc.wait()
        self._conn.close()

    def _put(self, message: tuple, nbytes: int) -> None:
        with self._ready:
            waited = 0.0
            episode = message[0] == "episode"
            while self._queue and not self._failure and (
                    self._queued_bytes + nbytes > self.queue_bytes or
                    episode and self._queued_episodes >= MAX_QUEUED):
                if not self._ready.wait(self.remind_s):  # the writer sets the pace
                    waited += self.remind_s
                    self._say_waited(waited, f"to take in {self._queued_bytes / 1e6:.0f} MB "
                                     "queued for")
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

    def _say_waited(self, waited: float, what: str) -> None:
        print(f"hpcvla: producer rank {self.producer} has waited {waited:.0f} s for its dump "
              f"writer (pid {self._proc.pid}) {what} {self.path} (a slow or hung file system; "
              "the rank's work waits with it)", file=sys.stderr, flush=True)

    def _answer(self):
        """The writer's answer to the request just sent (it opened or closed the file);
        DumpError if it failed or died."""
        waited = 0.0
        while not self._conn.poll(self.remind_s):  # an answer, or its end closed
            waited += self.remind_s
            self._say_waited(waited, "to open or finish")
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
