"""A rank killed outright (kill -9: no handler runs) takes the whole job down within 30 s,
and `hpcvla train` names the rank, its role, node, host and pid, and the run's last
progress; no rank and no shared-memory segment is left behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcvla.job.leftovers import segments
from helpers import left_behind, rank_pids

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # training runs

ROOT = Path(__file__).resolve().parents[2]


def until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.2)
    return value


@pytest.mark.parametrize("role", ["simulator", "inference", "learner"])
def test_a_killed_rank_takes_the_job_down_and_is_named(tmp_path, role):
    shm_before = segments()
    job = subprocess.Popen([sys.executable, "-m", "hpcvla", "train", "--ranks", "4",
                            f"run.root={tmp_path}", "pipeline.total_updates=100000"],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = until(lambda: next(tmp_path.glob("*/metrics.jsonl"), None), 180,
                        "training")
        until(lambda: metrics.stat().st_size > 0, 120, "a first progress record")
        plan = json.loads((metrics.parent / "plan.json").read_text())
        rank = next(r["rank"] for r in plan["ranks"] if r["roles"] == [role])
        pid = until(lambda: rank_pids(tmp_path).get(rank), 30, "the rank's process")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0 and took < 30, (took, err[-2000:])
    # named alone, or among the ranks gone by the same check of the launcher (the MPI launcher
    # kills the others within milliseconds; a loaded machine may check only after that), or by
    # the rank whose MPI calls to it failed, in its failure's words
    named = next((line.partition(" died first")[0] for line in err.splitlines()
                  if " died first" in line), "")
    assert f"rank {rank} ({role}) on node 0 (host " in named and f"pid {pid})" in named, \
        err[-3000:]
    assert "last progress: policy version" in err
    assert not rank_pids(tmp_path), "ranks left running"
    assert not left_behind(shm_before)
    print(f"{role}: job down {took:.1f} s after kill -9")


@pytest.mark.cluster  # root: a mount namespace with a /dev/shm of its own
def test_a_window_larger_than_the_room_in_dev_shm_ends_the_world_naming_it(tmp_path):
    """MPI maps a window's segment in /dev/shm sparse: one larger than the room left was
    allocated without a word, and the learner died of SIGBUS zeroing its ring, named by
    nobody. Now the rank allocating it names the window, its host and the fix, and the world
    ends within seconds; the default ring in the same /dev/shm runs."""
    wrap = ["unshare", "--mount", "sh", "-c",
            'mount -t tmpfs -o size=96m tmpfs /dev/shm && exec "$@"', "sh"]
    train = [sys.executable, "-m", "hpcvla", "train", "configs/default.yaml",
             "pipeline.total_updates=2", f"run.root={tmp_path}"]
    started = time.monotonic()
    out = subprocess.run([*wrap, *train, "learner.ring_slot_kib=4096"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and time.monotonic() - started < 60, out.stderr[-3000:]
    # every rank of the ring hears the verdict: whichever the launcher reports first names it
    assert "on node 0 (host " in out.stderr, out.stderr[-3000:]
    assert "the learner's trajectory ring needs 128 MiB of the node's shared memory and " \
        "/dev/shm has" in out.stderr and "a larger /dev/shm" in out.stderr, out.stderr[-3000:]
    out = subprocess.run([*wrap, *train], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "[hpcvla] done" in out.stdout, out.stderr[-3000:]


@pytest.mark.cluster  # root: a mount namespace with a /dev/shm of its own
def test_a_world_of_one_that_aborts_leaves_no_shared_memory_behind(tmp_path):
    """`hpcvla sft` (or eval) run alone is a world of one, MPICH's singleton: its abort left
    its shared-memory file in /dev/shm (a world under mpiexec has its launcher clean up), and
    a node's /dev/shm filled over failed runs until a later job died of SIGBUS."""
    script = tmp_path / "abort.py"
    script.write_text("from mpi4py import MPI\nfrom hpcvla.process import deathwatch\n"
                      "deathwatch.abort_world(MPI.COMM_WORLD, 0, 'hpcvla: fails on purpose', 3)\n")
    out = subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs "
                          '/dev/shm && "$@"; echo "$? left:" $(ls /dev/shm)', "sh",
                          sys.executable, str(script)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.splitlines()[-1] == "3 left:", out.stdout + out.stderr[-2000:]


POPULATE = """
import mmap, numpy as np
from hpcvla.transport.windows import _populate
with open("/dev/shm/sparse", "wb+") as f:      # 4 MiB, sparse, in a 1 MiB tmpfs
    f.truncate(4 << 20)
    memory = np.frombuffer(mmap.mmap(f.fileno(), 4 << 20), np.uint8)
    print("populated" if _populate(memory[: 256 << 10]) else "no room",
          "populated" if _populate(memory) else "no room")
"""


@pytest.mark.cluster  # root: a mount namespace with a /dev/shm of its own
def test_windows_that_fit_alone_but_not_together_are_refused_naming_the_room():
    """Two 40 MiB node-shared windows in an 80 MiB /dev/shm: each fits alone, and MPI maps
    them sparse, so both were allocated and the first rank to write the second died of SIGBUS.
    Now each window's pages are faulted in as it is made (MADV_POPULATE_WRITE), the second's
    check sees the first's, and it is refused naming the room; a sparse mapping larger than
    its tmpfs fails to populate instead of raising SIGBUS."""
    def in_small_shm(size, *command):
        return subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o "
                               f"size={size} tmpfs /dev/shm && exec \"$@\"", "sh", *command],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = in_small_shm("80m", sys.executable, "-m", "hpcvla", "launch", "-n", "2", "--",
                       str(ROOT / "tests" / "mpi" / "shm_windows.py"))
    assert "refused: host " in out.stdout and "the second window needs 40 MiB of the " \
        "node's shared memory and /dev/shm has" in out.stdout, out.stdout + out.stderr[-2000:]
    out = in_small_shm("1m", sys.executable, "-c", POPULATE)
    assert out.stdout.split() == ["populated", "no", "room"], out.stdout + out.stderr[-2000:]
