"""Checkpoints: bit-identical resume under every ZeRO stage with real DeepSpeed learners, the
optimizer state re-partitioned exactly onto another learner count and ZeRO stage, and loud,
specific errors for missing, corrupted or mismatched checkpoints."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from hpcvla.checkpoint import catalog, store
from helpers import MPI_DIR, hpcvla

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # training runs

SMALL = ["env.image_size=32", "policy.hidden=32"]


def resume(run_dir, variants, *extra):
    """checkpoint_resume.py's train-checkpoint-resume in one world of 2 learners, once per
    variant (its overrides), each into run_dir/<i>; the newest checkpoint of each."""
    out = hpcvla("launch", "-n", 2, "--timeout", 400, "--", MPI_DIR / "checkpoint_resume.py",
                 "configs/colocated.yaml", run_dir, json.dumps(variants), *SMALL, *extra,
                 timeout=420)
    assert out.returncode == 0, out.stdout + out.stderr
    for variant in variants:
        stage = next(v for v in variant if v.startswith("learner.zero_stage=")).split("=")[1]
        assert f"resume bit-identical at ZeRO stage {stage}" in out.stdout, out.stdout
    return [catalog.latest(run_dir / str(i)) for i in range(len(variants))]


BF16 = ["policy.name=flow", "policy.dtype=bfloat16"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """One world (~35 s), a checkpoint each: an fp32 learner's resume at ZeRO stages 0-3, then
    a bf16 flow learner's at stage 0, stage 2 with gradient checkpointing, stage 3 with the
    optimizer state offloaded."""
    paths = resume(tmp_path_factory.mktemp("resumed"), [
        *([f"learner.zero_stage={s}"] for s in range(4)),
        [*BF16, "learner.zero_stage=0"],
        [*BF16, "learner.zero_stage=2", "learner.gradient_checkpointing=true"],
        [*BF16, "learner.zero_stage=3", "learner.offload_optimizer=true"]])
    return {"fp32": paths[:4], "bf16": paths[4:]}


def test_resume_is_bit_identical_at_every_zero_stage(resumed):
    for stage, path in enumerate(resumed["fp32"]):
        state = catalog.read_state(path)
        assert path.name == "v000002" and state["zero_stage"] == stage and state["learners"] == 2
        assert sorted(p.name for p in path.iterdir()) == [
            "model.safetensors", "optimizer.rank0.safetensors", "optimizer.rank1.safetensors",
            "state.json"]
        kinds = [{key.split("/")[-1] for key in safe_open(path / f"optimizer.rank{r}.safetensors",
                                                          "pt").keys()} for r in (0, 1)]
        assert kinds[0] == {"master", "exp_avg", "exp_avg_sq", "rng.torch_cpu"}
        # stage 0 replicates the state: learner 0 alone saves it; ZeRO shards it over both
        assert kinds[1] == ({"rng.torch_cpu"} if stage == 0 else kinds[0]), (stage, kinds)


def test_bf16_resume_is_bit_identical_from_the_fp32_masters(resumed):
    """A bf16 learner (DeepSpeed's bf16 mode: stage 0 and ZeRO wrap different optimizers)
    resumes exactly: the checkpoint holds its fp32 masters, not only the rounded weights;
    with gradient checkpointing too (the learner that resumes recomputes its layers), and with
    the optimizer state offloaded to host memory (ZeRO-Offload, torch's fused CPU AdamW)."""
    for path in resumed["bf16"]:
        assert all(v.dtype == torch.bfloat16 for v in store.load_weights(path).values())


def test_optimizer_state_resumes_on_any_learner_count_and_stage(tmp_path):
    """Checkpoints written by 2 learners at ZeRO stage 0, 1, 2 and 3 load on 3 learners at
    two other stages each, every stage loading two (checkpoint_layouts.LOADED_AT): the fp32
    masters, Adam moments and step each learner then holds, assembled whole by DeepSpeed,
    equal the saved ones bit for bit (uneven partitions, ZeRO-3's padding: the hard case;
    fewer learners than wrote, down to one, resume in test_pipeline.py's
    test_resume_on_fewer_learners_at_another_zero_stage). A bf16 flow policy: the masters are
    fp32 copies of other tensors than the weights, the harder case (an fp32 policy resumes at
    each stage in test_resume_is_bit_identical_at_every_zero_stage). ~50 s: two worlds, 8 loads."""
    extra = ["policy.name=flow", "policy.dtype=bfloat16"]
    def world(n, mode):
        out = hpcvla("launch", "-n", n, "--timeout", 240, "--", MPI_DIR / "checkpoint_layouts.py",
                     mode, tmp_path, "configs/colocated.yaml", *SMALL, *extra)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout
    world(2, "write")
    moves = [line for line in world(3, "read").splitlines() if "tensors equal" in line]
    assert len(moves) == 8, moves  # 4 saved stages x 2 loading stages


@pytest.mark.alone
def test_a_checkpoint_over_two_gib_resumes_bit_exact(tmp_path):
    """An optimizer state of 2.27 GB in one file (2 learners at ZeRO-0, learner 0 saves it)
    loads re-partitioned onto 2 ZeRO-1 learners bit for bit (tests/mpi/checkpoint_large.py;
    ~7 GB on learner 0; ~60 s: the bytes are the point). No tensor crosses MPI on this path
    (each learner writes and reads its own ranges), so one MPI is enough (the transfers over
    2^31 bytes that cross MPI: test_transport.py)."""
    mpi = "mpich"
    out = hpcvla("launch", "-n", 2, "--mpi", mpi, "--timeout", 400, "--",
                 MPI_DIR / "checkpoint_large.py", tmp_path, timeout=420)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bit_exact"] and result["optimizer_bytes"] > 2**31, result
    print(f"\n{mpi}: {result}")


def test_damaged_checkpoints_fail_clearly(tmp_path, resumed):
    saved = resumed["fp32"][1]  # ZeRO-1's, copied into a run directory of its own to damage
    path = tmp_path / saved.relative_to(saved.parent.parent)
    shutil.copytree(saved, path)
    assert catalog.latest(tmp_path) == path
    weights = store.load_weights(path)
    assert weights and all(isinstance(v, torch.Tensor) for v in weights.values())

    wrong = {k: np.zeros((1, *v.shape)) for k, v in weights.items()}
    with pytest.raises(catalog.CheckpointError, match="do not fit this policy"):
        store.load_weights(path, wrong)

    model = path / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-5] ^= 0xFF
    model.write_bytes(bytes(data))
    with pytest.raises(catalog.CheckpointError, match="checksum mismatch"):
        store.load_weights(path)
    optimizer = next(path.glob("optimizer.rank*.safetensors"))
    whole = optimizer.read_bytes()
    optimizer.write_bytes(whole[:-1000])  # a copy cut short: found from the header alone
    with pytest.raises(catalog.CheckpointError, match=f"{optimizer.name}: .* cut short"):
        catalog.read_state(path)
    assert catalog.resume_problems(str(tmp_path), False, ("pipeline.total_updates", 99))[0][
        2].startswith(f"a readable checkpoint: {optimizer}")  # refused before launch
    optimizer.write_bytes(whole)
    model.unlink()
    with pytest.raises(catalog.CheckpointError, match="missing"):
        store.load_weights(path)

    state = path / "state.json"
    state.write_text(json.dumps({"format": 99}))
    with pytest.raises(catalog.CheckpointError, match="format 99"):
        catalog.read_state(path)
    state.write_text("{not json")
    with pytest.raises(catalog.CheckpointError, match="not valid JSON"):
        catalog.read_state(path)
    state.unlink()
    with pytest.raises(catalog.CheckpointError, match="not a complete"):
        catalog.read_state(path)
    # a directory without state.json (e.g. killed mid-write) is never "latest"
    assert catalog.latest(tmp_path) is None


@pytest.mark.bench
def test_checkpoint_benchmark_runs_its_three_arms(tmp_path):
    """CI's short run of `hpcvla bench checkpoint` (a small policy): none, foreground and
    background, one run each, side by side."""
    out = hpcvla("bench", "checkpoint", "--quick", "--json", tmp_path / "c.json",
                 "policy.hidden=64", timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads((tmp_path / "c.json").read_text())
    assert r["updates"] == 3 and list(r["arms"]) == ["none", "foreground", "background"]
    for arm in r["arms"].values():
        assert len(arm["runs"]) == 1 and arm["wall_s_per_version"] > 0
        assert arm["checkpoint_s_per_version"] > 0  # the last checkpoint, at least
    arms = r["arms"]
    for arm in arms.values():
        assert arm["wall_over_none"] == pytest.approx(arm["wall_s_per_version"] /
                                                      arms["none"]["wall_s_per_version"])
    # a checkpoint at every version (3) against one at the end (their seconds, a few ms each
    # at this size, are too close for one run to order)
    assert [arms[a]["checkpoints_per_learner"] for a in arms] == [1, 3, 3]
    assert "background:" in out.stdout


def test_a_replicated_optimizer_state_is_saved_once_only_where_the_learners_agree():
    """Stage 0 and Horovod: learner 0 saves the state every learner holds whole, after a
    collective check that the copies agree (a learner that diverged is named)."""
    out = hpcvla("launch", "-n", 2, "--timeout", 120, "--", MPI_DIR / "replicas.py")
    assert out.returncode == 0, out.stdout + out.stderr
    for r in (0, 1):
        for case in ("other weights", "one bit"):
            assert f"rank {r}: differing replicas refused ({case})" in out.stdout, out.stdout


def test_a_path_that_is_no_run_or_checkpoint_is_named_with_what_is_there(tmp_path):
    """eval and export say which checkpoints a run keeps when given one it does not (its
    names have 6 digits: `v500` is not `v000500`), a missing path as missing, a file (a
    config, as train takes) as no run, and a run's checkpoints folder as the run's."""
    from hpcvla.checkpoint.catalog import path_problem
    run = tmp_path / "run"
    (run / "checkpoints" / "v000500").mkdir(parents=True)
    (run / "checkpoints" / "v000500" / "state.json").write_text("{}")
    (run / "checkpoints" / "v000520.partial").mkdir()
    (run / "config.yaml").write_text("{}")
    assert path_problem(run) is None and path_problem(run / "checkpoints" / "v000500") is None
    for name in ("v500", "v000520.partial"):
        assert "is not a complete checkpoint of its run (kept there: v000500;" in \
            path_problem(run / "checkpoints" / name)
    assert "no such directory" in path_problem(tmp_path / "elsewhere")
    assert f"{run / 'checkpoints'} is a run's folder of checkpoints: give the run ({run})" in \
        path_problem(run / "checkpoints")
    assert "is not a run directory (no config.yaml)" in path_problem(tmp_path)
    assert f"{run / 'config.yaml'} is a file, not a run directory: give the run directory " \
        "`hpcvla train` printed" in path_problem(run / "config.yaml")


def test_a_resume_says_when_a_versions_batch_is_not_the_checkpoints():
    """Checkpoints record the segments every learner trains a version (`version_segments`);
    a resume on another learner count with the same settings (a run a restart left at 2
    learners x 4 micro-batches, continued on 4) says so, with the micro-batches that keep
    the batch; the same batch, or a checkpoint without the record, says nothing."""
    state = {"counters": {"version_segments": 2 * 16 * 4}}
    said = catalog.batch_change(state, 4, 16, 4)
    assert said == ("a version now trains 256 segments (4 learner(s) x learner.micro_batch 16 "
                    "x micro_batches 4), the run's checkpoint 128: learner.micro_batches=2 "
                    "keeps it")
    assert catalog.batch_change(state, 4, 16, 2) is None
    assert catalog.batch_change({"counters": {}}, 4, 16, 4) is None
    assert catalog.batch_change(state, 3, 16, 4).endswith("the run's checkpoint 128")
    # sft's checkpoints record the chunks a step (`step_chunks`)
    said = catalog.batch_change({"counters": {"step_chunks": 48}}, 3, 8, 1, "sft")
    assert said == ("a step now trains 24 chunks (3 learner(s) x sft.batch_size 8 x "
                    "micro_batches 1), the run's checkpoint 48: sft.micro_batches=2 keeps it")


@pytest.mark.cluster  # root: the check's effective uid another user's
def test_a_run_this_user_cannot_write_is_refused_before_it_resumes(tmp_path):
    """run.resume of a colleague's run (readable, not writable): the world started, and rank
    0 failed on its .lock with a bare PermissionError. Refused before launch, saying what to
    do. (As another user: this process's effective uid, for the check, is nobody's.)"""
    import tempfile
    from pathlib import Path
    from helpers import fake_checkpoint
    run = Path(tempfile.mkdtemp(dir="/tmp"))  # (pytest's folders are its owner's alone)
    try:
        fake_checkpoint(catalog.checkpoint_dir(run, 2), version=2)
        run.chmod(0o755)
        last = ("pipeline.total_updates", 99)
        assert catalog.resume_problems(str(run), False, last) == []  # its owner's
        os.seteuid(65534)
        try:
            [(field, value, why)] = catalog.resume_problems(str(run), False, last)
        finally:
            os.seteuid(0)
    finally:
        shutil.rmtree(run)
    assert field == "run.resume" and why.startswith(f"a run directory this user can write in "
                                                    f"({run} is not: another user's run?"), why
