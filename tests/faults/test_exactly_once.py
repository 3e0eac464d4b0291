"""Nothing lost, nothing trained twice, across a restart: every segment group the producers of
a world sent is accounted for by (producer, slot, sequence number): trained exactly once, or
drained unused at the end, under long-tail simulators and a slow learner (segments arrive out
of order); and when a rank dies, the world that jobs/launch.sh starts again from the newest
checkpoint trains nothing of the dead world's: what its learner trained is exactly what its
own producer sent, less what was left unused, from sequence number 0 on. A launcher that does
not end its failed world (mpiexec after a node failure waits for the dead node) is ended by
jobs/launch.sh. An `hpcvla sft` world restarted so trains again the steps lost, on the same
batches, and no other."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import (ROOT, left_behind, plant_orphan_segment, progress_version, reach_demos,
                     removed_by_name, sft_worlds)
from hpcvla.checkpoint import catalog
from hpcvla.job.leftovers import segments

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # training runs


def restarting_job(runs, ranks: int, config: str, *overrides, command: str = "train"):
    """jobs/launch.sh COMMAND CONFIG OVERRIDES as a job with one restart in its allocation
    (no scheduler here: its own mpiexec), runs under `runs`, a failed world ended 2 s after a
    rank of it is gone, without the node check (the job scripts' tests run it). Its output,
    stdout and stderr together, is the process's stdout."""
    env = {**os.environ, "HPCVLA_JOB_RUNS": str(runs), "HPCVLA_RESTARTS": "1",
           "HPCVLA_RANKS": str(ranks), "HPCVLA_END_GRACE_S": "2", "HPCVLA_DOCTOR": "0"}
    return subprocess.Popen([ROOT / "jobs/launch.sh", command, config, *overrides], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_every_sent_group_is_trained_once_or_left_unused_across_a_restart(tmp_path):
    """The learner of a world killed (SIGKILL) after a checkpoint, its launcher (mpiexec)
    stopped so that it cannot end the world; jobs/launch.sh ends it and restarts the world
    from the checkpoint: every segment group a producer sent is trained once or counted as
    unused, across both worlds. ~45 s: two training worlds and the restart between them."""
    runs, updates = tmp_path / "runs", 6
    shm_before = segments()
    proc = restarting_job(runs, 4, "configs/default.yaml", f"pipeline.total_updates={updates}",
                          "learner.checkpoint_every=2", "emulate.learner_ms_per_micro_batch=100",
                          "env.latency_median_ms=20", "env.latency_sigma=0.8",
                          "pipeline.progress_every_s=0.1")
    log = []
    try:
        for line in proc.stdout:  # the first world: kill its learner after the checkpoint
            log.append(line)
            if (progress_version(line) or 0) >= 3:
                break
        deadline = time.monotonic() + 60  # version 2's checkpoint, written in the background
        while not any(catalog.latest(run) for run in runs.iterdir() if run.name[0] != "."):
            assert time.monotonic() < deadline, "".join(log)[-5000:]
            time.sleep(0.05)
        cards = [json.loads(p.read_text()) for p in (runs / ".ranks").glob("rank*.json")]
        (learner,) = [c for c in cards if c["roles"] == "learner"]
        (mpiexec,) = subprocess.run(["pgrep", "-P", str(proc.pid), "mpiexec"], text=True,
                                    capture_output=True).stdout.split()
        planted = plant_orphan_segment(f"exactly_once_{proc.pid}")
        os.kill(int(mpiexec), signal.SIGSTOP)
        os.kill(learner["pid"], signal.SIGKILL)
        killed = time.monotonic()
        log += proc.stdout.readlines()
        assert proc.wait(timeout=400) == 0, "".join(log)[-5000:]
    finally:
        proc.kill()
    text = "".join(log)
    assert "restart 1/1" in text, text[-5000:]
    # the learner named: its lifeline to the job script's watch closed first (alone, or among
    # the ranks gone by the same check: the MPI proxy kills the others within milliseconds and
    # a loaded machine may check only after that; or beside the inference rank, which said why
    # by the same check: its weight plane's MPI calls to the dead learner failed)
    ending = next((line for line in text.splitlines()
                   if "and the world has not ended 2 s later: ending its launcher" in line), "")
    named = ending.partition(" died first")[0] if " died first" in ending else \
        ending.partition(" failed, and ")[2].partition(" gone, by the same check")[0]
    assert f"rank {learner['rank']} (learner) on node 0 (host " in named \
        and f"pid {learner['pid']})" in named, text[-5000:]
    assert "the world failed (status 137)" in text, text[-5000:]
    print(f"killed -> end of the restarted run: {time.monotonic() - killed:.1f} s")
    # the MPI segments no process maps, removed before the restart: one planted (a rank that
    # says why it fails unlinks its world's own segments before its abort, and whether one
    # does first is a race), and the killed world's, by the cleanup or by that rank
    assert removed_by_name(planted, text), text[-5000:]
    assert not left_behind(shm_before), text[-5000:]

    (run_dir,) = [p for p in runs.iterdir() if not p.name.startswith(".")]
    summary = json.loads((run_dir / "summary.json").read_text())
    (restart,) = summary["restarts"]
    resumed = restart["resumed_from_version"]
    assert resumed >= 2
    (learner,) = [r for r in summary["per_rank"] if r["role"] == "learner"]
    (inference,) = [r for r in summary["per_rank"] if r["role"] == "inference"]
    assert learner["first_version"] == resumed
    ledger = learner["trained_groups"]
    assert len(ledger) == 4  # 1 producer x 4 slots (2 simulators x 2 shards)
    for slot, entry in ledger.items():
        assert entry["first"] == 0 and entry["missing"] == 0, (slot, entry)  # no holes
    per_group = 8  # envs per shard: 16 envs per simulator in 2 shards
    trained = sum(e["groups"] for e in ledger.values())
    # the versions left, each batch once, and nothing else
    assert trained * per_group == (updates - resumed) * 32 == \
        sum(summary["staleness_hist"].values())
    # what this world's producer sent = trained + drained unused at the end
    assert inference["segments_sent"] == (trained + learner["unused_segment_groups"]) * per_group
    assert learner["ring"]["bad_slots"] == 0 and learner["ring"]["lost_records"] == 0


def test_a_failed_world_without_a_checkpoint_is_not_started_over(tmp_path):
    """HPCVLA_RESTARTS without learner.checkpoint_every(_s): the job says at its start that a
    failed world would have nothing to continue from, and when the learner dies it does not
    start the run over in a new run directory (the restart's record and the run would part).
    ~4 s: one world."""
    runs = tmp_path / "runs"
    proc = restarting_job(runs, 4, "configs/default.yaml", "pipeline.total_updates=100000",
                          "pipeline.progress_every_s=0.1", "learner.checkpoint_every_s=0")
    log = []
    try:
        for line in proc.stdout:
            log.append(line)
            if (progress_version(line) or 0) >= 1:
                break
        cards = [json.loads(p.read_text()) for p in (runs / ".ranks").glob("rank*.json")]
        (learner,) = [c for c in cards if c["roles"] == "learner"]
        os.kill(learner["pid"], signal.SIGKILL)
        log += proc.stdout.readlines()
        assert proc.wait(timeout=120) != 0, "".join(log)[-5000:]
    finally:
        proc.kill()
    text = "".join(log)
    assert "but no checkpoint is written before the run's end (learner.checkpoint_every, " \
        "learner.checkpoint_every_s: 0): a world that fails has none" in text
    assert "the run has no checkpoint to continue from (learner.checkpoint_every, learner." \
        "checkpoint_every_s): not restarting" in text and "restart 1/1" not in text, text[-5000:]
    assert len([p for p in runs.iterdir() if not p.name.startswith(".")]) == 1


def test_a_job_that_continues_a_run_by_name_restarts_that_run(tmp_path):
    """A run continued in a new job (run.resume=RUN, outside the job's run root: what a job
    whose requeue was refused, or PBS's next job, does) is the run the job restarts when its
    world fails: from RUN's newest checkpoint, recorded in RUN (was: "no checkpoint to
    continue from", the job's own run root being empty). ~15 s: three short worlds."""
    first = subprocess.run(
        [sys.executable, "-m", "hpcvla", "train", "configs/colocated.yaml", "--ranks", "2",
         f"run.root={tmp_path / 'old'}", "pipeline.total_updates=2",
         "learner.checkpoint_every=1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    (run,) = (tmp_path / "old").iterdir()
    runs = tmp_path / "job"
    proc = restarting_job(runs, 2, "configs/colocated.yaml", f"run.resume={run}",
                          "pipeline.total_updates=8", "learner.checkpoint_every=2",
                          "pipeline.progress_every_s=0.1")
    log = []
    try:
        for line in proc.stdout:  # the continued world: kill a rank after its checkpoint
            log.append(line)
            if (progress_version(line) or 0) >= 5 and (run / "checkpoints/v000004").exists():
                break
        cards = [json.loads(p.read_text()) for p in (runs / ".ranks").glob("rank*.json")]
        os.kill(next(c["pid"] for c in cards if c["rank"] == 1), signal.SIGKILL)
        log += proc.stdout.readlines()
        assert proc.wait(timeout=300) == 0, "".join(log)[-5000:]
    finally:
        proc.kill()
    text = "".join(log)
    assert "restart 1/1" in text and f"continuing {run}" in text, text[-5000:]
    (restart,) = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert restart["resumed_from_version"] >= 4
    assert (run / "checkpoints/v000008").exists()
    assert not [p for p in runs.iterdir() if not p.name.startswith(".")]  # no run of its own


def test_a_job_started_again_after_its_run_is_complete_trains_nothing(tmp_path):
    """Slurm requeues (or PBS reruns) a job whose run wrote its last checkpoint before the job
    ended: the start finds the run complete in the job's run root and exits 0 without a world
    (was: a second run, from version 0, beside the first). ~8 s: one short world."""
    runs = tmp_path / "runs"
    for start in range(2):
        proc = restarting_job(runs, 2, "configs/colocated.yaml", "pipeline.total_updates=2")
        text = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, text[-5000:]
    assert "has its checkpoint at the end this command runs to: nothing left to train" in text \
        and "running:" not in text, text[-3000:]
    assert len([p for p in runs.iterdir() if not p.name.startswith(".")]) == 1


def test_a_world_that_fails_after_its_last_checkpoint_is_not_run_again(tmp_path):
    """The world dies (a rank SIGKILLed) once its run's last checkpoint is written: there is
    nothing left to train, so the job does not restart it (a new world would have started the
    run over in a new run directory, from version 0, recorded as a resume). ~6 s."""
    runs = tmp_path / "runs"
    proc = restarting_job(runs, 2, "configs/colocated.yaml", "pipeline.total_updates=4",
                          "learner.checkpoint_every=2")
    try:
        deadline = time.monotonic() + 120
        while not list(runs.glob("*/checkpoints/v000004/state.json")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
            time.sleep(0.01)
        cards = [json.loads(p.read_text()) for p in (runs / ".ranks").glob("rank*.json")]
        for card in cards:
            if card["rank"] == 1:
                os.kill(card["pid"], signal.SIGKILL)
        text = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    # the world still runs its teardown (a report, the last barrier) as its last checkpoint
    # appears: the kill lands before it ends
    assert "the world failed" in text, text[-5000:]
    assert "nothing left to restart" in text and "restart 1/1" not in text, text[-5000:]
    assert len([p for p in runs.iterdir() if not p.name.startswith(".")]) == 1


def test_a_failed_sft_world_restarts_and_trains_the_lost_steps_again_on_the_same_batches(
        tmp_path):
    """`hpcvla sft` on 2 learners, one SIGKILLed after a checkpoint: jobs/launch.sh starts the
    world again from that checkpoint, and it trains the steps the dead world had trained
    beyond it on the same batches (their losses equal), the chunk count going on from the
    checkpoint's; the restart's record names the steps lost. ~15 s: two short worlds."""
    demos, runs, steps = tmp_path / "demos.h5", tmp_path / "runs", 200
    proc = restarting_job(runs, 2, "configs/default.yaml", f"sft.demos={reach_demos(demos, 6)}",
                          f"sft.steps={steps}", "sft.batch_size=8", "sft.checkpoint_every=20",
                          "pipeline.progress_every_s=0.1", command="sft")
    log = []
    try:
        for line in proc.stdout:  # kill a learner once a checkpoint is whole, steps after it
            log.append(line)
            done = [p for p in runs.glob("*/checkpoints/v*/state.json")
                    if not p.parent.name.endswith(".partial")]
            step = re.match(r"\[hpcvla sft\] step (\d+)/", line)
            if done and step and int(step.group(1)) >= 30:
                break
        cards = [json.loads(p.read_text()) for p in (runs / ".ranks").glob("rank*.json")]
        (second,) = [c for c in cards if c["rank"] == 1]
        os.kill(second["pid"], signal.SIGKILL)
        log += proc.stdout.readlines()
        assert proc.wait(timeout=300) == 0, "".join(log)[-5000:]
    finally:
        proc.kill()
    text = "".join(log)
    assert "restart 1/1" in text and "last progress: SFT step " in text, text[-5000:]
    (run_dir,) = [p for p in runs.iterdir() if not p.name.startswith(".")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["learners"] == 2
    (restart,) = summary["restarts"]
    resumed = restart["resumed_from_version"]
    assert resumed >= 20 and resumed % 20 == 0
    assert f"from SFT step {resumed}" in text, text[-5000:]
    first, again = sft_worlds(run_dir, resumed)
    assert [r["step"] for r in first] == list(range(1, len(first) + 1))
    assert [r["step"] for r in again] == list(range(resumed + 1, steps + 1))
    assert all(r["trained_chunks"] == r["step"] * 16 for r in first + again)  # 2 learners x 8
    lost = first[-1]["step"] - resumed
    assert restart["lost_steps"] == lost >= 0 and restart["trained_steps"] == first[-1]["step"]
    redone = again[:lost]
    assert [r["loss"] for r in redone] == pytest.approx([r["loss"] for r in first[resumed:]],
                                                        rel=1e-6)
