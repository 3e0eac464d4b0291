"""Numerical faults: a NaN in the loss skips the optimizer step on every learner (weights
bit-identical, counted); repeated ones stop the run with a message naming the setting. And
the gradient clipping (algorithm.max_grad_norm) the same engines step under."""

import re

import pytest

from helpers import MPI_DIR, hpcvla

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # training runs

SMALL = ["env.image_size=32", "learner.micro_batch=8", "learner.micro_batches=1",
         "rollout.segment_len=4", "learner.max_nonfinite_steps=3"]


@pytest.mark.parametrize("stage, clip, policy", [
    (0, 1e-12, []), (2, 0.5, []), (3, 1e-12, []),
    # the default stage with a bf16 flow policy, as on GPUs (DeepSpeed's bf16 optimizer)
    (1, 0.5, ["policy.name=flow", "policy.dtype=bfloat16"])])
def test_nan_loss_skips_the_step_and_repeated_ones_stop(stage, clip, policy):
    """`clip` (max_grad_norm): Adam's first step moves a weight by up to its learning rate
    (g / (|g| + eps), ~1 for |g| >> adam_eps), a gradient clipped to a norm of 1e-12 by
    up to 1e-12 / adam_eps of it: whether DeepSpeed clips (at stage 0 and under ZeRO's
    partitioned optimizers) shows in the step."""
    out = hpcvla("launch", "-n", 2, "--timeout", 300, "--", MPI_DIR / "nonfinite.py",
                 "configs/colocated.yaml", f"learner.zero_stage={stage}", *SMALL, *policy,
                 f"algorithm.max_grad_norm={clip}", "algorithm.adam_eps=1e-5", timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    moved = float(re.search(r"a weight moved (\S+) learning rates", out.stdout).group(1))
    # (bf16 weights show the fp32 masters' step rounded: up to 1.3 learning rates measured)
    most = 2.0 if policy else 1.01
    assert moved < 1e-4 if clip < 1e-5 else 0.5 < moved <= most, (clip, moved)
    assert f"ZeRO stage {stage}: skipped 4 steps, then stopped: 3 optimizer steps in a row " \
           "skipped" in out.stdout
    assert "learner.max_nonfinite_steps=3" in out.stdout
    # the learner that got it names the field and where it came from, once
    said = re.findall(r"the trajectories' `(\w+)` holds NaN or Inf \(first in a segment of "
                      r"policy version \d+ from rank \d+", out.stderr)
    assert said == ["reward"], out.stderr[-3000:]
