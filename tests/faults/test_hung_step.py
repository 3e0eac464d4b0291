"""A simulator step that never returns (injected: `env.hang_at_step`) is caught by the step
watchdog within `env.step_timeout_s`: the rank prints its stacks (the stuck line in the env on
top), the launcher names the rank and its role and stops the whole job; nothing hangs. A
learner of `hpcvla sft` that stops (SIGSTOP) is said by the others, each
pipeline.stall_timeout_s, still in their step; let go, the run goes on to its end."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers import rank_pids, reach_demos

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


def test_the_step_guard_lets_many_steps_and_long_waits_be_and_ends_a_hung_step():
    """process/watchdog.StepGuard, the simulator's watchdog: thousands of short steps and a
    wait of twice its timeout between steps end nothing; a step that hangs ends the process
    with every stack within its timeout (at least 0.9 x of it after the step began)."""
    script = """if True:
        import time
        from hpcvla.process.watchdog import StepGuard
        with StepGuard(1.0) as watchdog:
            begin, steps = time.monotonic(), 0
            while time.monotonic() - begin < 2.0:
                with watchdog.guard():
                    steps += 1
            begin = time.monotonic()
            while time.monotonic() - begin < 2.0:
                watchdog.idle()
                time.sleep(0.01)
            print(f"alive after {steps} steps", flush=True)
            hung = time.monotonic()
            with watchdog.guard():
                time.sleep(30)
        """
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    took = time.monotonic() - start
    assert out.returncode == 1 and out.stdout.startswith("alive after "), out
    assert int(out.stdout.split()[2]) > 1000, out.stdout  # not one timer per step
    assert "Timeout (0:00:01)!" in out.stderr and "line 16 in <module>" in out.stderr, \
        out.stderr  # the hung step's line, time.sleep(30)
    assert 4.9 < took < 10, took


def read_until(proc: subprocess.Popen, log: list[str], done) -> None:
    """The job's output into `log` until a line for which `done(line)` (or its end)."""
    for line in proc.stdout:
        log.append(line)
        if done(line):
            return


def test_a_stopped_sft_learner_is_said_by_the_others_and_the_run_goes_on(tmp_path):
    """~12 s: two short worlds (the demonstrations', the fine-tuning's)."""
    demos = reach_demos(tmp_path / "demos.h5", 4)
    proc = subprocess.Popen([sys.executable, "-m", "hpcvla", "sft", "configs/default.yaml",
                             f"sft.demos={demos}", "sft.steps=200", "sft.batch_size=8",
                             "pipeline.stall_timeout_s=1", "pipeline.progress_every_s=0.1",
                             f"run.root={tmp_path / 'runs'}", "--ranks", "2"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        read_until(proc, log, lambda line: line.startswith("[hpcvla sft] step "))
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "hpcvla" in " ".join(p.cmdline()) and "mpiexec" not in p.name()
                 and "hydra" not in p.name()]
        assert len(ranks) == 2, [p.cmdline() for p in ranks]
        os.kill(ranks[0].pid, signal.SIGSTOP)
        # the other learner, waiting in the step's collective
        read_until(proc, log, lambda line: "has been in step" in line and "for 2 s" in line)
        os.kill(ranks[0].pid, signal.SIGCONT)
        log += proc.stdout.readlines()
        assert proc.wait(timeout=300) == 0, "".join(log)[-3000:]
    finally:
        proc.kill()
    text = "".join(log)
    assert "hpcvla sft: rank " in text and " has been in step " in text and \
        "(waiting for the other learners, or stuck itself)" in text, text[-3000:]
    # its start-up too, which takes longer than 1 s here (it was said by no learner)
    assert re.search(r"hpcvla sft: rank \d has been in its start-up for \d+ s \(its last step "
                     r"done: \w+; waiting for the other learners", text), text[-3000:]
    assert "[hpcvla sft] step 200/200" in text, text[-3000:]


def test_a_stopped_training_learner_is_named_and_the_run_goes_on(tmp_path):
    """`hpcvla train` with two learners, one stopped (SIGSTOP: no word of its own): the
    other says, each pipeline.stall_timeout_s, that it is still in its version (waiting in
    the collective), and the inference rank that feeds the stopped one names it (a small ring:
    its lane fills); let go, the run goes on to its end, the stopped learner not mistaking its
    own absence for its producers' silence. ~15 s: a world of 6."""
    proc = subprocess.Popen([sys.executable, "-m", "hpcvla", "train", "configs/default.yaml",
                             "--ranks", "6", f"run.root={tmp_path}",
                             "placement.per_node={simulator: 2, inference: 2, learner: 2}",
                             "pipeline.total_updates=20", "pipeline.stall_timeout_s=2",
                             "pipeline.progress_every_s=0.5", "learner.ring_slots=2",
                             "learner.ring_slot_kib=4"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        read_until(proc, log, lambda line: line.startswith("[hpcvla] update "))
        (run_dir,) = tmp_path.iterdir()
        plan = json.loads((run_dir / "plan.json").read_text())
        learners = [r["rank"] for r in plan["ranks"] if "learner" in r["roles"]]
        feeding = [int(p) for p, learner in plan["feeds"].items() if learner == learners[1]]
        pids = rank_pids(tmp_path)
        os.kill(pids[learners[1]], signal.SIGSTOP)
        let_go = threading.Timer(60, os.kill, (pids[learners[1]], signal.SIGCONT))
        let_go.start()  # whatever is heard: the run ends, and the test with it
        said = {"peer": f"rank {learners[0]} (learner) has been in version",
                "feeder": f"rank {feeding[0]} (inference): its ring lane to learner rank "
                          f"{learners[1]} has been full"}
        heard: set[str] = set()

        def both_heard(line: str) -> bool:
            heard.update(who for who, words in said.items() if words in line)
            return len(heard) == 2
        read_until(proc, log, both_heard)
        let_go.cancel()
        os.kill(pids[learners[1]], signal.SIGCONT)
        log += proc.stdout.readlines()
        assert proc.wait(timeout=300) == 0, "".join(log)[-3000:]
    finally:
        proc.kill()
    text = "".join(log)
    assert heard == set(said), text[-3000:]
    assert "[hpcvla] update 20/20" in text, text[-3000:]
    # the feeder's wait for its full lane is its own stage (`ring_full`, inside `send`), the
    # learner having set the pace: over pipeline.stall_timeout_s of it; no rank's stages add
    # up to more than its time (a sharded simulator's shards step side by side: not its)
    summary = json.loads((run_dir / "summary.json").read_text())
    ranks = {r["rank"]: r for r in summary["per_rank"] if r["role"] != "simulator"}
    assert ranks[feeding[0]]["busy_s"]["ring_full"] > 2.0, ranks[feeding[0]]
    assert all(sum(r["busy_s"].values()) <= r["active_s"] + 0.01 for r in ranks.values()), \
        {k: (r["active_s"], r["busy_s"]) for k, r in ranks.items()}
    print("".join(line for line in log if line.startswith("hpcvla: rank ")))
