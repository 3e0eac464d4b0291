"""postprocess/report.py on real short runs: tables, swimlanes, curves and histograms."""

import json
import subprocess
import sys

import numpy as np
import pytest

from test_mpi_world import ROOT, hpcvla

sys.path.insert(0, str(ROOT / "postprocess"))
from hpcvla.metrics.raster import nice_ticks, read_png  # noqa: E402
from report import STAGE_COLORS  # noqa: E402


def report(*args):
    return subprocess.run([sys.executable, ROOT / "postprocess" / "report.py", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def train(root, *args):
    out = hpcvla("train", *args, f"run.root={root}", timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = root.iterdir()
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def test_report_of_a_streamer_and_a_colocated_run(tmp_path):
    streamer, s1 = train(tmp_path / "a", "configs/default.yaml", "--ranks", 4,
                         "pipeline.total_updates=3", "run.dump_trajectories=true")
    colocated, s2 = train(tmp_path / "b", "configs/colocated.yaml", "--ranks", 2,
                          "pipeline.total_updates=2")
    out = hpcvla("eval", streamer, "--all", "--episodes", 32)  # writes its eval.jsonl
    assert out.returncode == 0, out.stderr
    out = report(streamer, colocated, "--out", tmp_path / "report")
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    # the throughput table: a row per run, gains against the sync-colocated baseline
    assert "| vs sync-colocated |" in md
    gain = (s1["env_steps_per_s"] / s2["env_steps_per_s"] - 1) * 100
    assert f"| {streamer.name} | streamer | 4 | 1:1 | {s1['env_steps']} |" in md
    assert f"| {s1['env_steps_per_s']:.0f} | {gain:+.1f}% |" in md
    assert f"| {colocated.name} | sync-colocated | 2 | colocated | {s2['env_steps']} |" in md
    # staleness as fractions of the trained segments, from the learner's histogram
    total = sum(s1["staleness_hist"].values())
    assert f"| {streamer.name} | {s1['staleness_hist']['0'] / total:.3f} | " \
           f"{s1['staleness_hist']['1'] / total:.3f} |" in md
    assert "## Trajectory dumps" in md and "| rank0.h5 |" in md
    assert f"`hpcvla eval --all` of {streamer.name}: v3 0." in md  # beside training's curve
    assert f"hpcvla eval --all` of {colocated.name}" not in md
    for name in ("throughput", "success", "staleness", f"timeline-{streamer.name}",
                 f"timeline-{streamer.name}-zoom", f"timeline-{colocated.name}"):
        assert f"({name}.png)" in md
        pixels = read_png(tmp_path / "report" / f"{name}.png")
        assert pixels.shape[2] == 3 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 3
    # the swimlanes show each stage in its colour: simulators, inference, learner
    lanes = read_png(tmp_path / "report" / f"timeline-{streamer.name}.png").reshape(-1, 3)
    colours = {tuple(c) for c in np.unique(lanes, axis=0)}
    for stage in ("simulate", "infer", "train"):
        assert STAGE_COLORS[stage] in colours, stage


def test_report_refuses_what_is_not_a_run(tmp_path):
    out = report(tmp_path, "--out", tmp_path / "r")
    assert out.returncode == 2 and "no summary.json" in out.stderr


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 3456.0), (-2.5, 7), (0.001, 0.004)])
def test_ticks_are_round_and_cover_the_range(lo, hi):
    ticks = nice_ticks(lo, hi)
    assert 2 <= len(ticks) <= 12 and ticks[0] >= lo - 1e-9 and ticks[-1] <= hi + 1e-9
    steps = np.diff(ticks)
    assert np.allclose(steps, steps[0]) and hi - ticks[-1] < steps[0] + 1e-9
    mantissa = steps[0] / 10 ** np.floor(np.log10(steps[0]))
    assert round(mantissa, 6) in (1, 2, 5)
