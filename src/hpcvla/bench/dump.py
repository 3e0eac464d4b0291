"""`hpcvla bench dump`: what a trajectory dump costs its producer rank, written in the rank's
own process vs by a writer process (metrics/dump_writer.py), side by side in one run.

The same segment groups (8 chunk-steps x 16 envs, two 96 px cameras, an 8-d state, 10 x 7
action chunks, a third of the envs ending an episode every fifth group) go through
TrajectoryDump.add_segment, flushed every second as a run does, after 20 ms of the producer's
own work per group (Python holding the GIL, as a rank's loop), in alternating rounds of
`none` (no dump: the baseline), `inline` and `process`. Measured: the producer's groups per
second, its time in the dump's calls, and the close (everything written, the file
complete). The images are a smooth scene that moves a few pixels per step plus noise of a few
levels, which gzip shrinks about as much as it does a simulator's renders (the ratio is
reported); random images would make compression slower and the writer process look better.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

STEPS, ENVS, SIZE = 8, 16, 96


def _groups(count: int, rng) -> list[dict]:
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    groups = []
    for i in range(count):
        t = (i * STEPS + np.arange(STEPS))[:, None, None, None, None]
        e = np.arange(ENVS)[None, :, None, None, None]
        scene = 128 + 60 * np.sin((x + 2 * y + 3 * t + 17 * e) / 15.0)[..., None] * \
            np.array([1.0, 0.7, 0.4])
        noise = rng.integers(-3, 4, scene.shape)
        image = np.clip(scene + noise, 0, 255).astype(np.uint8)
        done = np.zeros((STEPS, ENVS), bool)
        done[-1, ::3] = i % 5 == 4
        groups.append({
            "obs.image": image, "obs.wrist_image": image[:, :, ::-1].copy(),
            "obs.state": rng.normal(size=(STEPS, ENVS, 8)).astype(np.float32),
            "actions": rng.normal(size=(STEPS, ENVS, 10, 7)).astype(np.float32),
            "reward": np.zeros((STEPS, ENVS), np.float32), "done": done,
            "terminated": done.copy(), "truncated": np.zeros_like(done),
            "env_fault": np.zeros_like(done), "success": done.copy(),
            "logprob": np.zeros((STEPS, ENVS), np.float32),
            "value": np.zeros((STEPS, ENVS), np.float32),
            "episode_return": np.zeros((STEPS, ENVS), np.float32),
            "truncation_value": np.zeros((STEPS, ENVS), np.float32),
            "chunk_steps": np.full((STEPS, ENVS), 10, np.int32),  # the actions' chunk of 10
            "version": np.full(STEPS, i, np.int64), "meta": np.array([0, 0, i, ENVS, i])})
    return groups


def _work(seconds: float) -> None:
    """The rank's own work between two groups (stepping envs, the policy's forward)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _one(groups: list[dict], path: Path, way: str, work_s: float) -> dict:
    """One producer run of `groups`: `way` none (no dump: the baseline), inline or process."""
    from hpcvla.metrics.dump_writer import TrajectoryDump
    dump = None if way == "none" else TrajectoryDump(
        path, 0, ["image", "wrist_image", "state"], ["", "task"], lambda slot: 0, "bench",
        10, flush_s=1.0, in_process=way == "inline")
    in_dump, begin = 0.0, time.perf_counter()
    for group in groups:
        _work(work_s)
        if dump:
            called = time.perf_counter()
            dump.add_segment(group)
            in_dump += time.perf_counter() - called
    producing = time.perf_counter()
    if dump:
        dump.close()
    return {"groups_per_s": len(groups) / (producing - begin),
            "dump_ms_per_group": in_dump / len(groups) * 1e3,
            "close_s": time.perf_counter() - producing,
            "file_mb": path.stat().st_size / 1e6 if dump else 0.0}


def run(quick: bool = False, json_path=None, work_ms: float = 20.0) -> dict:
    rounds, count = (1, 24) if quick else (3, 150)
    groups = _groups(count, np.random.default_rng(0))
    raw = sum(g[k].nbytes for g in groups for k in g if k.startswith("obs."))
    ways = ("none", "inline", "process")
    results: dict[str, list[dict]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory(prefix="hpcvla-bench-dump-") as folder:
        for n in range(rounds):
            for way in ways if n % 2 == 0 else ways[::-1]:
                path = Path(folder) / f"{way}{n}.h5"
                results[way].append(_one(groups, path, way, work_ms / 1e3))
                path.unlink(missing_ok=True)
    median = {way: {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
              for way, rows in results.items()}
    out = {"groups": count, "steps_per_group": STEPS * ENVS, "image_px": SIZE,
           "work_ms_per_group": work_ms, "rounds": rounds,
           "compression": raw / 1e6 / median["inline"]["file_mb"], **median,
           "producer_rate_process_to_inline":
               median["process"]["groups_per_s"] / median["inline"]["groups_per_s"],
           "producer_rate_process_to_none":
               median["process"]["groups_per_s"] / median["none"]["groups_per_s"]}
    for way in ways:
        m = median[way]
        print(f"{way:8} producer {m['groups_per_s']:6.1f} groups/s | in dump calls "
              f"{m['dump_ms_per_group']:6.2f} ms per group | close {m['close_s']:.2f} s | "
              f"file {m['file_mb']:.1f} MB", flush=True)
    print(f"producer's rate with the dump written by a process / in its own: "
          f"{out['producer_rate_process_to_inline']:.2f}x; against no dump: "
          f"{out['producer_rate_process_to_none']:.2f}x (gzip shrinks the observations "
          f"{out['compression']:.1f}x)", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))
    return out
