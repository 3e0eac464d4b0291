"""How a job script learns that its world failed while the world's launcher still runs
(deathwatch.first_failure), and which rank `hpcvla`'s own launcher names as the first to die
(DeathWatch): real processes stand for the ranks and the launcher."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpcvla.process import deathwatch, stdio


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
        assert found == [f"rank 0 (simulator) on node 0 (host {socket.gethostname()}, pid "
                         f"{alive.pid}) died first"]
    finally:
        launcher.kill()
        alive.kill()


def test_ranks_found_gone_at_one_look_are_named_together(tmp_path):
    """Two ranks already gone when the watch first looks: a pid gone says nothing of when,
    so both are named, as the ranks the same check found."""
    launcher = subprocess.Popen(["sleep", "60"])
    try:
        first, second = ended_process(), ended_process()
        card(tmp_path, 0, first)
        card(tmp_path, 1, second)
        host = socket.gethostname()
        assert deathwatch.first_failure(tmp_path, launcher.pid, poll_s=0.05) == (
            f"rank 0 (simulator) on node 0 (host {host}, pid {first}) or rank 1 (simulator) on "
            f"node 0 (host {host}, pid {second}) died first (gone by the same check)")
    finally:
        launcher.kill()
        launcher.wait()


def test_a_rank_gone_without_a_word_is_named_beside_one_that_said_why_by_the_same_check(
        tmp_path):
    """A rank killed outright fails its peers' MPI calls to it: on a loaded machine one of
    them may say why before the watch looks. The check that finds both cannot tell which came
    first: both are named (test_exactly_once's learner, killed, and its inference rank's
    weight plane, failed on it)."""
    launcher = subprocess.Popen(["sleep", "60"])
    try:
        gone = ended_process()
        card(tmp_path, 3, gone)
        (tmp_path / "failed.rank0").write_text("hpcvla: weight plane thread of rank 0 failed")
        assert deathwatch.first_failure(tmp_path, launcher.pid, poll_s=0.05) == (
            f"rank 0 failed, and rank 3 (simulator) on node 0 (host {socket.gethostname()}, "
            f"pid {gone}) gone, by the same check")
        card(tmp_path, 0, ended_process())  # the rank that said why, gone too: no news
        (tmp_path / "failed.rank3").touch()
        assert deathwatch.first_failure(tmp_path, launcher.pid, poll_s=0.05) == "rank 0 failed"
    finally:
        launcher.kill()
        launcher.wait()


def test_a_failing_rank_names_the_ranks_of_its_host_already_gone_without_a_word(
        tmp_path, monkeypatch, capfd):
    """A rank killed outright fails its peers' MPI calls to it. The peer that fails looks
    before it aborts the world: the ranks of its host already gone (reaped, a zombie, or
    exiting), but those that finished or said why, died first (test_rank_death's learner on a
    loaded machine: its inference rank's weight plane said why before the launcher looked)."""
    monkeypatch.setenv(deathwatch.ENV, str(tmp_path))
    alive = subprocess.Popen(["sleep", "60"])
    zombie = subprocess.Popen(["true"])  # exited, not yet waited for
    try:
        card(tmp_path, 0, os.getpid())  # the failing rank
        card(tmp_path, 1, alive.pid)
        card(tmp_path, 2, zombie.pid)
        card(tmp_path, 3, gone := ended_process())
        card(tmp_path, 4, ended_process())
        (tmp_path / "done.rank4").touch()
        card(tmp_path, 5, ended_process())
        (tmp_path / "failed.rank5").write_text("hpcvla: rank 5 failed: its own error")
        card(tmp_path, 6, ended_process(), host="another-host")
        while Path(f"/proc/{zombie.pid}/stat").read_text().split()[2] != "Z":
            time.sleep(0.01)
        aborted = []

        class World:  # the communicator's one call made here
            def Abort(self, code):  # noqa: N802 - mpi4py's name
                aborted.append(code)

        deathwatch.abort_world(World(), 0, "hpcvla: weight plane thread of rank 0 failed", 1)
        host = socket.gethostname()
        said = (f"hpcvla: weight plane thread of rank 0 failed\nhpcvla: rank 2 (simulator) on "
                f"node 0 (host {host}, pid {zombie.pid}) or rank 3 (simulator) on node 0 (host "
                f"{host}, pid {gone}) died first, without a word, before this failure")
        assert aborted == [1] and capfd.readouterr().err == said + "\n"
        assert (tmp_path / "failed.rank0").read_text() == said  # what the launcher repeats
    finally:
        alive.kill()
        alive.wait()
        zombie.wait()


def test_a_rank_that_cannot_leave_its_words_with_the_launcher_still_aborts(tmp_path,
                                                                            monkeypatch, capfd):
    """The failure may be the file system's (full, gone), and the launcher's folder on it:
    abort_world says so and aborts the world anyway."""
    (tmp_path / "file").touch()
    monkeypatch.setenv(deathwatch.ENV, str(tmp_path / "file" / "ranks"))  # no folder there
    aborted = []

    class World:
        def Abort(self, code):  # noqa: N802 - mpi4py's name
            aborted.append(code)

    deathwatch.abort_world(World(), 0, "hpcvla: rank 0 (learner) failed: OSError(28)", 1)
    err = capfd.readouterr().err
    assert aborted == [1] and err.startswith("hpcvla: rank 0 (learner) failed: OSError(28)\n")
    assert "could not leave its failure with the launcher" in err


def test_a_rank_whose_launchers_folder_hangs_says_why_and_aborts_anyway(tmp_path,
                                                                        monkeypatch, capfd):
    """The launcher's folder on a shared file system that stalls (a read that never returns):
    the failing rank's words went out first, and it aborts within LAST_WORDS_S, saying the
    folder could not be reached (it waited there for good, wordless, and the world hung)."""
    monkeypatch.setenv(deathwatch.ENV, str(tmp_path))
    stalled = threading.Event()
    monkeypatch.setattr(deathwatch, "_gone_before", lambda rank: stalled.wait(60) and [])
    monkeypatch.setattr(deathwatch, "LAST_WORDS_S", 0.5)
    aborted = []

    class World:
        def Abort(self, code):  # noqa: N802 - mpi4py's name
            aborted.append(code)

    began = time.monotonic()
    try:
        deathwatch.abort_world(World(), 0, "hpcvla: rank 0 (learner) failed: TimeoutError", 1)
    finally:
        stalled.set()
    err = capfd.readouterr().err
    assert aborted == [1] and time.monotonic() - began < 5, time.monotonic() - began
    assert err.startswith("hpcvla: rank 0 (learner) failed: TimeoutError\n"), err
    assert f"could not reach its launcher's folder {tmp_path} in 0.5 s (a stalled file " \
        "system?)" in err, err


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


RANK = """
import os, sys, time
from hpcvla.process import deathwatch
deathwatch.register(int(sys.argv[1]), sys.argv[2], 0, "vm")
if sys.argv[2] == "learner":  # 1 GiB held, every page written: ~0.1 s to tear down
    held = bytearray(1 << 30)
    held[::4096] = b"x" * len(range(0, len(held), 4096))
if sys.argv[2] == "forked" and os.fork() == 0:
    time.sleep(60)  # an env worker outliving its rank
    os._exit(0)
print("registered", flush=True)
sys.stdin.readline()
deathwatch._lifeline.close()  # where a dying process is when mpiexec's proxy learns of it
time.sleep(60)
"""


def rank_process(watch: deathwatch.DeathWatch, rank: int, roles: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(rank), roles], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, **watch.env()})
    assert proc.stdout.readline() == "registered\n"
    return proc


def test_the_rank_whose_files_closed_first_is_named_though_its_pid_outlived_another():
    """A killed rank's files close (mpiexec's proxy sees it die and kills the others) before
    its pid is reaped; the others may be wholly gone by then. Named: the first to close."""
    watch = deathwatch.DeathWatch()
    culprit = rank_process(watch, 0, "inference")
    victim = rank_process(watch, 1, "simulator")
    try:
        for _ in range(10):
            watch.wait(0.05)  # every lifeline accepted and its rank read
        culprit.stdin.write("\n")
        culprit.stdin.flush()
        watch.wait(10)
        victim.kill()
        victim.wait()
        watch.wait(1)
        report = watch.report(time.monotonic())
        assert report and report.startswith(
            f"hpcvla: rank 0 (inference) on node 0 (host vm, pid {culprit.pid}) died first, "), \
            report
    finally:
        for proc in (culprit, victim):
            proc.kill()
        watch.close()


def test_a_rank_killed_outright_is_seen_gone_while_it_still_tears_down_its_memory():
    """A process killed outright first frees its memory (flagged PF_EXITING), then closes its
    files (its lifeline, its MPI sockets, one after another) and becomes a zombie (its pidfd
    readable). Its peers may fail on its first socket to close and say why before its lifeline
    closes: the watch counts it gone from the start, so such a peer is never named alone
    (tests/faults/test_exactly_once.py's learner, once, on a loaded machine)."""
    watch = deathwatch.DeathWatch()
    try:
        for attempt in range(5):  # a test descheduled for the whole tear-down tries again
            rank = rank_process(watch, attempt, "learner")
            for _ in range(10):
                watch.wait(0.05)  # its lifeline accepted and its rank read
            rank.kill()
            deadline = time.monotonic() + 10
            while attempt not in watch.gone and time.monotonic() < deadline:
                watch.wait(0)
            state = Path(f"/proc/{rank.pid}/stat").read_text().rpartition(")")[2].split()[0]
            rank.wait()
            assert attempt in watch.gone
            if state not in ("Z", "X"):
                break
        else:
            raise AssertionError("5 killed ranks, each seen gone only once a zombie")
    finally:
        watch.close()


def test_a_forked_worker_does_not_hold_its_ranks_lifeline_and_a_finished_rank_is_no_death():
    watch = deathwatch.DeathWatch()
    forked = rank_process(watch, 0, "forked")
    finished = rank_process(watch, 1, "simulator")
    try:
        for _ in range(10):
            watch.wait(0.05)
        (watch.dir / "done.rank1").touch()
        finished.kill()
        finished.wait()
        watch.wait(0.5)
        assert watch.first is None
        for fd in watch.pidfds:  # rank 0's lifeline alone tells
            watch.poller.unregister(fd)
            os.close(fd)
        watch.pidfds.clear()
        forked.kill()
        forked.wait()
        watch.wait(10)
        assert watch.first and [card["rank"] for card in watch.first[0]] == [0]
    finally:
        for proc in (forked, finished):
            proc.kill()
        watch.close()


def test_a_launcher_that_exited_0_is_checked_against_this_hosts_ranks(tmp_path):
    """deathwatch.unfinished (jobs/launch.sh after a launcher exited 0): this host's ranks,
    their cards naming the host with or without its domain, must each have finished; another
    host's are not looked at (their files may show late on a network file system)."""
    for rank, host in enumerate(["h0.cluster.example", "h0", "h1"]):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "roles": "learner", "node": 0, "host": host, "pid": 1}))
    (tmp_path / "done.rank1").touch()
    assert deathwatch.unfinished(tmp_path, "h0") == \
        "rank(s) 0 on this host (h0) ended without finishing their work"
    (tmp_path / "done.rank0").touch()
    assert deathwatch.unfinished(tmp_path, "h0.cluster.example") is None
    assert deathwatch.unfinished(tmp_path, "h2") == \
        "no rank of the world registered on this host (h2): none ran here"


def test_a_world_never_started_while_no_rank_registered_and_no_run_was_made(tmp_path):
    """deathwatch.never_started (jobs/launch.sh after a failed world): only a world that left
    no card and no run directory may be started again as it was."""
    watch = subprocess.run([sys.executable, "-m", "hpcvla.process.deathwatch",
                            "never-started", str(tmp_path)])
    assert watch.returncode == 0 and deathwatch.never_started(tmp_path)
    (tmp_path / deathwatch.RUN_DIR_FILE).write_text(str(tmp_path / "run"))
    assert not deathwatch.never_started(tmp_path)
    (tmp_path / deathwatch.RUN_DIR_FILE).unlink()
    (tmp_path / "rank3.json").write_text(json.dumps(
        {"rank": 3, "roles": "learner", "node": 0, "host": "h0", "pid": 1}))
    watch = subprocess.run([sys.executable, "-m", "hpcvla.process.deathwatch",
                            "never-started", str(tmp_path)])
    assert watch.returncode == 1 and not deathwatch.never_started(tmp_path)


def test_a_rank_about_to_abort_waits_until_its_launcher_has_read_what_it_said():
    """mpiexec's proxy reads a rank's stderr from a pipe and stops once the world aborts: a
    rank about to abort (abort_world) waits until the pipe is read empty, a bounded time."""
    read, write = os.pipe()
    stream = os.fdopen(write, "w")
    try:
        stream.write("hpcvla: rank 1 failed\n")
        start = time.monotonic()
        stdio.until_forwarded(stream, within_s=0.3)  # nobody reads: it gives up
        assert 0.3 <= time.monotonic() - start < 2
        got: list[bytes] = []
        start = time.monotonic()  # before the reader's timer: it reads 0.5 s from here on
        threading.Timer(0.5, lambda: got.append(os.read(read, 1 << 16))).start()
        stream.write("its traceback\n")
        stdio.until_forwarded(stream, within_s=10)
        assert 0.5 <= time.monotonic() - start < 5
        assert got == [b"hpcvla: rank 1 failed\nits traceback\n"]
    finally:
        stream.close()
        os.close(read)


def test_what_a_job_script_prints_after_a_failed_world_repeats_what_the_failing_rank_said(
        tmp_path):
    """`python -m hpcvla.process.deathwatch describe` (jobs/lib/world.sh): the ranks, what the
    first rank to fail said (mpiexec may have cut it from the rank's own output as the world
    aborted), and the last progress."""
    card(tmp_path, 0, 101)
    card(tmp_path, 1, 102)
    (tmp_path / "failed.rank1").write_text("hpcvla: rank 1 (learner) failed: OSError()\n"
                                           "hpcvla: rank 0 died first, without a word")
    out = subprocess.run([sys.executable, "-m", "hpcvla.process.deathwatch", "describe",
                          str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stderr.splitlines() == [
        "hpcvla: the world ended badly; its ranks (2 registered):",
        f"  rank 0: simulator on node 0 (host {socket.gethostname()}, pid 101)",
        f"  rank 1: simulator on node 0 (host {socket.gethostname()}, pid 102)",
        "  rank 1 said: hpcvla: rank 1 (learner) failed: OSError()",
        "    hpcvla: rank 0 died first, without a word",
        "  no progress recorded"], out.stderr


def test_the_last_progress_passes_over_a_line_the_death_cut_short(tmp_path):
    """The report's last progress is the newest whole record of an update (or SFT step):
    a line the dying rank left half written, or a record of another kind, is passed over
    (the report crashed on either, and the job script printed a traceback instead)."""
    from hpcvla.process.last_progress import last_progress
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "run_dir").write_text(str(run))
    assert last_progress(tmp_path / "run_dir").startswith("no progress recorded")
    (run / "metrics.jsonl").write_text(
        '{"update": 3, "trained_env_steps": 1200, "time": 41.2}\n'
        '{"heldout/success": 0.5, "time": 42.0}\n'
        '{"update": 4, "trained_env_st')
    assert last_progress(tmp_path / "run_dir") == (
        f"last progress: policy version 3, 1200 trained env steps, 41 s into training "
        f"({run / 'metrics.jsonl'})")
    (run / "metrics.jsonl").write_text('{"step": 7, "trained_chunks": 56, "time": 9.0}\n[1]\n')
    assert last_progress(tmp_path / "run_dir").startswith("last progress: SFT step 7, 56 chunks")


def test_a_launcher_reads_the_end_of_a_long_runs_metrics_only(tmp_path):
    """A run of days writes GBs of metrics.jsonl, which a launcher read whole at every
    failure: its tail holds the newest record, whole lines only."""
    from hpcvla.files import read_log
    from hpcvla.process.last_progress import TAIL_BYTES, last_progress
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "run_dir").write_text(str(run))
    record = '{"update": %d, "trained_env_steps": %d, "time": 1.0, "pad": "%s"}\n'
    lines = [record % (v, 10 * v, "x" * 400) for v in range(1, 6001)]  # ~2.6 MB
    (run / "metrics.jsonl").write_text("".join(lines))
    tail = read_log(run / "metrics.jsonl", TAIL_BYTES)
    assert tail == [json.loads(line) for line in lines[-len(tail):]]  # whole lines
    assert TAIL_BYTES - 1000 < sum(map(len, lines[-len(tail):])) <= TAIL_BYTES
    assert last_progress(tmp_path / "run_dir").startswith(
        "last progress: policy version 6000, 60000 trained env steps")


def test_a_worker_ignores_its_ranks_stop_signal_from_its_first_instant():
    """A job-wide SIGTERM (Slurm's, at a preemption) reaches a rank's helper processes too;
    one still starting its interpreter (a restarted env worker, a dump writer) died of it,
    a fault or a failed run instead of the rank's orderly checkpoint and close."""
    from hpcvla.process import worker
    process, conn = worker.start("hpcvla.envs.isolated")
    try:
        os.kill(process.pid, signal.SIGTERM)  # long before it has imported anything
        time.sleep(1.0)
        assert process.poll() is None, worker.exit_status(process)
    finally:
        conn.send(("close",))
        conn.close()
    assert process.wait(timeout=30) == 0

