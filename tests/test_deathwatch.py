"""How a job script learns that its world failed while the world's launcher still runs
(deathwatch.first_failure): real processes stand for the ranks and the launcher."""

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

from hpcvla.process import deathwatch


def card(folder: Path, rank: int, pid: int, host: str | None = None) -> None:
    (folder / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "roles": "simulator", "node": 0, "host": host or socket.gethostname(),
         "pid": pid}))


def ended_process() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_rank_of_this_host_gone_without_finishing_is_a_failure(tmp_path):
    launcher = subprocess.Popen(["sleep", "60"])
    alive = subprocess.Popen(["sleep", "60"])
    try:
        card(tmp_path, 0, alive.pid)
        card(tmp_path, 1, ended_process())
        (tmp_path / "done.rank1").touch()  # rank 1 finished its work: no failure
        card(tmp_path, 2, ended_process(), host="another-host")  # its pid means nothing here
        found: list[str | None] = []
        watch = threading.Thread(target=lambda: found.append(
            deathwatch.first_failure(tmp_path, launcher.pid, poll_s=0.05)))
        watch.start()
        watch.join(0.5)
        assert watch.is_alive(), found  # nothing failed yet
        alive.kill()
        alive.wait()
        watch.join(10)
        assert found == [f"rank 0 (simulator, pid {alive.pid}) is gone without finishing"]
    finally:
        launcher.kill()
        alive.kill()


def test_a_rank_that_said_why_is_a_failure_and_an_ended_launcher_ends_the_watch(tmp_path):
    launcher = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "failed.rank3").touch()
        assert deathwatch.first_failure(tmp_path, launcher.pid) == "rank 3 failed"
    finally:
        launcher.kill()
        launcher.wait()
    (tmp_path / "failed.rank3").unlink()
    watch = subprocess.run([sys.executable, "-m", "hpcvla.process.deathwatch", "first-failure",
                            str(tmp_path), str(launcher.pid)], capture_output=True, text=True,
                           timeout=30)
    assert watch.returncode == 1 and not watch.stdout, watch
