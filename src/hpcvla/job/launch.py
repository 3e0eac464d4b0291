"""Start an MPI world on this machine without knowing mpiexec's flags.

    hpcvla launch -n 6 -- train configs/default.yaml     # an hpcvla subcommand on 6 ranks
    hpcvla launch -n 4 -- my_script.py --flag            # any Python script on 4 ranks

    hpcvla launch -n 4 --mpi openmpi -- train       # the same world under Open MPI

Every rank runs under `python -m mpi4py`, so an uncaught exception in one rank aborts the whole
world instead of leaving the others waiting. The launcher adds what the MPI needs
(process/mpi_select.py: Open MPI's library for mpi4py, its one-sided components,
oversubscription and run-as-root) and, for both MPIs, one BLAS/OpenMP thread per rank when ranks
are at least as many as cores; it forwards the exit status, and kills the world on a timeout.
A world of `train`, `sft` or `eval` that failed while starting, before any rank registered
(Open MPI's ranks can crash in MPI_Init, open-mpi/ompi#12495), is started again,
HPCVLA_START_RETRIES times (default 2), as jobs/launch.sh does.
Under a batch scheduler use the job scripts in jobs/ (srun / the site's mpiexec) instead.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpcvla.job import leftovers
from hpcvla.process import deathwatch
from hpcvla.process.deathwatch import DeathWatch
from hpcvla.process.mpi_select import LaunchError, select_mpi
from hpcvla.process.threads import usable_cores


# The least a rank holds: an interpreter with numpy, mpi4py and hpcvla's imports (a reach
# simulator rank's peak RSS is ~60 MiB, a learner's ~430)
RANK_FLOOR = 64 << 20


def world_command(n: int, program: list[str], mpiexec: str = "auto",
                  mpi: str = "auto") -> tuple[list[str], dict, signal.Signals]:
    """The argv and environment that start `program` on `n` ranks of this machine, under
    `mpi` (mpich, openmpi or auto: process/mpi_select.py says what each needs), and the
    signal that asks its ranks to stop through that MPI's launcher.

    `program` is an hpcvla subcommand (`["train", "cfg.yaml"]`) or a script (`["x.py", ...]`).
    """
    if n < 1:
        raise LaunchError(f"-n {n}: need at least one rank")
    from hpcvla.memory.host import host_bytes
    host = host_bytes()
    if n * RANK_FLOOR > host:  # a typo's extra zeros, before n processes start
        raise LaunchError(f"-n {n}: {n} ranks on this machine need {n * RANK_FLOOR / 2**30:.0f}"
                          f" GiB or more (each at least {RANK_FLOOR >> 20} MiB), it has "
                          f"{host / 2**30:.1f}: start fewer (--ranks, launch.ranks), or "
                          "across nodes under a scheduler (jobs/)")
    if not program:
        raise LaunchError("nothing to launch: give an hpcvla subcommand or a script after --")
    install = select_mpi(mpi, mpiexec)  # MpiSelectError: a LaunchError
    cmd = [install.mpiexec, "-n", str(n), *install.args]
    env = {**os.environ, **install.env, **install.here_env}  # this machine's ranks only
    # Each rank's share of the cores this process may use (its cpuset, not the host's: an
    # `srun --pty -c 4` on a 128-core node), as jobs/launch.sh gives each its node's share: the
    # ranks' torch, BLAS and OpenMP pools take it (process/threads.py).
    threads = str(max(1, usable_cores() // n))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(name, threads)
    return cmd + rank_program(program), env, signal.Signals[f"SIG{install.stop_signal}"]


def rank_program(program: list[str]) -> list[str]:
    """What each rank runs: under `python -m mpi4py`, so an uncaught exception in one rank
    aborts the world."""
    if program[0].endswith(".py"):
        return [sys.executable, "-m", "mpi4py", *program]
    return [sys.executable, "-m", "mpi4py", "-m", "hpcvla", *program]


def without_ranks(argv: list[str]) -> list[str]:
    """A command line as given, less its --ranks: what the ranks of the world it starts run
    (every other flag and override with them, whatever the command's parser offers)."""
    out, skip = [], False
    for token in argv:
        if skip or token.startswith("--ranks="):
            skip = False
            continue
        skip = token == "--ranks"
        if not skip:
            out.append(token)
    return out


def run_world(n: int, program: list[str], mpiexec: str = "auto",
              timeout: float | None = None, mpi: str = "auto") -> int:
    """Run the world to completion; its exit status, 124 after killing it on timeout, 130 on
    Ctrl-C, 128 + N if a signal N killed it."""
    cmd, env, stop = world_command(n, program, mpiexec, mpi)
    retries = start_retries(program)
    deadline = None if timeout is None else time.monotonic() + timeout
    shm_before = leftovers.segments()
    attempt = 0
    forward = _Forward(stop)
    for sig in (signal.SIGTERM, signal.SIGUSR1):  # for every attempt, and between them
        signal.signal(sig, forward)
    while True:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        code, never_started = _run(cmd, env, left, forward)
        if code != 0:  # a clean exit frees its own segments; tests check that it does
            for line in leftovers.removal_report(leftovers.remove_orphans(shm_before)):
                print(f"hpcvla launch: {line}", file=sys.stderr, flush=True)
        if never_started and attempt == retries > 0 and not forward.signalled:
            print(f"hpcvla launch: the world failed while starting, before any rank "
                  f"registered, {retries + 1} time(s) in a row: not starting it again "
                  f"({START_RETRIES}={retries}; the ranks' first error is above)",
                  file=sys.stderr, flush=True)
        if not never_started or attempt == retries or forward.signalled:
            return code  # a world told to stop (meanwhile, too) is not started again
        attempt += 1
        print(f"hpcvla launch: the world failed while starting (exit {code}), before any rank "
              f"registered: starting it again ({attempt}/{retries})", file=sys.stderr,
              flush=True)


# A world of deathwatch.WORLD_COMMANDS that failed before any rank registered and before a
# run directory existed ran nothing: starting it again loses nothing, trains nothing twice.
START_RETRIES = "HPCVLA_START_RETRIES"  # jobs/launch.sh reads it too


def run_local_world(n: int, program: list[str], cfg, checked: dict[str, str] | None = None
                    ) -> int:
    """A world of `n` ranks of `program` that a command's `--ranks` starts here: its ranks
    time their start from this command's (phases.LAUNCHED_AT), are not the allocation's
    tasks, though inside a job (comms.LOCAL_WORLD: e.g. `bench modes` in a batch job), and
    skip the checks `checked` says this command made (preflight's)."""
    from hpcvla.metrics import phases
    from hpcvla.topology.comms import LOCAL_WORLD
    os.environ.setdefault(phases.LAUNCHED_AT, str(phases.launched_at()))
    os.environ.update({LOCAL_WORLD: "1", **(checked or {})})
    return run_world(n, program, cfg.launch.mpiexec, mpi=cfg.launch.mpi)


def start_retries(program: list[str]) -> int:
    """How many times a world of `program` that failed while starting is started again."""
    if program[0] not in deathwatch.WORLD_COMMANDS:
        return 0  # a script's ranks leave no cards: any failure would look like that
    value = os.environ.get(START_RETRIES) or "2"  # unset or empty: the default, as in bash
    if not value.isdigit():
        raise LaunchError(f"{START_RETRIES}={value} is not a count: set a whole number "
                          "(0 or more), or unset it for its default")
    return int(value)


class _Forward:
    """The handler of a scheduler's SIGTERM/SIGUSR1: it goes on to the world's mpiexec as the
    signal it hands to every rank untouched (`stop`): the run checkpoints and ends
    (hpcvla.process.preempt), and the launcher keeps waiting for it. Heard between two
    attempts, it is remembered: no world is started after it."""

    def __init__(self, stop: signal.Signals):
        self.stop, self.signalled = stop, []
        self.proc: subprocess.Popen | None = None  # the world's mpiexec, while one runs

    def __call__(self, signum: int, frame) -> None:
        self.signalled.append(signum)
        if self.proc is not None:
            self.proc.send_signal(self.stop)


def _run(cmd: list[str], env: dict, timeout: float | None,
         forward: _Forward) -> tuple[int, bool]:
    """The world's exit status; and whether it failed while starting (never_started), not
    refused (exit 2), timed out, interrupted or told to stop by a signal."""
    watch = DeathWatch()  # names a rank that dies without a word (kill -9, OOM)
    try:
        code = _watched(cmd, {**env, **watch.env()}, timeout, watch, forward)
        if code in (0, 124, 130):
            return code, False
        report = watch.report(time.monotonic())
        if report:
            print(report, file=sys.stderr, flush=True)
        return code, code != 2 and not forward.signalled and \
            deathwatch.never_started(watch.dir)
    finally:
        watch.close()


def _watched(cmd: list[str], env: dict, timeout: float | None, watch,
             forward: _Forward) -> int:
    # Own process group, so a timeout or a second Ctrl-C takes down mpiexec and every rank
    # with it; mpiexec gets SIGTERM if this process dies (kill -9, a closed ssh session), so
    # no world trains on without anyone to report it.
    _adopt_orphans()
    stop = forward.stop
    proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                            preexec_fn=_terminated_with(os.getpid()))
    forward.proc = proc
    if forward.signalled:  # heard while this world was being started: it stops too
        proc.send_signal(stop)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        ended = _wait(proc, deadline, watch)
    except KeyboardInterrupt:  # Ctrl-C: as a scheduler's SIGTERM, a second one kills
        print("\nhpcvla: stopping after the version under way and its checkpoint; Ctrl-C "
              "again to kill the world now", file=sys.stderr, flush=True)
        proc.send_signal(stop)
        try:
            ended = _wait(proc, deadline, watch)
        except KeyboardInterrupt:
            ended = False
        if ended:
            _wait_until_gone()
        else:
            _kill_group(proc)
        return 130
    if not ended:
        print(f"hpcvla launch: world still running after {timeout:g} s; killing it",
              file=sys.stderr, flush=True)
        _kill_group(proc)
        _wait_until_gone(grace_s=5.0)
        return 124
    code = proc.returncode
    _wait_until_gone()  # ranks of an aborted world outlive mpiexec a moment, mapping segments
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def _wait(proc: subprocess.Popen, deadline: float | None, watch) -> bool:
    """Wait for the world's mpiexec to exit (True) or `deadline` to pass (False)."""
    while proc.poll() is None:
        if deadline is not None and time.monotonic() > deadline:
            return False
        watch.wait(0.2)
    return True


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _terminated_with(parent: int):
    """A preexec_fn: the child gets SIGTERM when `parent` dies (Linux; elsewhere nothing).
    prctl is looked up here, before the fork: the child of a process with threads (torch's)
    must not dlopen, only call."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # it died before the call: nobody would send it
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _adopt_orphans() -> bool:
    """Make this process the reaper of the world's orphans. MPICH's proxy starts every rank in
    a session of its own, so the ranks are neither in mpiexec's process group nor, once mpiexec
    has exited, anyone's children we could wait for; as subreaper we inherit them (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: fall back to waiting for mpiexec alone
        return False


def _wait_until_gone(grace_s: float = 15.0) -> None:
    """Reap every process the world left behind (ranks adopted after mpiexec ended), so that
    the segments they mapped can be told orphaned. Those still alive after `grace_s` (a loaded
    node is slow to reap) are killed."""
    deadline = time.monotonic() + grace_s
    killed = False
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child left
        if pid:
            continue
        if time.monotonic() > deadline:
            if killed:
                return  # unkillable (D state): leave it to the node's epilogue
            for child in _children():
                _signal(child, signal.SIGKILL)
            killed, deadline = True, time.monotonic() + 5
        time.sleep(0.05)


def _children() -> list[int]:
    me, children = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me:
            children.append(int(stat.parent.name))
    return children


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
