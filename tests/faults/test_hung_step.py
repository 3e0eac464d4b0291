"""A simulator step that never returns (injected: `env.hang_at_step`) is caught by the step
watchdog within `env.step_timeout_s`: the rank prints its stacks (the stuck line in the env on
top), the launcher names the rank and its role and stops the whole job; nothing hangs."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # training runs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config,ranks,role", [("configs/default.yaml", 4, "simulator"),
                                               ("configs/colocated.yaml", 2, "simulator+")])
def test_a_hung_env_step_stops_the_job_loudly(tmp_path, config, ranks, role):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "hpcvla", "train", config, "--ranks", str(ranks),
                          f"run.root={tmp_path}", "pipeline.total_updates=100000",
                          "env.hang_at_step=60", "env.step_timeout_s=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    assert out.returncode != 0, out.stdout[-2000:]
    assert "Timeout (0:00:03)!" in out.stderr and "in step" in out.stderr, out.stderr[-3000:]
    assert "envs/reach.py" in out.stderr  # where it hung
    assert f"({role}" in out.stderr and "died first" in out.stderr  # who, named by the launcher
    print(f"{config}: job down {took:.0f} s after start (3 s watchdog)")
