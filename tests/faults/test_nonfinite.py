"""Numerical faults: a NaN in the loss skips the optimizer step on every learner (weights
bit-identical, counted); repeated ones stop the run with a message naming the setting."""

import pytest

from helpers import MPI_DIR, hpcvla

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # training runs

SMALL = ["env.image_size=32", "learner.micro_batch=8", "learner.micro_batches=1",
         "rollout.segment_len=4", "learner.max_nonfinite_steps=3"]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_nan_loss_skips_the_step_and_repeated_ones_stop(stage):
    out = hpcvla("launch", "-n", 2, "--timeout", 300, "--", MPI_DIR / "nonfinite.py",
                 "configs/colocated.yaml", f"learner.zero_stage={stage}", *SMALL, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"ZeRO stage {stage}: skipped 4 steps, then stopped: 3 optimizer steps in a row " \
           "skipped" in out.stdout
    assert "learner.max_nonfinite_steps=3" in out.stdout
