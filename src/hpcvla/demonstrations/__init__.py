"""Demonstrations for supervised fine-tuning: HDF5 files of three layouts and LeRobot dataset
folders read into one set of (observation, action chunk) samples shaped by an env's EnvSpec.

Layouts, told apart by what the file or folder holds (each module documents its layout, where
it is written, and how the env's fields are made from it):

* hpcvla_dump.py: this project's trajectory dumps and `hpcvla demos` files (root attribute
  format = metrics.dump.FORMAT), one row per action chunk;
* libero.py: LIBERO's `<task>_demo.hdf5` (scripts/create_dataset.py; /data attribute
  problem_info), one row per primitive step;
* maniskill.py: ManiSkill3 `RecordEpisode` files (traj_<i> groups and the sibling .json), one
  row per primitive step;
* lerobot.py: a LeRobot dataset's folder (meta/info.json, parquet, mp4), formats v2.x and
  v3.0, one row per primitive step (frame).

Per-step layouts give one sample per step: its observation and the chunk of spec.chunk_len
actions the demonstrator executed from it (or `horizon` of them: a policy's longer action
horizon, for `hpcvla sft`), the last action repeated past the episode's end (common.chunks
says why; `pad` marks those entries); a dump's rows, one a chunk, are continued by the rows
after them. `demonstration_problems` opens the files
and reads attributes and dataset shapes only, for the pre-launch check;
`read_demonstrations` runs the same checks first and raises DemonstrationError (a ValueError)
with the same lines.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import numpy as np

from hpcvla.demonstrations import hpcvla_dump, lerobot, libero, maniskill
from hpcvla.demonstrations.checks import check_instructions, check_outcomes, check_per_task
from hpcvla.demonstrations.common import DemonstrationError, Problem, Problems
from hpcvla.envs.base import EnvSpec
from hpcvla.metrics.dump import open_hdf5
from hpcvla.text import tokenize
from hpcvla.transport.windows import MPI_OWN_SHM

__all__ = ["Demonstrations", "DemonstrationError", "Selection", "read_demonstrations",
           "select_demonstrations", "read_selection",
           "demonstration_files", "demonstration_problems", "demonstration_rows",
           "sample_bytes", "sample_layout",
           "LAYOUTS"]

LAYOUTS = (hpcvla_dump, libero, maniskill)  # HDF5 files; detection order: the first that matches
SUFFIXES = (".h5", ".hdf5")
# Datasets users have that are not read, by a file that marks them
NOT_READ = (("*.parquet", "a parquet file (a LeRobot dataset is given as its folder, the one "
                          "holding meta/info.json)"),
            ("dataset_info.json", "an RLDS/TFDS dataset (e.g. OpenVLA's and OFT's *_no_noops)"),
            ("*/dataset_info.json", "an RLDS/TFDS dataset (its version folders)"),
            ("*.tfrecord*", "an RLDS/TFDS dataset's records"))


@dataclass
class Demonstrations:
    """Samples for SFT, in file order, episode order, step order."""

    obs: dict[str, np.ndarray]  # per spec field: (N, *shape), the spec's dtype
    actions: np.ndarray         # (N, H, action_dim) float32: the executed chunk (H =
                                # chunk_len), or the policy's horizon of actions from it (sft)
    episode: np.ndarray         # (N,) int64: index into `task` of the sample's demonstration
    task: list[str]             # per demonstration: its instruction
    source: str                 # files and layouts read, for logs
    # (N, H) bool: True where the chunk ran past the episode's end and repeats its last
    # action (hpcvla sft leaves these out of the loss)
    pad: np.ndarray
    # read_demonstrations(outcomes=True): per sample its reward and how its episode ended
    # there (hpcvla_dump.OUTCOMES: rewards, terminated, truncated, env_fault), (N,) each
    outcomes: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.actions)

    def arrays(self) -> dict[str, np.ndarray]:
        """Its per-sample arrays by sample_layout's names."""
        return _named(self.obs, self.actions, self.pad, self.episode)

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], task: list[str], source: str,
                    outcomes: dict[str, np.ndarray] | None = None) -> Demonstrations:
        """Demonstrations of per-sample `arrays` by sample_layout's names."""
        return cls(obs={k.removeprefix("obs."): v for k, v in arrays.items()
                        if k.startswith("obs.")}, actions=arrays["actions"],
                   episode=arrays["episode"], task=task, source=source, pad=arrays["pad"],
                   outcomes=outcomes)


def demonstration_files(paths) -> list[Path]:
    """`paths` (one or a list; a folder stands for its .h5/.hdf5 files, a LeRobot dataset's
    for itself) as files and datasets in order."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = []
    for path in map(Path, paths):
        if path.is_dir() and not lerobot.matches(path):
            files += sorted(p for p in path.iterdir() if p.suffix in SUFFIXES)
        else:
            files.append(path)
    return files


def _not_read(path) -> str:
    """', not <what it is>: ...' for a dataset of a format not read here (NOT_READ), else ''."""
    path = Path(path)
    kind = next((what for glob, what in NOT_READ if (next(path.glob(glob), None)
                                                     if path.is_dir() else path.match(glob))),
                None)
    return f", not {kind}: not read here (docs/imitation.md)" if kind else ""


def _scan(paths, spec: EnvSpec, features: dict[str, str] | None = None,
          datasets: dict | None = None):
    """Every file's episodes and layout, and every problem found without bulk reads;
    `features`: a LeRobot dataset's feature for a field (sft.features); `datasets`: where to
    keep each LeRobot dataset scanned, by path, for the load (its metadata, and its gripper
    convention read from every data file, read once)."""
    problems, found = Problems(), []
    files = demonstration_files(paths)
    if not files:
        kind = next(filter(None, map(_not_read, [paths] if isinstance(paths, (str, Path))
                                     else paths)), "")
        problems.add(paths, "", None, "at least one .h5/.hdf5 demonstration file or LeRobot "
                     "dataset (a file, a list of files or a folder holding them)" + kind)
    seen: set[Path] = set()
    for path in files:
        if path.resolve() in seen:
            problems.add(path, "", None, "each file or dataset once: it is named again (also "
                         "through its folder or another path), so each of its demonstrations "
                         "would count twice")
            continue
        seen.add(path.resolve())
        if kind := _not_read(path):
            problems.add(path, "", None, "an .h5/.hdf5 demonstration file" + kind)
            continue
        if lerobot.matches(path):
            _scan_dataset(path, spec, problems, found, features or {}, datasets)
            continue
        try:
            f = open_hdf5(path)
        except (OSError, ValueError) as err:
            problems.add(path, "", None, "a readable HDF5 file: " + (
                "no such file" if not path.exists() else "an empty file (an `hpcvla demos "
                "--out` killed before its first episode claims its name so: remove it)"
                if path.stat().st_size == 0 else f"{type(err).__name__}: {err}"))
            continue
        with f:
            layout = next((m for m in LAYOUTS if m.matches(f)), None)
            if layout is None:
                problems.add(path, "/", sorted(f)[:6], _unknown_layout(f))
                continue
            try:
                found.append((path, layout, layout.scan(path, f, spec, problems)))
            except (KeyError, ValueError, TypeError, OSError) as err:
                problems.add(path, "/", None, f"a readable {layout.NAME} file "
                             f"({type(err).__name__}: {err})")
    check_instructions(spec, [e for _, _, eps in found for e in eps], problems)
    return found, problems


def _scan_dataset(path: Path, spec: EnvSpec, problems: Problems, found: list,
                  features: dict[str, str], datasets: dict | None) -> None:
    try:
        with lerobot.Dataset(path, features) as dataset:
            found.append((path, lerobot, lerobot.scan(path, dataset, spec, problems)))
        if datasets is not None:
            datasets[path] = dataset
    except (KeyError, ValueError, TypeError, OSError) as err:  # pyarrow's errors are these
        problems.add(path, lerobot.MARK, None, f"a readable {lerobot.NAME} ({type(err).__name__}"
                     f": {err})")


def _open(path, layout, datasets: dict):
    """The file (h5py) or dataset (lerobot.Dataset, as scanned) a layout's load reads from."""
    return datasets[path] if layout is lerobot else open_hdf5(path)


def _unknown_layout(f) -> str:
    data = f.get("data")
    if data is not None and not data.attrs and any(  # not to be given LIBERO's attributes
            "obs/agentview_rgb" in data[n] for n in data if n.startswith("demo_")):
        return ("a LIBERO dataset as LIBERO's scripts/create_dataset.py writes it: this one "
                "has no /data attributes, as OpenVLA-OFT's regenerate_libero_dataset.py writes "
                "them, whose observations come before each action (LIBERO's: after it): not "
                "read here; use LIBERO's own files (docs/imitation.md)")
    return ("one of the demonstration layouts: an hpcvla dump (root attribute format="
            f"{hpcvla_dump.FORMAT!r} and /data), a LIBERO dataset (/data with attribute "
            "problem_info and demo_<i>/obs groups, as LIBERO's scripts/create_dataset.py "
            "writes), or a ManiSkill3 RecordEpisode file (traj_<i> groups and the .json beside "
            "it); convert the file to one of them")


def demonstration_problems(paths, spec: EnvSpec, per_task: int | None = None,
                           outcomes: bool = False, successful_only: bool = False,
                           features: dict[str, str] | None = None,
                           host_memory: int = 0, shm: int | None = None) -> list[Problem]:
    """What stops `read_demonstrations(paths, spec, per_task, successful_only, outcomes,
    features)`, as (where "FILE:key", value, what is expected and the fix); empty when nothing
    does. Opens the files and reads attributes, dataset shapes and single elements only.
    `host_memory` (bytes; 0: not checked), `shm` (bytes; None: not checked): a host's memory,
    half of which the samples must fit in, and its /dev/shm's room beside MPI's own, which
    must hold them (`hpcvla sft` holds them once per host, in MPI shared memory, and twice
    while its ranks read them)."""
    found, problems = _scan(paths, spec, features)
    check_per_task(per_task, found, successful_only, problems)
    if outcomes:
        check_outcomes(found, problems, spec)
    return problems.listed() or _none_chosen(found, per_task, successful_only) or \
        _memory_problems(_select(found, per_task, successful_only), spec, host_memory, shm)


def demonstration_rows(paths, spec: EnvSpec, per_task: int | None = None) -> int:
    """The samples `read_demonstrations(paths, spec, per_task)` would read, from the files'
    headers (no bulk data read): an off-policy learner's prior transitions are at most these."""
    found, _ = _scan(paths, spec)
    return sum(e.rows for _, _, e in _select(found, per_task, False))


def _named(obs: dict[str, np.ndarray], actions: np.ndarray, pad: np.ndarray,
           episode: np.ndarray) -> dict[str, np.ndarray]:
    """Per-sample arrays by sample_layout's names: `obs.<field>`, actions, pad, episode."""
    return {**{f"obs.{k}": v for k, v in obs.items()}, "actions": actions, "pad": pad,
            "episode": episode}


def sample_layout(spec: EnvSpec, horizon: int | None = None
                  ) -> dict[str, tuple[tuple[int, ...], str]]:
    """One sample's arrays as Demonstrations holds them (shape, dtype), by name: each
    observation field (`obs.<field>`), its actions (`horizon`, default the chunk), padding
    mask and demonstration's index."""
    steps = horizon or spec.chunk_len
    return {**{f"obs.{field}": (tuple(shape), dtype) for field, (shape, dtype) in
               spec.obs.items()},
            "actions": ((steps, spec.action_dim), "<f4"),
            "pad": ((steps,), "|b1"), "episode": ((), "<i8")}


def sample_bytes(spec: EnvSpec) -> int:
    """One sample's bytes as Demonstrations holds it (sample_layout)."""
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
               for shape, dtype in sample_layout(spec).values())


def _memory_problems(chosen, spec: EnvSpec, host_memory: int,
                     shm: int | None) -> list[Problem]:
    rows = [e.rows for _, _, e in chosen]
    if not all(rows):  # a layout that does not tell: not checked
        return []
    need = sum(rows) * sample_bytes(spec)
    files = ", ".join(sorted({str(p) for p, _, _ in chosen}))
    held = f"{sum(rows)} samples ({need / 2**30:.1f} GiB)"
    fewer = ": fewer demonstrations (sft.per_task, fewer files or datasets) or smaller images " \
        "(env.image_size)"
    if host_memory and 2 * need > host_memory:
        return [(files, held, f"at most half this host's {host_memory / 2**30:.1f} GiB of "
                 "memory (one copy per host, two while it is read)" + fewer)]
    if shm is not None and need > shm:
        return [(files, held, f"at most the {max(shm, 0) / 2**30:.1f} GiB this host's /dev/shm "
                 f"has free beside MPI's own {MPI_OWN_SHM >> 20} MiB, where the one copy "
                 "lives (MPI shared memory; a larger /dev/shm: `mount -o remount,size=...`, "
                 "containers: --shm-size)" + fewer)]
    return []


def _none_chosen(found, per_task, successful_only) -> list[Problem]:
    """The problem when the files hold no demonstration to read (none at all, or none that
    succeeded where only successful ones are read); empty otherwise."""
    if _select(found, per_task, successful_only):
        return []
    files = ", ".join(sorted({str(p) for p, _, _ in found}))
    if successful_only and any(episodes for _, _, episodes in found):  # none succeeded
        return [(files, None, "at least one successful demonstration (only successful ones "
                 "are read: set successful_only false, or record more)")]
    return [(files, None, "at least one demonstration (the files hold no episodes)")]


def _select(found, per_task, successful_only):
    taken, chosen = Counter(), []
    for path, layout, episodes in found:
        for e in episodes:
            if successful_only and not e.success:
                continue
            if per_task is not None and taken[e.instruction] >= per_task:
                continue
            taken[e.instruction] += 1
            chosen.append((path, layout, e))
    return chosen


def read_demonstrations(paths, spec: EnvSpec, per_task: int | None = None,
                        successful_only: bool = False, outcomes: bool = False,
                        features: dict[str, str] | None = None,
                        part: tuple[int, int] = (0, 1),
                        horizon: int | None = None) -> Demonstrations:
    """The samples of every demonstration in `paths` for `spec`: select_demonstrations'
    selection, read_selection's `part` of it (`horizon` actions each, default the chunk)."""
    return read_selection(select_demonstrations(paths, spec, per_task, successful_only,
                                                outcomes, features), spec, outcomes, part,
                          horizon)


@dataclass
class Selection:
    """The demonstrations to read, as their headers describe them: (file, layout, Episode) in
    order, and the LeRobot datasets scanned (metadata, gripper convention) by path. It
    pickles (layouts by name): one rank of a host scans, its others read from what it found."""

    chosen: list
    datasets: dict

    def __getstate__(self):
        return {"chosen": [(path, layout.NAME, e) for path, layout, e in self.chosen],
                "datasets": self.datasets}

    def __setstate__(self, state):
        layouts = {layout.NAME: layout for layout in (*LAYOUTS, lerobot)}
        self.chosen = [(path, layouts[name], e) for path, name, e in state["chosen"]]
        self.datasets = state["datasets"]


def select_demonstrations(paths, spec: EnvSpec, per_task: int | None = None,
                          successful_only: bool = False, outcomes: bool = False,
                          features: dict[str, str] | None = None) -> Selection:
    """The demonstrations in `paths` to read for `spec`, found from headers (every file opened,
    a LeRobot dataset's action column read for its gripper convention).

    `per_task`: only the first K demonstrations of each task (by instruction; file order, then
    episode order), after `successful_only` dropped the failed ones. `outcomes`: the files
    must hold each sample's reward and episode end, for an off-policy learner. `features`:
    which feature of a LeRobot dataset holds a field (sft.features). Raises
    DemonstrationError (a ValueError) naming every problem `demonstration_problems` finds, or
    when no demonstration is left."""
    datasets: dict = {}
    found, problems = _scan(paths, spec, features, datasets)
    check_per_task(per_task, found, successful_only, problems)
    if outcomes:
        check_outcomes(found, problems, spec)
    if problems:
        raise DemonstrationError(problems.listed())
    none = _none_chosen(found, per_task, successful_only)
    if none:
        raise DemonstrationError(none)
    return Selection(_select(found, per_task, successful_only), datasets)


def read_selection(selection: Selection, spec: EnvSpec, outcomes: bool = False,
                   part: tuple[int, int] = (0, 1), horizon: int | None = None) -> Demonstrations:
    """The samples of the selected demonstrations (`outcomes`: with each sample's reward and
    episode end, `Demonstrations.outcomes`); each sample's actions the chunk it executed
    (spec.chunk_len), or with `horizon` that many from it (a policy's longer horizon).
    `part` (r, n): the r-th of n runs of whole demonstrations in order, of about equal
    samples (by the headers), for n readers that share the work; `task` and `episode` stay
    the whole selection's."""
    chosen, datasets = selection.chosen, selection.datasets
    first, stop = _part(chosen, *part)
    length = spec.obs.get("instruction", ((0,), ""))[0][0]
    parts, ends = [], []
    for path, group in groupby(enumerate(chosen[first:stop], first), key=lambda c: c[1][0]):
        group = list(group)  # each file opened once in turn
        with _open(path, group[0][1][1], datasets) as f:
            for index, (_, layout, e) in group:
                obs, actions, pad = layout.load(f, e, spec, horizon)
                if outcomes:
                    ends.append(layout.outcomes(f, e))
                if "instruction" in spec.obs:
                    obs["instruction"] = np.broadcast_to(
                        tokenize(e.instruction, spec.vocab, length), (len(actions), length))
                parts.append(_named(obs, actions, pad, np.full(len(actions), index, np.int64)))
    held = {key: np.concatenate([p[key] for p in parts]).astype(np.dtype(dtype), copy=False)
            if parts else np.zeros((0, *shape), dtype)
            for key, (shape, dtype) in sample_layout(spec, horizon).items()}
    used = Counter((str(path), layout.NAME) for path, layout, _ in chosen)
    return Demonstrations.from_arrays(
        held, task=[e.instruction for _, _, e in chosen],
        source="; ".join(f"{path} ({name}, {n} demonstrations)"
                         for (path, name), n in used.items()),
        outcomes={k: np.concatenate([end[k] for end in ends]) for k in ends[0]}
        if outcomes and ends else None)


def _part(chosen, r: int, n: int) -> tuple[int, int]:
    """The demonstrations [first, stop) of part r of n: runs in order, split where the samples
    before them (by the headers; 1 for a demonstration whose header does not tell) reach r/n of
    the whole."""
    weights = np.cumsum([0] + [e.rows or 1 for _, _, e in chosen])
    first, stop = np.searchsorted(weights[:-1], weights[-1] * np.array([r, r + 1]) / n)
    return int(first), int(stop)
