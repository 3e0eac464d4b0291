"""`hpcvla bench learning`: the statistics, and a short real run of both modes, compared on
`hpcvla eval` of their final checkpoints."""

import json
import math

import numpy as np
import pytest

from hpcvla.bench.learning import welch_interval
from hpcvla.metrics.raster import read_png
from test_mpi_world import hpcvla


def test_welch_interval_matches_the_textbook_formula():
    a, b = [0.9, 0.95, 0.85], [0.8, 0.9, 0.7, 0.75]
    diff, low, high = welch_interval(a, b)
    se = math.sqrt(np.var(a, ddof=1) / 3 + np.var(b, ddof=1) / 4)
    assert diff == pytest.approx(np.mean(a) - np.mean(b))
    assert (high - low) / 2 / se == pytest.approx(2.776, abs=0.6)  # t at ~4-5 dof
    assert low < diff < high
    assert welch_interval([0.5, 0.5], [0.5, 0.5]) == (0.0, 0.0, 0.0)


def test_learning_bench_runs_both_modes_on_one_budget(tmp_path):
    out = hpcvla("bench", "learning", "--quick", "--json", tmp_path / "learning.json",
                 timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "learning.json").read_text())
    assert list(results["modes"]) == ["streamer", "sync-colocated"]
    grid = results["grid_env_steps"]
    assert grid[-1] == results["env_step_budget"] == 3 * 32 * 8 * 4
    assert results["eval_episodes"] == 32
    for mode in results["modes"].values():
        assert [r["seed"] for r in mode["runs"]] == [0, 1]
        for run in mode["runs"]:
            assert len(run["curve"]) == len(grid) and 0 <= run["final_success"] <= 1
            assert 0 <= run["eval_success"] <= 1  # hpcvla eval of the final checkpoint
            assert run["explained_variance"] <= 1  # the critic's, logged per micro-batch
    png = read_png(tmp_path / "learning.png")  # the overlaid curves, next to the JSON
    assert png.shape[2] == 3 and png.std() > 0
    for name in ("difference", "rolling_difference", "curve_difference"):
        low, high = results[name]["ci95"]
        assert low <= results[name]["streamer_minus_sync-colocated"] <= high
