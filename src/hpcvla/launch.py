"""Start an MPI world on this machine without knowing mpiexec's flags.

    hpcvla launch -n 6 -- train configs/default.yaml     # an hpcvla subcommand on 6 ranks
    hpcvla launch -n 4 -- my_script.py --flag            # any Python script on 4 ranks

Every rank runs under `python -m mpi4py`, so an uncaught exception in one rank aborts the whole
world instead of leaving the others waiting. The launcher adds what this machine needs (Open
MPI: oversubscription and run-as-root; both MPIs: one BLAS/OpenMP thread per rank when ranks
outnumber cores), forwards the exit status, and kills the world on a timeout.
Under a batch scheduler use the job scripts in jobs/ (srun / the site's mpiexec) instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpcvla.deathwatch import DeathWatch


class LaunchError(RuntimeError):
    pass


def find_mpiexec(choice: str = "auto") -> str:
    """The mpiexec to use: an explicit path, else the one next to this Python, else PATH's."""
    if choice != "auto":
        found = shutil.which(choice)
        if not found:
            raise LaunchError(f"launch.mpiexec = {choice!r} is not an executable; give a path "
                              "to mpiexec/mpirun or `auto`")
        return found
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise LaunchError("no mpiexec found: run `make install` (it installs MPICH from PyPI) or "
                          "load your site's MPI module")
    return found


def mpi_flavour(mpiexec: str) -> str:
    """'mpich', 'openmpi' or 'unknown', from `mpiexec --version`."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "HYDRA" in out or "MPICH" in out:
        return "mpich"
    if "Open MPI" in out or "OpenRTE" in out or "open-mpi" in out:
        return "openmpi"
    return "unknown"


def world_command(n: int, program: list[str], mpiexec: str = "auto") -> tuple[list[str], dict]:
    """The argv and environment that start `program` on `n` ranks of this machine.

    `program` is an hpcvla subcommand (`["train", "cfg.yaml"]`) or a script (`["x.py", ...]`).
    """
    if n < 1:
        raise LaunchError(f"-n {n}: need at least one rank")
    if not program:
        raise LaunchError("nothing to launch: give an hpcvla subcommand or a script after --")
    exe = find_mpiexec(mpiexec)
    cmd, env = [exe, "-n", str(n)], dict(os.environ)
    if mpi_flavour(exe) == "openmpi":
        cmd.append("--oversubscribe")
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        env.setdefault("OMPI_MCA_osc", "^ucx")  # avoids a harmless per-rank UCX error
    if n >= (os.cpu_count() or 1):
        # Oversubscribed ranks must not each spin up a thread per core.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
    target = program[0]
    if target.endswith(".py"):
        cmd += [sys.executable, "-m", "mpi4py", *program]
    else:
        cmd += [sys.executable, "-m", "mpi4py", "-m", "hpcvla", *program]
    return cmd, env


def run_world(n: int, program: list[str], mpiexec: str = "auto",
              timeout: float | None = None) -> int:
    """Run the world to completion; its exit status, or 124 after killing it on timeout."""
    cmd, env = world_command(n, program, mpiexec)
    shm_before = _shm_files()
    code = _run(cmd, env, timeout)
    if code != 0:  # a clean exit frees its own segments; tests check that it does
        _remove_orphaned_shm(shm_before)
    return code


def _run(cmd: list[str], env: dict, timeout: float | None) -> int:
    watch = DeathWatch()  # names a rank that dies without a word (kill -9, OOM)
    try:
        code = _watched(cmd, {**env, **watch.env()}, timeout, watch)
        if code not in (0, 124, 130):
            report = watch.report(time.monotonic())
            if report:
                print(report, file=sys.stderr, flush=True)
        return code
    finally:
        watch.close()


def _watched(cmd: list[str], env: dict, timeout: float | None, watch) -> int:
    # Own process group, so a timeout or Ctrl-C takes down mpiexec and every rank with it.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    # A scheduler's SIGTERM/SIGUSR1 goes on to mpiexec, which hands it to every rank: the
    # run checkpoints and ends (hpcvla.preempt); we keep waiting for it.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                print(f"hpcvla launch: world still running after {timeout:g} s; killing it",
                      file=sys.stderr, flush=True)
                _kill_group(proc)
                return 124
            watch.wait(0.2)
    except KeyboardInterrupt:
        _kill_group(proc)
        return 130
    code = proc.returncode
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


SHM_DIR = Path("/dev/shm")


def _shm_files() -> set[Path]:
    return set(SHM_DIR.glob("mpich_*")) if SHM_DIR.is_dir() else set()


def _remove_orphaned_shm(before: set[Path]) -> None:
    """An aborted or killed MPICH world leaves its shared-memory segments in /dev/shm. Remove
    those that appeared during this run and that no live process still maps."""
    for path in orphaned_shm(before):
        path.unlink(missing_ok=True)


def orphaned_shm(before: set[Path]) -> set[Path]:
    """MPICH segments that appeared since `before` and that no live process maps (other
    worlds running beside this one still map theirs)."""
    new = _shm_files() - before
    if not new:
        return set()
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split()[-1] for line in maps.read_text().splitlines()
                          if "/dev/shm/" in line)
        except OSError:  # the process ended, or is not ours to read
            continue
    return new - {Path(m) for m in mapped}


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
