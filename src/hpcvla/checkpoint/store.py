"""Checkpoints: what the learners need to continue a run, as safetensors + JSON (never pickle).

    <run_dir>/checkpoints/v000120/          the state after policy version 120 was trained
        model.safetensors                   full weights (ZeRO-3 shards gathered): what
                                            inference, evaluation and other layouts load
        optimizer.rank<r>.safetensors       learner r's ranges of the fp32 master weights and
                                            optimizer moments, by parameter, + its torch RNG
        state.json                          version, counters, layout, the ranges each file
                                            holds, sha256 of every file

A checkpoint is written into `v000120.partial/` and renamed when complete, so a job killed
mid-write leaves no directory that looks finished. The optimizer state is stored by parameter
name and range (optimizer_state.py), not as ZeRO's flat partitions: any learner count and any
ZeRO stage resumes from it, each learner reading the ranges its new partition needs (a state
every learner holds whole, learner 0 reads and broadcasts); the resumed state equals the saved
one, re-partitioned. Weights are saved in the dtype the
learners train in (bf16 stays bf16: safetensors holds it, numpy could not); the fp32 masters a
bf16 learner steps are in the optimizer files, so a resumed run goes on from the exact masters.
On the same learner count each learner also gets its torch RNG back; the run after a resume is
not bit-identical to an unbroken one (the resumed world's ranks and envs draw new streams:
seeds.py, docs/outputs.md).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save_file as _save_file

from hpcvla.checkpoint import optimizer_state
from hpcvla.checkpoint.catalog import (CHECKPOINT_NAME, FORMAT, MODEL, STATE, CheckpointError,
                                      checkpoint_dir, complete, read_state, remove, sealed,
                                      sha256, verify_file)
from hpcvla.checkpoint.optimizer_state import MASTER
from hpcvla.files import replace_text
from hpcvla.transport.backoff import idle_barrier, wait_until


def save(run_dir: Path, engine, weights: dict[str, torch.Tensor] | None, version: int,
         counters: dict, learners, keep: int = 2) -> Path | None:
    """A checkpoint, written before this returns. Collective on the learner communicator;
    returns the directory on learner 0."""
    return Writer().save(run_dir, engine, weights, version, counters, learners, keep,
                         wait=True)


class Writer:
    """Checkpoints written in the background. `save` takes the snapshot, collective on the
    learners: each copies its optimizer ranges (and learner 0 the full weights) to host
    memory, which is all training waits for. A thread then writes the files and checksums
    them; learner 0's thread, once every learner's file is on disk, writes state.json and
    renames the directory into place. One checkpoint is in flight at most: `save` and `wait`
    first wait for the one before, and raise what its writing raised. With `background`
    false (learner.checkpoint_background), or `save(..., wait=True)` (a run's last), `save`
    returns only once the files are written, and they are written straight from the state
    where it is already in host memory (a CPU learner's): nothing changes it meanwhile, so
    there is no snapshot to take."""

    def __init__(self, background: bool = True):
        self.background = background
        self._thread: threading.Thread | None = None
        self._outcome: list = [None, None]  # [directory, exception]
        self._final: Path | None = None  # the checkpoint being written

    def save(self, run_dir: Path, engine, weights: dict[str, torch.Tensor] | None,
             version: int, counters: dict, learners, keep: int,
             wait: bool = False) -> Path | None:
        """`weights`: the full state, from learner 0 (None elsewhere); `wait`: return once
        it is written, with `wait()`'s answer (else None)."""
        wait = wait or not self.background
        self.wait()
        rank, size = learners.Get_rank(), learners.Get_size()
        final = checkpoint_dir(run_dir, version)
        partial = final.with_name(final.name + ".partial")
        self._final = final
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        idle_barrier(learners)  # [dist] the directory exists before anyone writes into it
        parts = optimizer_state.fragments(engine, rank)
        optimizer_state.replicas_agree(parts, learners)  # [dist] learner 0 saves for all
        tensors, mine = _optimizer_snapshot(parts, rank, copy=not wait)
        state = None
        if rank == 0:  # a copy of its own where they are the parameters (engines.full_state)
            shared = engine.device.type == "cpu" and engine.zero_optimization_stage() < 3
            tensors[MODEL] = {k: (v.detach().clone() if shared and not wait else v).contiguous()
                              for k, v in weights.items()}
            state = {"format": FORMAT, "version": version, "counters": counters,
                     "learners": size, "zero_stage": engine.zero_optimization_stage()}
        self._thread = threading.Thread(
            target=self._write, args=(partial, final, rank, size, tensors, mine, state, keep),
            name=f"checkpoint v{version}", daemon=True)
        self._thread.start()
        return self.wait() if wait else None

    def check(self) -> None:
        """Raise what a background write that has ended raised, without waiting for one that
        has not: called at every version, a failed checkpoint stops the run within a version
        or two, not at the next one due (learner.checkpoint_every versions of training that
        no checkpoint would keep)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> Path | None:
        """Wait for the checkpoint in flight; its directory on learner 0 (else None)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        final, error = self._outcome
        self._outcome = [None, None]
        if error is not None:  # the newest complete checkpoint stays as it was
            raise CheckpointError(f"writing checkpoint {self._final} failed: {error!r} (a "
                                  "run needs room for learner.checkpoint_keep + 1 "
                                  "checkpoints: the oldest goes after the new one is "
                                  "whole)") from error
        return final

    def _write(self, partial, final, rank, size, tensors, mine, state, keep):
        try:
            model = tensors.pop(MODEL, None)
            save_file(tensors, partial / mine["file"])
            _fsync(partial / mine["file"])  # by its writer: another node's fsync (learner 0
            # publishing) does not flush this node's pages of a shared file system
            mine["sha256"] = sha256(partial / mine["file"])
            replace_text(partial / _sidecar(rank), json.dumps(mine))  # read by learner 0
            if rank == 0:
                save_file(model, partial / MODEL)
                state["model_sha256"] = sha256(partial / MODEL)
                state["optimizer"] = [_await_json(partial / _sidecar(r)) for r in range(size)]
                _publish(partial, final, state, size, keep)
                self._outcome[0] = final
        except Exception as err:  # raised in the training thread by wait()
            self._outcome[1] = err


def _optimizer_snapshot(parts, rank: int, copy: bool = True
                       ) -> tuple[dict[str, torch.Tensor], dict]:
    """This learner's optimizer ranges (`parts`: its fragments) and RNG as host tensors, and
    their index; `copy`: host tensors of their own (a device's are anyway), not the state's
    own memory, which training goes on changing. torch creates a parameter's Adam state at
    its first step with a gradient: a fragment without one yet is saved at step 0 with zero
    moments, the state torch would create; with no step taken at all (SAC before
    `learning_starts`) there are no moments to save (`keys` empty), and load_optimizer
    leaves the optimizer as torch makes it."""
    tensors, fragments, steps = {}, {}, {}
    parts = [f for f in parts if not (f.replicated and rank != 0)]
    keys = next(([k for k, v in state.items() if k != "step" and torch.is_tensor(v)]
                 for state in (f.state() for f in parts) if "step" in state), [])

    def host(tensor: torch.Tensor) -> torch.Tensor:  # a copy only where `out` is the state
        out = tensor.float().cpu()
        return (out.clone() if copy and out.data_ptr() == tensor.data_ptr() else out) \
            .contiguous()

    for fragment in parts:
        state = fragment.state()
        master = host(fragment.tensor(MASTER))
        tensors[f"{fragment.name}/{MASTER}"] = master
        for key in keys:
            tensors[f"{fragment.name}/{key}"] = host(fragment.tensor(key)) \
                if "step" in state else torch.zeros_like(master)
        fragments[fragment.name] = [fragment.start, fragment.numel]
        steps[fragment.name] = float(state["step"]) if "step" in state else 0.0
    tensors["rng.torch_cpu"] = torch.get_rng_state()
    return tensors, {"file": f"optimizer.rank{rank}.safetensors", "fragments": fragments,
                     "steps": steps, "keys": keys}


def _publish(partial: Path, final: Path, state: dict, learners: int, keep: int) -> None:
    """state.json, then the rename that makes the checkpoint exist, completely or not at
    all; the oldest beyond `keep` go, and an ended world's unfinished ones of older versions
    (a start removes them where the run's .lock holds: not on a file system without locks,
    where a job killed in each stop's checkpoint left tens of GB each at full size)."""
    for r in range(learners):
        (partial / _sidecar(r)).unlink()
    (partial / STATE).write_text(json.dumps(sealed(state), indent=1))
    _fsync_dir(partial)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    _fsync(final.parent)  # the rename is on disk before an older checkpoint goes
    for old in complete(final.parent.parent)[:-keep]:
        remove(old)
    for unfinished in final.parent.glob("v*.partial"):
        name = unfinished.name.removesuffix(".partial")  # (not a copy's, as complete())
        if CHECKPOINT_NAME.fullmatch(name) and int(name[1:]) < int(final.name[1:]):
            remove(unfinished)


def _sidecar(rank: int) -> str:
    """Where learner `rank` says its optimizer file is written (name, sha256, ranges)."""
    return f"optimizer.rank{rank}.json"


def _await_json(path: Path, remind_s: float = 60.0):
    """A learner's sidecar, once it is there: looked for in its folder's listing, which makes
    an NFS client revalidate the folder, not by stat, which trusts a cached "no such file"
    for up to a minute. A learner that fails takes the world down; a slow one is named every
    `remind_s`."""
    wait_until(lambda: path.name in os.listdir(path.parent), str(path), cap=0.2,
               remind=(remind_s, lambda waited: f"[hpcvla] learner 0 has waited {waited:.0f} "
                       f"s for {path} (another learner's optimizer file, being written)"))
    return json.loads(path.read_text())


def load_weights(path: Path, expected: dict | None = None, may_lack=frozenset()
                 ) -> dict[str, torch.Tensor]:
    """model.safetensors of a checkpoint, its checksum verified; with `expected` (a state
    dict), names and shapes must match it, but for the names in `may_lack` it may not hold."""
    path = Path(path)
    state = read_state(path)
    verify_file(path / MODEL, state["model_sha256"])
    weights = load_file(str(path / MODEL))
    if expected is not None:
        check_fit(weights, expected, path / MODEL, may_lack)
    return weights


def save_file(tensors: dict, path, metadata: dict | None = None) -> None:
    """safetensors' save_file, the file then given the mode any new file gets there:
    safetensors writes 0600, so a checkpoint or an exported policy on a shared file system
    was readable by its owner alone."""
    _save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, _new_file_mode(Path(path).parent))


def _new_file_mode(folder: Path) -> int:
    """The mode a file created in `folder` gets, from a probe created there: the umask's, or
    where the folder has a default ACL (a project space's grant to its group) the ACL's,
    which the umask does not narrow and a chmod to the umask's mode did."""
    # named by host too: learners on several nodes probe one shared folder, and their pids
    # and thread ids may coincide
    probe = folder / f".mode-probe.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()


def check_fit(weights: dict, expected: dict, source, may_lack=frozenset()) -> None:
    """A whole checkpoint's `weights` must have the names and shapes of `expected` (the state
    dict of the policy they go into), but for absent names in `may_lack`; `source` names them
    in the error."""
    want = {k: tuple(v.shape) for k, v in expected.items()
            if k in weights or k not in may_lack}
    have = {k: tuple(v.shape) for k, v in weights.items()}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))[:6]
        raise CheckpointError(f"{source}: weights do not fit this policy (name, shape) "
                              f"differences: {diff}; was it written with another policy "
                              "config?")


def load_optimizer(path: Path, engine, learners) -> dict:
    """Restore this learner's optimizer state, in this run's layout (any learner count, any
    ZeRO stage), and, on the same learner count, its RNG; returns state.json. Call after the
    engine is built on a model that already holds the checkpoint's weights."""
    state = read_state(path)
    if state["format"] == 1:
        raise CheckpointError(f"{path}: format 1 (an older hpcvla) holds the "
                              f"optimizer state as ZeRO's flat partitions, which this one "
                              f"does not resume; start a run from its weights instead "
                              f"(policy.checkpoint={path})")
    rank, saved = learners.Get_rank(), state["optimizer"]
    reader = _FragmentReader(Path(path), saved)
    if reader.keys:  # else saved before any step: the optimizer stays as torch makes it
        optimizer_state.ensure_state(engine, reader.keys)
    for fragment in optimizer_state.fragments(engine, rank):
        for key in (MASTER, *reader.keys):
            fragment.write(key, _saved_values(reader, fragment, key, learners))
        if reader.keys:
            fragment.state()["step"].fill_(reader.step(fragment.name))
    if state["learners"] == learners.Get_size():  # else each learner keeps its seeded stream
        torch.set_rng_state(reader.tensor(saved[rank], "rng.torch_cpu"))
    return state


def _saved_values(reader: _FragmentReader, fragment, key: str, learners) -> torch.Tensor:
    """A fragment's saved `key` values. A replicated one (stage 0, Horovod: every learner
    holds the same whole state) learner 0 alone reads and broadcasts: one read and one
    checksum of the files for the learners, not one each (π0's fp32 masters and moments:
    39 GB)."""
    if not fragment.replicated or learners.Get_size() == 1:
        return reader.read(fragment.name, key, fragment.start, fragment.numel)
    from hpcvla.transport.pieces import bcast  # mpi4py, here: importing it starts MPI
    value = (reader.read(fragment.name, key, fragment.start, fragment.numel)
             if learners.Get_rank() == 0 else torch.empty(fragment.numel, dtype=torch.float32))
    bcast(learners, value.numpy().view(np.uint8))  # [dist]
    return value


class _FragmentReader:
    """The saved fragments of every learner, by parameter name: assembles any range of a
    parameter from whichever saved ranges overlap it (files checksummed when first read)."""

    def __init__(self, path: Path, saved: list[dict]):
        self.path, self.files = path, {}
        self.keys = next((entry["keys"] for entry in saved if entry["keys"]), [])
        self.ranges: dict[str, list] = {}
        for entry in saved:
            for name, (start, numel) in entry["fragments"].items():
                self.ranges.setdefault(name, []).append((entry, start, numel))

    def tensor(self, entry: dict, key: str, lo: int = 0, hi: int | None = None):
        if entry["file"] not in self.files:
            verify_file(self.path / entry["file"], entry["sha256"])
            self.files[entry["file"]] = safe_open(str(self.path / entry["file"]), "pt")
        whole = self.files[entry["file"]].get_slice(key)
        return whole[lo:hi] if hi is not None else whole[:]

    def read(self, name: str, key: str, start: int, numel: int) -> torch.Tensor:
        out, covered = torch.empty(numel, dtype=torch.float32), 0
        for entry, first, count in self.ranges.get(name, []):
            lo, hi = max(start, first), min(start + numel, first + count)
            if lo < hi:
                out[lo - start:hi - start] = self.tensor(entry, f"{name}/{key}",
                                                         lo - first, hi - first)
                covered += hi - lo
        if covered != numel:
            raise CheckpointError(f"{self.path}: the optimizer state of {name} covers "
                                  f"{covered} of the {numel} values this learner needs from "
                                  f"offset {start}; was it written with another policy config?")
        return out

    def step(self, name: str) -> float:
        steps = {entry["steps"][name] for entry, _, _ in self.ranges.get(name, [])}
        if len(steps) != 1:
            raise CheckpointError(f"{self.path}: optimizer steps {sorted(steps)} for {name}; "
                                  f"the file is damaged")
        return steps.pop()


def _fsync_dir(path: Path) -> None:
    """Every file of the directory `path`, then the directory itself, on disk."""
    for item in [*path.iterdir(), path]:
        _fsync(item)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
