"""What a failed MPICH world leaves on a node, which a launcher removes (hpcvla.job.leftovers):
segments in /dev/shm, mapped by real processes, and Hydra's topology files in /tmp, held open
by a real world's proxy."""

import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpcvla.job import leftovers


def _segment(name: str) -> Path:
    path = leftovers.SHM_DIR / f"mpich_hpcvla_test_{os.getpid()}_{name}"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    return path


def test_only_unmapped_segments_are_removed_and_one_mapped_during_the_settle_is_spared():
    before = leftovers.segments()
    left = _segment("left")  # a dead world's: nobody maps it
    live = _segment("live")  # a running world's
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 0):
        creating = _segment("creating")  # another world's, mapped an instant after creation

        def map_it(hold):
            with open(creating, "r+b") as g, mmap.mmap(g.fileno(), 0):
                hold.wait()

        hold = threading.Event()
        mapper = threading.Timer(0.2, map_it, args=(hold,))
        mapper.start()
        try:
            removed = leftovers.remove_orphans(before, settle_s=1.0)
        finally:
            hold.set()
            mapper.join()
        # (and any topology file no process has open: below)
        assert {p for p in removed if p.parent == leftovers.SHM_DIR} == {left}
        assert not left.exists()
        assert creating.exists() and live.exists()
    remaining = leftovers.segments() - before
    assert remaining == {creating, live}
    for path in remaining:
        path.unlink()


def test_open_mpis_and_nccls_segments_of_a_killed_world_are_removed_too():
    """Open MPI's ranks killed in a world leave their shared-memory segments (4.1:
    `vader_segment.<host>.<uid>.<job>.<rank>`, 4 MiB; 5.0: `sm_segment...`, 16 MiB: seen
    here), and NCCL its `nccl-*`: only MPICH's were removed, and a shared node's /dev/shm
    filled over failed runs. Mapped ones stay."""
    before = leftovers.segments()
    left = [leftovers.SHM_DIR / f"{prefix}hpcvla_test_{os.getpid()}"
            for prefix in ("vader_segment.", "sm_segment.", "nccl-")]
    for path in left:
        path.write_bytes(b"\0" * mmap.PAGESIZE)
    live = left.pop()
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 0):
        removed = leftovers.remove_orphans(before, settle_s=0.2)
        assert set(left) <= removed and live not in removed and live.exists()
        assert not any(path.exists() for path in left)
    live.unlink()


def test_the_command_a_job_runs_on_each_node_removes_orphans_and_says_which():
    """jobs/launch.sh runs it on every node after a failed world."""
    before = leftovers.segments()
    left = _segment("dead-world")
    # as jobs/launch.sh runs it: every orphan of this user's on the node goes, its own
    # (`before`) included; the test's are the ones named here
    out = subprocess.run([sys.executable, "-m", "hpcvla.job.leftovers", "remove-orphans"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert not left.exists()
    assert "removed" in out and left.name in out, out
    assert leftovers.segments() <= before


@pytest.mark.mpi
def test_hpcvla_launch_removes_what_its_failed_world_left_and_says_which(tmp_path):
    """`hpcvla launch` (and so `hpcvla train --ranks`) after a world that failed: the segments
    made since it started that no process maps go, named on its stderr; one from before its
    world stays (its own world's, for all it knows, are the new ones)."""
    older = _segment("before-the-world")
    script = tmp_path / "fail.py"
    script.write_text("import mmap, sys\nfrom mpi4py import MPI\n"
                      f"open({str(leftovers.SHM_DIR)!r} + '/mpich_hpcvla_test_' + "
                      "str(MPI.COMM_WORLD.Get_rank()), 'wb').write(bytes(mmap.PAGESIZE))\n"
                      "MPI.COMM_WORLD.Barrier()\n"  # both written before either fails
                      "sys.exit(3)\n")
    try:
        out = subprocess.run([sys.executable, "-m", "hpcvla", "launch", "-n", "2", "--timeout",
                              "60", "--", str(script)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode != 0
        # (with the world's own: MPICH's, which its aborted ranks left)
        (said,) = [line.split() for line in out.stderr.splitlines()
                   if line.startswith("hpcvla launch: ") and "MPI segment(s)" in line]
        assert {"mpich_hpcvla_test_0", "mpich_hpcvla_test_1"} <= set(said), out.stderr
        assert older.name not in said
        assert older.exists()
        assert not list(leftovers.SHM_DIR.glob("mpich_hpcvla_test_[01]"))
    finally:
        older.unlink()


def test_a_second_look_is_taken_only_when_something_is_unmapped():
    """A new segment a live process maps is not an orphan, and no second look waits for it."""
    before = leftovers.segments()
    mapped = _segment("mapped")
    try:
        with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 0):
            start = time.monotonic()
            assert leftovers.orphans(before, settle_s=5.0) == set()
            assert time.monotonic() - start < 2.0
    finally:
        mapped.unlink()


def _topology_file(name: str) -> Path:
    path = leftovers.TOPOLOGY_DIR / f"{leftovers.TOPOLOGY_PREFIX}hpcvla_test_{os.getpid()}_{name}"
    path.write_text("<topology/>")
    return path


def test_only_topology_files_no_process_has_open_are_removed():
    dead = _topology_file("dead-proxy")  # its proxy was killed with its world
    live = _topology_file("live-proxy")  # a running world's proxy holds its file open
    with open(live):
        removed = leftovers.remove_orphans(leftovers.segments())
        assert dead in removed and not dead.exists()
        assert live.exists()
    live.unlink()


@pytest.mark.mpi
def test_a_killed_worlds_topology_file_is_removed_and_a_running_worlds_kept():
    """MPICH's Hydra proxy writes /tmp/hydra_hwloc_xmlfile_* for its ranks and holds it open;
    killed with its world (as Slurm kills a job's processes at its time limit), it leaves it
    behind."""
    program = ("from mpi4py import MPI; import time; MPI.COMM_WORLD.Barrier(); "
               "MPI.COMM_WORLD.rank or print('ready', flush=True); time.sleep(120)")
    before = leftovers.segments()
    world = subprocess.Popen(["mpiexec", "-n", "2", sys.executable, "-c", program],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             start_new_session=True)
    try:
        assert world.stdout.readline() == "ready\n"  # both ranks passed the barrier
        topology = _proxy_file(world.pid)
        # Hydra starts its proxy and each rank in a session of their own: the world's
        # processes are mpiexec's descendants, not its process group
        processes = [world.pid, *_descendants(world.pid)]
        created = _mapped_by(processes)  # this world's segments: other tests' worlds run beside
        assert created and topology not in leftovers.remove_orphans(leftovers.segments())
        with open(topology):  # so that no neighbouring test's cleanup takes it meanwhile
            for pid in processes:  # as Slurm kills a job's processes: every one of them
                os.kill(pid, signal.SIGKILL)
            world.wait(timeout=60)
            assert topology.exists()  # the proxy left it
    finally:
        if world.poll() is None:
            world.kill()
            world.wait()
    _wait_gone(processes)  # a rank still exiting maps the world's segment, which would then
    # outlive the cleanup (mpiexec's exit does not wait for its ranks)
    removed = leftovers.remove_orphans(before)  # the killed world's segment too
    assert not topology.exists() and created <= removed
    assert not any(path.exists() for path in created)


def _mapped_by(pids: list[int]) -> set[Path]:
    """The MPICH segments processes `pids` map."""
    mapped = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        mapped.update(Path(line.split()[-1]) for line in maps if "/dev/shm/mpich_" in line)
    return mapped


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    """Until none of `pids` is a live process (a zombie maps nothing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live = []
        for pid in pids:
            try:  # pid (comm) state ...: after the comm's closing parenthesis
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                live.append(pid)
        if not live:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes {live} still live after {timeout_s} s")


def _proxy_file(mpiexec_pid: int, timeout_s: float = 60.0) -> Path:
    """The topology file the world's Hydra proxy holds open."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proxies = [pid for pid in _descendants(mpiexec_pid) if _comm(pid) == "hydra_pmi_proxy"]
        held = [path for pid in proxies
                for path in leftovers.held_open(leftovers.TOPOLOGY_PREFIX, pid)]
        if held:
            return held[0]
        time.sleep(0.2)
    raise AssertionError("the world's proxy never opened a topology file")


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(child) for child in out] + [d for child in out for d in _descendants(int(child))]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
