"""HDF5 trajectory dumps: every episode a producer rank sends to the learners, on disk in a
robomimic-like layout (a group an episode; actions are chunks), for offline analysis
(`hpcvla inspect FILE`, postprocess/): the format and its readers here; the writer in
metrics/dump_writer.py.

One file per producer rank, `<run dir>/trajectories/rank<R>.h5`; `hpcvla demos` writes the
same layout from a scripted expert (imitation/recording.py: producer_rank -1, policy version
-1, and each demo's seed is its init_state_id).

    /                  attrs: format, source ("run", or what recorded the file), producer_rank,
                              env, chunk_len, config (YAML),
                              complete (False until the run closed it), segments (segment
                              groups received), open_episode_steps (steps of episodes still
                              running at each start's close, not written: their sum),
                              episodes_not_written (finished episodes a file at its share
                              of run.dump_max_gib took no more of: metrics/dump_file.py)
    /starts/<n>        the run's n-th start that wrote the file (0 the first; a resume, or a
                       restart from the same checkpoint, the next); attrs: config (its YAML:
                       the root's is the first's), open_episode_steps, began (ISO time)
    /data              attrs: total (steps in all demos), env_args (JSON, robomimic style)
    /data/demo_<i>     one finished episode of one env, in order of completion; attrs:
                       num_samples, env_id ("p<producer>/s<slot>/e<env>"), producer_rank,
                       slot, env_index, seed (seed of the env's shard: `make_env(.., seed)`;
                       the env's own is seeds.env_seeds(seed, n)[env_index]),
                       episode (of that env, counted from the (re)start of the run),
                       start (the start that wrote it, /starts/<start>: `(start, env_id,
                       episode)` names an episode), start_version (the policy version that
                       start began at; two starts resumed from one checkpoint share it),
                       instruction (text), policy_version (at the first step), staleness
                       (most over its steps), success, return, env_fault,
                       truncation_value (V of the observation the horizon ended it at,
                       which PPO bootstrapped its last step from; 0 otherwise), env_steps
                       (the primitive steps it ran: its last chunk's actions past
                       env_steps - (T - 1) x chunk_len never ran, a success mid-chunk)
        obs/<key>          (T, *shape)  observation the action was chosen for
        actions            (T, H, A) f4 the action chunk (H primitive actions) as the policy
                                        drew and scored it: before the env clips it to
                                        its bounds; a chunk that ends the episode early
                                        (a success mid-chunk) ran only its first steps
        rewards            (T,) f4      reward of each chunk
        dones              (T,) u1      1 at the last step only
        terminated, truncated, env_fault
                           (T,) u1      how it ended (last step only): by the task, by the
                                        horizon or a fault; env_fault: the env failed
        logprobs, values   (T,) f4      behaviour policy log-prob and value
        policy_versions    (T,) i8      policy version that acted
        staleness          (T,) i8      learner batch of the step's segment - policy version

A step is one action chunk (chunk_len env steps). Datasets are chunked, gzip-compressed and
checksummed (HDF5's Fletcher-32 filter, and the HDF5 1.10 file format, whose object headers
and chunk indexes carry checksums too): a damaged file fails to read, naming the file, instead
of returning wrong numbers (attributes in HDF5's dense storage are not covered). Text
attributes are fixed-length UTF-8 (`text_attrs`), never variable-length: those live in HDF5's
global heap, which has no checksum, and libhdf5 (2.0.0, in h5py 3.16) loops forever decoding a
damaged one. `hpcvla inspect --verify` reads every chunk.
The writer (metrics/dump_writer.py: in a training run a process of the producer rank's own,
so that compression takes none of the rank's time) keeps finished episodes in memory and
appends them every `flush_s` seconds: compressed into a staging file beside it first, then
copied in (the compressed chunks as they are) by opening, writing and closing the file, so it
is closed and consistent but for the copy: readable while the run goes on, and after a crash
up to the last flush. Neither readers (`open_dump`) nor the writer take HDF5's file lock:
a reader that holds one (h5py's default) never stops the writer (the run directory's `.lock`
keeps a second writer out). A process killed while it appends (SIGKILL, an OOM kill)
leaves the file marked open for write, and libhdf5 then refuses it whole: HDF5's `h5clear -s
FILE` clears the mark (docs/outputs.md). A run resumed from a checkpoint
(run.resume) appends to the dump of its first start, or, if that file cannot be read, moves it
aside (`.unreadable`) and begins a new one.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from hpcvla.metrics.episode_metrics import KEY, figures_in


FORMAT = "hpcvla-trajectories-1"
STEP_FIELDS = {  # segment field -> dataset name in a demo
    "actions": "actions", "reward": "rewards", "done": "dones", "terminated": "terminated",
    "truncated": "truncated", "env_fault": "env_fault", "logprob": "logprobs",
    "value": "values", "version": "policy_versions", "staleness": "staleness"}
DEMO_DATASETS = tuple(STEP_FIELDS.values())
COMPRESSION = {"compression": "gzip", "compression_opts": 1,  # fast; images shrink ~10x
               "fletcher32": True}  # a checksum per chunk, verified on every read
LIBVER = "v110"  # the HDF5 1.10 file format: object headers and chunk indexes checksummed too


class DumpError(ValueError):
    """A file that is not a readable hpcvla trajectory dump."""


def text_attrs(attrs: dict) -> dict:
    """`attrs` with every str as fixed-length UTF-8 (np.bytes_), stored in the object header
    itself, where h5py would put a str in the global heap (see the module's docstring)."""
    return {k: np.bytes_(v.encode()) if isinstance(v, str) else v for k, v in attrs.items()}


def attr_text(value) -> str:
    """A string attribute as str: h5py returns bytes for fixed-length strings (these dumps,
    LIBERO's files) and str for variable-length ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def open_hdf5(path, mode: str = "r", **kwargs):
    """An HDF5 file (h5py.File) opened without HDF5's own file lock, as hpcvla opens every
    one. HDF5 forgives a file system without locks only where flock answers ENOSYS (Lustre
    `noflock`): NFS whose lock daemon a node cannot reach (ENOLCK) and Cray DVS (errno 524)
    fail every locked open. None is needed: a dump has one writer (the run directory's
    `.lock` keeps a second world's out), its staging file is the writer's own, a reader must
    never hold the writer up, and demonstrations are read-only inputs."""
    import h5py
    return h5py.File(path, mode, locking=False, **kwargs)


# ---------------------------------------------------------------------------- reading

def open_dump(path):
    """The dump at `path` opened read-only (an h5py.File), after checking it is one."""
    path = Path(path)
    if not path.exists():
        raise DumpError(f"{path}: no such file")
    try:
        f = open_hdf5(path)
    except OSError as err:
        raise DumpError(f"{path}: not a readable HDF5 file (truncated, corrupted, or being "
                        f"written right now?): {err}") from None
    try:
        with _reading(path):  # a damaged root group fails here
            ours = attr_text(f.attrs.get("format", "")) == FORMAT and "data" in f
    except DumpError:
        f.close()
        raise
    if not ours:
        f.close()
        raise DumpError(f"{path}: not an hpcvla trajectory dump (format attribute "
                        f"{FORMAT!r} and a /data group expected)")
    return f


def demos(f):
    """The demo groups of an open dump in write order, each checked for completeness."""
    names = sorted(f["data"], key=lambda n: int(n.rsplit("_", 1)[-1]))
    for name in names:
        demo = f["data"][name]
        missing = [d for d in DEMO_DATASETS if d not in demo] + ([] if "obs" in demo else ["obs"])
        if missing:
            raise DumpError(f"{f.filename}: {name} lacks {', '.join(missing)}")
        n = int(demo.attrs.get("num_samples", -1))
        lengths = {d: demo[d].shape[0] for d in DEMO_DATASETS}
        for key, value in demo["obs"].items():
            if value is None:  # h5py's answer for a link it cannot follow
                raise DumpError(f"{f.filename}: {name}/obs/{key} is a broken link")
            lengths[f"obs/{key}"] = value.shape[0]
        wrong = {k: v for k, v in lengths.items() if v != n}
        if wrong:
            raise DumpError(f"{f.filename}: {name} has num_samples={n} but "
                            + ", ".join(f"{k} {v} steps" for k, v in wrong.items()))
        yield name, demo


@contextmanager
def _reading(path):
    """HDF5 read failures of a damaged file (a checksum, decompression or B-tree error
    deep in the file) as a DumpError naming the file."""
    try:
        yield
    except DumpError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        raise DumpError(f"{path}: corrupted, a part of the file cannot be read "
                        f"({type(err).__name__}: {err})") from None


def verify(path) -> int:
    """Read every dataset of the dump, so every chunk's checksum is checked; returns the
    bytes read. Raises DumpError naming the file and the first dataset that fails."""
    nbytes = 0
    with open_dump(path) as f, _reading(path):
        for name, demo in demos(f):
            datasets = []
            demo.visititems(lambda key, item: datasets.append(key) if hasattr(item, "shape")
                            else None)
            for key in datasets:
                try:
                    nbytes += demo[key][()].nbytes
                except (OSError, RuntimeError, ValueError) as err:
                    raise DumpError(f"{path}: {name}/{key} is corrupted: {err}") from None
    return nbytes


def summarize(path) -> dict:
    """What `hpcvla inspect` prints: episodes, steps, keys and shapes, success, versions."""
    with open_dump(path) as f, _reading(path):
        lengths, success, returns, versions, faults = [], [], [], [], 0
        judged = []  # (the episode's policy version, success, return): env faults left out
        metrics: dict[str, list[float]] = {}  # the env's episode metrics (episode_<name>)
        staleness = Counter()
        keys = {}
        chunk_len = int(f.attrs["chunk_len"])
        ran = 0  # primitive steps run (a file older than the episodes' env_steps: whole chunks)
        for name, demo in demos(f):
            lengths.append(int(demo.attrs["num_samples"]))
            ran += int(demo.attrs.get("env_steps", lengths[-1] * chunk_len))
            if demo.attrs.get("env_fault", False):  # ended by the env failing: no verdict
                faults += 1
            else:
                success.append(bool(demo.attrs["success"]))
                returns.append(float(demo.attrs["return"]))
                judged.append((int(demo.attrs["policy_version"]), success[-1], returns[-1]))
                for key, value in demo.attrs.items():  # (NaN: not known)
                    if key.startswith(KEY) and np.isfinite(value):
                        metrics.setdefault(key, []).append(float(value))
            v = demo["policy_versions"][()]
            versions += [int(v.min()), int(v.max())]
            staleness.update(demo["staleness"][()].tolist())
            if not keys:
                def visit(key, item, demo=demo):
                    if hasattr(item, "shape"):
                        keys[key] = {"shape": ["T", *item.shape[1:]], "dtype": str(item.dtype),
                                     "compression": item.compression}
                demo.visititems(visit)
        attrs = dict(f.attrs)
        return {
            "file": str(path), "source": attr_text(attrs.get("source", "run")),
            "producer_rank": int(attrs["producer_rank"]),
            "env": attr_text(attrs["env"]), "chunk_len": chunk_len,
            "complete": bool(attrs["complete"]), "segments": int(attrs["segments"]),
            "episodes": len(lengths), "steps": int(sum(lengths)), "env_steps": ran,
            "open_episode_steps": int(attrs["open_episode_steps"]),
            "episodes_not_written": int(attrs.get("episodes_not_written", 0)),
            "mean_length": float(np.mean(lengths)) if lengths else 0.0,
            "success_rate": float(np.mean(success)) if success else None,
            "mean_return": float(np.mean(returns)) if returns else None,
            **{key: float(np.mean(values)) for key, values in metrics.items()},
            "env_fault_episodes": faults,
            "policy_versions": [min(versions), max(versions)] if versions else None,
            "staleness_hist": dict(sorted(staleness.items())),
            "by_version": by_version(judged),
            "starts": len(f.get("starts", ())) or 1,
            "keys": keys,
        }


def by_version(judged: list[tuple[int, bool, float]], bins: int = 10) -> list[dict]:
    """Success and mean return over the episodes of `bins` equal ranges of the policy version
    they were acted with (at their first step): how the run's policy did as it trained."""
    if not judged:
        return []
    low, high = min(v for v, _, _ in judged), max(v for v, _, _ in judged)
    width = max(1, -(-(high - low + 1) // bins))
    out = []
    for first in range(low, high + 1, width):
        inside = [(ok, ret) for v, ok, ret in judged if first <= v < first + width]
        if inside:
            out.append({"versions": [first, min(high, first + width - 1)],
                        "episodes": len(inside),
                        "success_rate": float(np.mean([ok for ok, _ in inside])),
                        "mean_return": float(np.mean([ret for _, ret in inside]))})
    return out


def describe(summary: dict) -> str:
    """`summarize`'s result as the lines `hpcvla inspect` prints."""
    s = summary
    state = "complete" if s["complete"] else "still being written, or the run died (read " \
        "up to the last flush)"
    origin = f"producer rank {s['producer_rank']}" if s["source"] == "run" else \
        f"recorded by {s['source']}"
    lines = [f"{s['file']}: hpcvla trajectory dump, {origin}, env {s['env']}, {state}",
             f"  episodes {s['episodes']} | steps {s['steps']} (chunks of {s['chunk_len']}: "
             f"{s['env_steps']} env steps ran) | mean length {s['mean_length']:.1f} | segments "
             f"{s['segments']} | open at close "
             + (f"{s['open_episode_steps']} steps" if s["complete"] else "unknown (not closed)")
             + (f" | {s['starts']} starts (a resumed run's)" if s.get("starts", 1) > 1 else "")
             + (f" | {s['episodes_not_written']} finished episodes not written (past the "
                "file's share of run.dump_max_gib)" if s.get("episodes_not_written") else "")]
    if s["success_rate"] is not None:
        lines.append(f"  success {s['success_rate']:.3f} | mean return {s['mean_return']:.3f}"
                     + "".join(f" | {name} {value:.3f}" for name, value in figures_in(s).items())
                     +
                     f" (env faults: {s['env_fault_episodes']} episodes, not counted)"
                     f" | policy versions {s['policy_versions'][0]}..{s['policy_versions'][1]}"
                     f" | staleness (steps) {s['staleness_hist']}")
    if len(s.get("by_version", ())) > 1:
        lines.append("  success by policy version: " + " | ".join(
            f"{b['versions'][0]}-{b['versions'][1]} {b['success_rate']:.2f} ({b['episodes']})"
            for b in s["by_version"]))
    width = max((len(k) for k in s["keys"]), default=0)
    for key, info in s["keys"].items():
        shape = "(" + ", ".join(map(str, info["shape"])) + ("," if len(info["shape"]) == 1
                                                             else "") + ")"
        lines.append(f"    {key:<{width}}  {shape:<18} {info['dtype']:<8} "
                     f"{info['compression'] or ''}")
    return "\n".join(lines)
