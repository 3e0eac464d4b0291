"""Checkpoints: what the learners need to continue a run, as safetensors + JSON (never pickle).

    <run_dir>/checkpoints/v000120/          the state after policy version 120 was trained
        model.safetensors                   full weights (ZeRO-3 shards gathered): what
                                            inference, evaluation and other layouts load
        optimizer.rank<r>.safetensors       learner r's optimizer partition + its torch RNG
        state.json                          version, counters, layout, sha256 of every file

A checkpoint is written into `v000120.partial/` and renamed when complete, so a job killed
mid-write leaves no directory that looks finished. Optimizer partitions are saved as the
torch optimizer under DeepSpeed holds them (ZeRO's flat fp32 partitions): restoring them needs
the same number of learners and ZeRO stage; the weights alone restore anywhere. Weights are
saved in the dtype the learners train in (bf16 stays bf16: safetensors holds it, numpy could
not). A bf16 learner's optimizer keeps fp32 master weights, which the bf16 weights only
round: they go into its optimizer file too (`master.<group>.<i>`), so a resumed run goes on
from the exact masters.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hpcvla.transport.backoff import idle_barrier

FORMAT = 1
MODEL = "model.safetensors"
STATE = "state.json"
STATE_KEYS = ("format", "version", "counters", "learners", "zero_stage", "model_sha256",
              "optimizer")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupted or made for another layout."""


def checkpoint_dir(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"v{version:06d}"


def complete(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run directory, oldest first."""
    return sorted(p for p in (Path(run_dir) / "checkpoints").glob("v[0-9]*")
                  if p.suffix != ".partial" and (p / STATE).is_file())


def latest(path: Path) -> Path | None:
    """The newest complete checkpoint in a run directory (or `path` itself if it is one)."""
    path = Path(path)
    if (path / STATE).is_file():
        return path
    done = complete(path)
    return done[-1] if done else None


def save(run_dir: Path, engine, weights: dict[str, torch.Tensor] | None, version: int,
         counters: dict, learners, keep: int = 2) -> Path | None:
    """Collective on the learner communicator. `weights` (the full state, from learner 0)
    go to model.safetensors; every learner writes its optimizer partition. Returns the
    checkpoint directory on learner 0. Keeps the newest `keep` checkpoints."""
    rank = learners.Get_rank()
    final = checkpoint_dir(run_dir, version)
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    idle_barrier(learners)  # [dist] a blocking barrier spins while learner 0 writes
    tensors, groups = _optimizer_tensors(engine)
    tensors["rng.torch_cpu"] = torch.get_rng_state()
    name = f"optimizer.rank{rank}.safetensors"
    save_file(tensors, str(partial / name))
    mine = {"file": name, "sha256": _sha256(partial / name), "param_groups": groups}
    everyone = learners.gather(mine, root=0)  # [dist]
    if rank != 0:
        idle_barrier(learners)  # [dist]
        return None
    save_file({k: torch.as_tensor(v).contiguous() for k, v in weights.items()},
              str(partial / MODEL))
    state = {"format": FORMAT, "version": version, "counters": counters,
             "learners": learners.Get_size(), "zero_stage": engine.zero_optimization_stage(),
             "model_sha256": _sha256(partial / MODEL), "optimizer": everyone}
    (partial / STATE).write_text(json.dumps(state, indent=1))
    _fsync_dir(partial)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)  # the checkpoint exists completely or not at all
    for old in sorted(p for p in final.parent.glob("v[0-9]*") if p.suffix != ".partial")[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    idle_barrier(learners)  # [dist]
    return final


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
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path / STATE}: format {found!r}, this hpcvla "
                              f"reads format {FORMAT}")
    missing = sorted(set(STATE_KEYS) - set(state))
    if missing:
        raise CheckpointError(f"{path / STATE}: lacks {', '.join(missing)}; the file is "
                              f"damaged (use an older checkpoint in {path.parent})")
    for name in [MODEL, *(entry["file"] for entry in state["optimizer"])]:
        if not (path / name).is_file():  # cheap here; contents are checked when loaded
            raise CheckpointError(f"{path / name}: missing; the checkpoint is incomplete")
    return state


def load_weights(path: Path, expected: dict | None = None) -> dict[str, torch.Tensor]:
    """model.safetensors of a checkpoint, its checksum verified; with `expected` (a state
    dict), names and shapes must match it."""
    path = Path(path)
    state = read_state(path)
    _verify(path / MODEL, state["model_sha256"])
    weights = load_file(str(path / MODEL))
    if expected is not None:
        want = {k: tuple(v.shape) for k, v in expected.items()}
        have = {k: tuple(v.shape) for k, v in weights.items()}
        if want != have:
            diff = sorted(set(want.items()) ^ set(have.items()))[:6]
            raise CheckpointError(f"{path / MODEL}: weights do not fit this policy (name, "
                                  f"shape) differences: {diff}; was it written with another "
                                  f"policy config?")
    return weights


def load_optimizer(path: Path, engine, learners) -> dict:
    """Restore this learner's optimizer partition and RNG; returns state.json. Call after
    `deepspeed.initialize` on a model that already holds the checkpoint's weights."""
    state = read_state(path)
    if state["learners"] != learners.Get_size() or \
            state["zero_stage"] != engine.zero_optimization_stage():
        raise CheckpointError(
            f"{path}: written by {state['learners']} learners at ZeRO stage "
            f"{state['zero_stage']}, this run has {learners.Get_size()} at stage "
            f"{engine.zero_optimization_stage()}; resume with the same learner layout and "
            f"learner.zero_stage")
    mine = state["optimizer"][learners.Get_rank()]
    _verify(Path(path) / mine["file"], mine["sha256"])
    tensors = load_file(str(Path(path) / mine["file"]))
    torch.set_rng_state(tensors.pop("rng.torch_cpu"))
    per_param: dict[int, dict] = {}
    masters = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("master.")]}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        per_param.setdefault(int(index), {})[name] = value
    with _base_optimizer(engine) as optimizer:
        optimizer.load_state_dict({"state": per_param, "param_groups": mine["param_groups"]})
        with torch.no_grad():
            for key, master in _masters(optimizer, bool(masters)).items():
                master.copy_(masters[key])
    return state


@contextmanager
def _base_optimizer(engine):
    """The torch optimizer itself (ZeRO wraps it; stage 0 hands it over as is). ZeRO-3 lends
    it its fp32 partitions only during a step; they are put in place meanwhile, as
    DeepSpeed's own (pickle) checkpoints do."""
    zero = engine.optimizer
    stage3 = hasattr(zero, "_set_fp32_optimizer_param_groups")
    if stage3:
        zero._set_fp32_optimizer_param_groups()
    try:
        yield getattr(zero, "optimizer", zero)
    finally:
        if stage3:
            zero._clear_fp32_optimizer_param_groups()


def _optimizer_tensors(engine) -> tuple[dict[str, torch.Tensor], list]:
    mixed = engine.bfloat16_enabled() or engine.fp16_enabled()
    with _base_optimizer(engine) as optimizer:
        sd = optimizer.state_dict()
        tensors = {k: v.detach().cpu().clone() for k, v in _masters(optimizer, mixed).items()}
    tensors.update({f"state.{index}.{name}": value.detach().cpu().contiguous()
                    for index, entry in sd["state"].items() for name, value in entry.items()})
    return tensors, sd["param_groups"]


def _masters(optimizer, mixed: bool) -> dict[str, torch.Tensor]:
    """The fp32 master weights a mixed-precision learner's torch optimizer steps (under
    DeepSpeed its parameters are them), by `master.<group>.<i>`; none for fp32 training,
    where the model's weights are the masters."""
    if not mixed:
        return {}
    return {f"master.{g}.{i}": p for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _verify(path: Path, sha256: str) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
    if _sha256(path) != sha256:
        raise CheckpointError(f"{path}: checksum mismatch; the file is corrupted (use an "
                              f"older checkpoint in {path.parent.parent})")


def _fsync_dir(path: Path) -> None:
    for item in [*path.iterdir(), path]:
        fd = os.open(item, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
