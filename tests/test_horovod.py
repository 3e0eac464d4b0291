"""learner.backend=horovod (engines/horovod.py): 2 learners train reach through the real
pipeline with Horovod's MPI allreduce, checkpoint and resume. `make install` builds Horovod
(its install-horovod step): without it these tests fail, saying so."""

import json

import pytest
from safetensors.torch import load_file

from hpcvla.config import load_config
from hpcvla.evaluate import checkpoint_weights, evaluate
from hpcvla.engines.horovod import horovod_available
from helpers import MIN_Z, hpcvla, improvement_z, run_train

COLOCATED = "configs/colocated.yaml"  # 2 ranks: each simulates, infers and learns
pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.learning]


@pytest.fixture(autouse=True)
def horovod_installed():
    missing = horovod_available()
    assert not missing, missing
TWO_LEARNERS = ["learner.backend=horovod", "learner.checkpoint_every=20"]


def test_two_horovod_learners_train_average_and_resume(tmp_path):
    out, summary, run_dir = run_train(tmp_path / "a", "pipeline.total_updates=80",
                                      *TWO_LEARNERS, config=COLOCATED, ranks=2)
    assert summary["lost_records"] == 0
    # each learner keeps its own Adam moments, equal only if both stepped on the same
    # (allreduced) gradients, though they trained on different segments: every checkpoint
    # checked that (optimizer_state.replicas_agree), then learner 0 saved them for both
    final = sorted((run_dir / "checkpoints").glob("v*"))[-1]
    saved = json.loads((final / "state.json").read_text())
    steps = {s for entry in saved["optimizer"] for s in entry["steps"].values()}
    assert steps == {80.0}, steps  # Adam's count: one per update (1 epoch), none ahead
    moments = [load_file(str(final / f"optimizer.rank{r}.safetensors")) for r in (0, 1)]
    assert {k.rsplit("/", 1)[-1] for k in moments[0]} >= {"master", "exp_avg", "exp_avg_sq"}
    assert list(moments[1]) == ["rng.torch_cpu"]
    cfg = load_config(run_dir / "config.yaml")
    weights, state = checkpoint_weights(run_dir)
    assert state["version"] == 80
    untrained, trained = evaluate(cfg, None), evaluate(cfg, weights)
    z = improvement_z(untrained["success_rate"], trained["success_rate"], 128)
    assert z >= MIN_Z, (z, untrained, trained)
    out = hpcvla("train", COLOCATED, "--ranks", 2, "pipeline.total_updates=84",
                 f"run.resume={run_dir}", *TWO_LEARNERS, timeout=400)  # writes on in run_dir
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resuming from" in out.stdout and checkpoint_weights(run_dir)[1]["version"] == 84
    resumed = json.loads((sorted((run_dir / "checkpoints").glob("v*"))[-1] / "state.json")
                         .read_text())
    assert {s for entry in resumed["optimizer"] for s in entry["steps"].values()} == {84.0}, \
        "the resumed learners did not continue the saved Adam state (4 steps: a fresh one)"


def test_gpu_learners_need_a_horovod_built_with_gpu_operations():
    """`make install-horovod` builds MPI operations only: GPU learners would hand its MPI
    allreduce CUDA pointers, so such a build is refused for them, naming the rebuild."""
    import horovod.torch as hvd
    assert horovod_available(on_gpus=False) == ""
    if hvd.nccl_built() or hvd.cuda_built():
        assert horovod_available(on_gpus=True) == ""
    else:
        assert "HOROVOD_GPU_OPERATIONS=NCCL" in horovod_available(on_gpus=True)


def test_horovod_and_deepspeed_take_the_same_optimizer_step(tmp_path):
    """One optimizer step of 2 learners over 2 micro-batches each of the same fixed segments
    (each learner its own), from the same policy, by Horovod and by DeepSpeed at ZeRO stage 0
    and 1: loss scaled by 1 / micro-batches, gradients averaged (Horovod's Average, DeepSpeed's
    1 / GAS and its allreduce), clipped once after it, the same AdamW. Horovod and stage 0
    agree bit for bit; ZeRO-1's partitioned step to fp32 rounding (measured: 3e-8 of a 3e-3
    step)."""
    from safetensors.torch import load_file

    from helpers import MPI_DIR
    runs = {}
    for backend in ("learner.backend=horovod", "learner.zero_stage=0", "learner.zero_stage=1"):
        path = tmp_path / f"{backend}.safetensors"
        out = hpcvla("launch", "-n", 2, "--timeout", 240, "--", MPI_DIR / "backend_parity.py",
                     path, COLOCATED, backend, "env.image_size=32", "learner.micro_batch=8",
                     "learner.micro_batches=2", "rollout.segment_len=4", timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        runs[backend] = load_file(str(path))
    horovod, zero0, zero1 = runs.values()
    names = [k.removeprefix("after/") for k in zero0 if k.startswith("after/")]

    def apart(a, b, when="after"):
        return max((a[f"{when}/{k}"] - b[f"{when}/{k}"]).abs().max().item() for k in names)
    assert apart(horovod, zero0, "before") == apart(horovod, zero1, "before") == 0.0
    moved = apart(zero0, {f"after/{k}": zero0[f"before/{k}"] for k in names})
    assert moved > 1e-4, moved  # the step moved the weights
    assert apart(horovod, zero0) == 0.0
    assert apart(horovod, zero1) < 1e-3 * moved, (apart(horovod, zero1), moved)
