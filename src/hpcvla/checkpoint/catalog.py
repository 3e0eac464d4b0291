"""Where a run's checkpoints are and what each one says: the directory layout, the newest
complete one, its state.json checked, its files' checksums. JSON and file names only, no
tensors: a simulator rank that asks which version a run resumes from imports no torch
(reading and writing the tensors: store.py)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from hpcvla.schedule import micro_batches_for

# 1: optimizer state as ZeRO's flat partitions (its weights still load); 2: by parameter
# name; 3: as 2, state.json sealed (its sha256 required: a damaged key name cannot drop it)
FORMAT = 3
READABLE = (1, 2, 3)
SEALED_FROM = 3
MODEL = "model.safetensors"
STATE = "state.json"
STATE_KEYS = ("format", "version", "counters", "learners", "zero_stage", "model_sha256",
              "optimizer")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupted or made for another layout."""


class RunInUse(CheckpointError):
    """A run directory another world holds (hold_run); `holder`: its .lock's record."""

    def __init__(self, message: str, holder: str = ""):
        super().__init__(message)
        self.holder = holder

    def by_this_job(self) -> bool:
        """Whether the holder is a world of this same job (its id in the record): an
        earlier world whose rank 0's node died, its lock not yet let go by the file system."""
        mark = _job_mark()  # whole: job 42's is no mark of job 4242's record
        return bool(mark) and re.search(re.escape(mark) + r"(?=[ ,]|$)", self.holder) is not None


def _job_mark() -> str:
    """This process's scheduler job as a .lock record names it (", job <id>"); '' outside
    a job."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID")
    return f", job {job}" if job else ""


def checkpoint_dir(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"v{version:06d}"


CHECKPOINT_NAME = re.compile(r"v\d{6,}")  # checkpoint_dir's names: not v000004.partial, .old


def complete(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run directory, oldest first."""
    found = [p for p in (Path(run_dir) / "checkpoints").glob("v[0-9]*")
             if CHECKPOINT_NAME.fullmatch(p.name) and (p / STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name[1:]))


SFT_COUNTER = "sft_chunks"  # the counter only `hpcvla sft` checkpoints have


def by_sft(path: Path) -> bool:
    """Whether the checkpoint directory `path` was written by `hpcvla sft`."""
    return SFT_COUNTER in read_state(path)["counters"]


# what a run without a complete checkpoint is, and what is left to do with it
NONE_WRITTEN = ("a run writes one every learner.checkpoint_every versions or "
                "learner.checkpoint_every_s (sft: sft.checkpoint_every steps), at its end and "
                "when stopped: one that died before its first has none (its metrics.jsonl "
                "says how far it got); start it again, and `hpcvla eval RUN --untrained` "
                "measures its start")


def latest(path: Path) -> Path | None:
    """The newest complete checkpoint in a run directory (or `path` itself if it is one)."""
    path = Path(path)
    if (path / STATE).is_file():
        return path
    done = complete(path)
    return done[-1] if done else None


def run_and_checkpoint(path: Path) -> tuple[Path, Path | None]:
    """What a command given `path` reads: a complete checkpoint (RUN_DIR/checkpoints/v*/) is
    that checkpoint of its run, whose config.yaml is two levels up; any other path is a run
    directory and names no checkpoint of its own."""
    path = Path(path)
    if path.parent.name == "checkpoints" and path in complete(path.parent.parent):
        return path.parent.parent, path
    return path, None


def path_problem(path: Path) -> str | None:
    """What is wrong with the run directory or checkpoint a command (eval, export) was given,
    or None."""
    path = Path(path)
    if path.parent.name == "checkpoints":
        kept = complete(path.parent.parent)
        if path not in kept:
            return (f"{path} is not a complete checkpoint of its run (kept there: "
                    f"{', '.join(p.name for p in kept) or 'none'}; a checkpoint is v and its "
                    "version in 6 digits, v000500)")
    if path.is_file():  # a config file, say: eval and export take what a run wrote
        return (f"{path} is a file, not a run directory: give the run directory `hpcvla "
                "train` printed at its end (runs/<name>-<time>), or one of its checkpoints")
    if not path.is_dir():
        return f"{path}: no such directory (give a run directory, or one of its checkpoints)"
    run, _ = run_and_checkpoint(path)
    if path.name == "checkpoints" and (path.parent / "config.yaml").is_file():
        return (f"{path} is a run's folder of checkpoints: give the run ({path.parent}), or "
                "one checkpoint in it")
    if not (run / "config.yaml").is_file():
        return f"{run} is not a run directory (no config.yaml)"
    return None


def resume_problems(resume: str, sft: bool, last: tuple[str, int]) -> list[tuple[str, Any, str]]:
    """What stops a run resuming from `resume` (run.resume), as (field, value, what is
    valid): `sft`, whether `hpcvla sft` resumes it (else `train`); `last` (its setting, value),
    the version the resumed run is to reach."""
    run, checkpoint = run_and_checkpoint(Path(resume))
    if checkpoint is not None:  # the run would be written inside the checkpoint
        return [("run.resume", resume, f"a run directory ({run}), not one of its checkpoints: "
                 "a run resumes from its newest; to go back to an older one, move the newer "
                 "ones out of its checkpoints/ first")]
    effective = os.access in os.supports_effective_ids  # (a job run under another uid)
    if run.is_dir() and not os.access(run, os.W_OK | os.X_OK, effective_ids=effective):
        return [("run.resume", resume, f"a run directory this user can write in ({run} is "
                 "not: another user's run? copy it, `cp -r RUN <a folder of yours>`, and "
                 "resume the copy)")]
    path = latest(resume)
    try:
        version = read_state(path)["version"] if path else None
    except CheckpointError as err:
        return [("run.resume", resume, f"a readable checkpoint: {err}")]
    if version is None:
        return [("run.resume", resume, "a run directory holding a complete checkpoint "
                 f"(checkpoints/v*/state.json; {NONE_WRITTEN})")]
    if path is not None and by_sft(path) != sft:
        wanted, found = ("an `hpcvla sft` run's", "a training run's") if sft else \
            ("a training run's", "an `hpcvla sft` run's")
        return [("run.resume", resume, f"{wanted} directory (this is {found}); to start "
                 "from its weights: policy.checkpoint=<it>")]
    if version >= last[1]:
        return [(last[0], last[1], f"more than the resumed checkpoint's {version}")]
    return []


def sealed(state: dict) -> dict:
    """`state` with its own checksum: `sha256` of the rest as canonical JSON, so a counter, an
    Adam step or a range flipped in state.json is caught where it is read (read_state)."""
    body = {k: v for k, v in state.items() if k != "sha256"}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return {**body, "sha256": digest}


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path / STATE}: {what}; the file is damaged (move this checkpoint "
                           f"out of {path.parent}: the one before it is then the newest)")


def read_state(path: Path) -> dict:
    """state.json of a checkpoint directory, checked; raises CheckpointError naming what is
    wrong."""
    path = Path(path)
    try:
        state = json.loads((path / STATE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {STATE}; not a complete hpcvla checkpoint") from None
    except ValueError as err:  # JSON syntax, or bytes that are not even UTF-8
        raise CheckpointError(f"{path / STATE}: not valid JSON ({err})") from None
    found = state.get("format") if isinstance(state, dict) else type(state).__name__
    if isinstance(found, int) and found > max(READABLE) and \
            sealed(state).get("sha256") == state.get("sha256"):  # intact, not a flipped digit
        raise CheckpointError(f"{path / STATE}: format {found}, written by a newer hpcvla; "
                              f"this one reads formats {', '.join(map(str, READABLE))}")
    if found not in READABLE:
        raise _damaged(path, f"format {found!r}, none this hpcvla wrote")
    if "sha256" not in state and state["format"] >= SEALED_FROM:
        raise _damaged(path, f"lacks its sha256 (format {state['format']} seals it)")
    if "sha256" in state and sealed(state)["sha256"] != state["sha256"]:
        raise _damaged(path, "its contents do not match its sha256")
    missing = sorted(set(STATE_KEYS) - set(state))
    if missing:
        raise _damaged(path, f"lacks {', '.join(missing)}")
    if CHECKPOINT_NAME.fullmatch(path.name) and state["version"] != int(path.name[1:]):
        raise _damaged(path, f"version {state['version']!r} in a checkpoint named "
                       f"{path.name}")
    bad = [entry for entry in state["optimizer"] if not isinstance(entry, dict)
           or not {"file", "sha256"} <= set(entry)]
    if bad:
        raise _damaged(path, f"optimizer entries without file and sha256 ({bad[0]!r})")
    for name in [MODEL, *(entry["file"] for entry in state["optimizer"])]:
        whole(path / name)  # cheap here; contents are checked when loaded
    return state


def whole(path: Path) -> None:
    """Raise CheckpointError unless the safetensors file `path` is there and as long as its
    header says: a file cut short (a copy or a disk that filled) is found from its header
    alone, in milliseconds at any size, before a world starts (a changed byte: sha256, where
    it is loaded)."""
    from safetensors import SafetensorError, safe_open  # no torch: framework numpy
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
    try:
        with safe_open(path, "numpy"):
            pass
    except SafetensorError as err:
        raise CheckpointError(f"{path}: {path.stat().st_size:,} bytes that do not match its "
                              f"header ({err}): the file is cut short or damaged (move "
                              f"{path.parent.name} out of {path.parent.parent}: the one "
                              "before it is then the newest)") from None


def verify(path: Path) -> dict:
    """state.json of a checkpoint, every file's sha256 checked; raises CheckpointError."""
    state = read_state(path)
    for name, expected in [(MODEL, state["model_sha256"]),
                           *((e["file"], e["sha256"]) for e in state["optimizer"])]:
        verify_file(Path(path) / name, expected)
    return state


def layout_change(state: dict, learners: int, zero_stage: int) -> str:
    """How a resume moves the optimizer state, for the log: 'same layout' or what changes."""
    if (state["learners"], state["zero_stage"]) == (learners, zero_stage):
        return f"same layout: {learners} learners at ZeRO-{zero_stage}"
    return (f"written by {state['learners']} learners at ZeRO-{state['zero_stage']}, "
            f"re-partitioned onto {learners} at ZeRO-{zero_stage}")


BATCH_NAMES = {  # the command's counter of a step's batch, its unit and its two settings
    "train": ("version_segments", "a version", "segments", "learner.micro_batch",
              "learner.micro_batches"),
    "sft": ("step_chunks", "a step", "chunks", "sft.batch_size", "sft.micro_batches")}


def batch_change(state: dict, learners: int, micro_batch: int, micro_batches: int,
                 command: str = "train") -> str | None:
    """What a resume changes of a version's batch (train's `version_segments`, the segments
    all learners train a version; sft's `step_chunks`, which checkpoints record), for the log:
    None where nothing does, or the checkpoint predates the record. A restart on fewer
    learners raised the micro-batches to keep it; a later start on more, from the run's last
    config, would train a larger batch without this line."""
    counter, per, unit, each, passes = BATCH_NAMES[command]
    then = state.get("counters", {}).get(counter)
    now = learners * micro_batch * micro_batches
    if then is None or then == now:
        return None
    keep = micro_batches_for(then, learners, micro_batch)
    return (f"{per} now trains {now} {unit} ({learners} learner(s) x {each} {micro_batch} x "
            f"{passes.partition('.')[2]} {micro_batches}), the run's checkpoint {then}"
            + (f": {passes}={keep} keeps it" if keep else ""))


def sha256(path: Path) -> str:
    """The hex sha256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_file(path: Path, expected: str) -> None:
    """Raise CheckpointError unless `path` exists with the sha256 `expected`."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
    if sha256(path) != expected:
        raise CheckpointError(f"{path}: checksum mismatch; the file is corrupted (move "
                              f"{path.parent.name} out of {path.parent.parent}: the one "
                              "before it is then the newest)")


_held: list = []  # the run directory's lock, held for the life of the process


def remove(folder: Path) -> None:
    """Delete a checkpoint (or an unfinished one) that is no longer kept, saying so where it
    cannot be deleted whole (a file another user wrote into a group's run, NFS's `.nfs*` of a
    file still open): what is left has no state.json, is never tried again, and holds its
    space (tens of GB at full size) unseen."""
    import sys
    failed: list[str] = []

    def failed_at(_, path, error) -> None:  # an exception (onexc), or its exc_info (onerror)
        error = error[1] if isinstance(error, tuple) else error
        if not isinstance(error, FileNotFoundError):  # gone already: what was wanted
            failed.append(f"{path}: {error}")
    shutil.rmtree(folder, **{"onexc" if sys.version_info >= (3, 12) else "onerror": failed_at})
    if failed:
        print(f"[hpcvla] {folder} could not be deleted whole ({failed[0]}; {len(failed)} "
              "failures): what is left holds its disk space; delete it yourself",
              file=sys.stderr, flush=True)


def _holder() -> str:
    """Who holds a run's .lock, as its file says: the process, its host and its job."""
    import socket
    import time
    restart = os.environ.get("SLURM_RESTART_COUNT")
    return (f"pid {os.getpid()} on {socket.gethostname()}" + _job_mark() +
            (f" (restart {restart})" if restart else "") +
            time.strftime(", since %Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "\n")


def hold_run(run_dir: Path, wait_s: float = 150.0) -> None:
    """Rank 0's claim on the run directory for the life of the world: an exclusive lock on
    RUN_DIR/.lock (released by the kernel however the process ends), so a second world
    resuming the same run is refused (two would interleave their checkpoints and wait on
    each other's files); then the `.partial` checkpoints an ended world left go. A lock
    still held is waited for up to `wait_s`: a node that died holding it keeps it on a
    network file system until the server's lease ends (NFSv4: 90 s), which a restart on the
    nodes left must outwait. A file system without locks leaves the run unclaimed. The holder
    writes who it is into the file (host, pid, job): the one refused is told whose it is."""
    import fcntl
    import sys
    import time
    lock = Path(run_dir) / ".lock"
    handle = open(lock, "a")
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = lock.read_text().strip() or "who, it did not say"
            if time.monotonic() > deadline:
                handle.close()
                raise RunInUse(
                    f"{run_dir} is in use: another world's rank 0 holds its .lock ({holder}; "
                    "two worlds writing one run would mix their checkpoints): wait for that "
                    "job to end. If it has ended (squeue/qstat: a node that died holding "
                    "the lock, which NFSv3 keeps until that node restarts), `mv "
                    f"{lock} {lock}.stale` and start again", holder=holder) from None
            if not said:
                print(f"[hpcvla] waiting up to {wait_s:.0f} s for {lock} ({holder}): another "
                      "world holds it, or a dead node whose lock the file server has not "
                      "released yet", file=sys.stderr, flush=True)
                said = True
            time.sleep(1.0)
        except OSError:  # no locks on this file system (Lustre without -o flock)
            handle.close()
            left = sorted((Path(run_dir) / "checkpoints").glob("v*.partial"))
            print(f"[hpcvla] {run_dir}: its file system takes no locks (Lustre without -o "
                  "flock), so this world does not claim the run: start one world at a time "
                  "on it" + (f"; the unfinished checkpoints an ended world left stay until "
                             "this one publishes a newer checkpoint (another world may be "
                             f"writing them): {', '.join(p.name for p in left)}"
                             if left else ""), file=sys.stderr, flush=True)
            return
    _held.append(handle)
    handle.truncate(0)
    handle.write(_holder())
    handle.flush()
    os.fsync(handle.fileno())  # another node's world reads it
    for partial in (Path(run_dir) / "checkpoints").glob("v*.partial"):
        remove(partial)
