"""Which MPI runs the ranks, and what it needs set: MPICH and Open MPI, one mpi4py build.

    install = select_mpi("openmpi")        # or "mpich", or "auto"
    install.mpiexec, install.args, install.env

    python -m hpcvla.process.mpi_select openmpi   # the same as shell `export` lines
                                                  # (jobs/launch.sh)

The mpi4py wheel loads its MPI library at import time, so one environment runs under either
MPI without a rebuild: MPICH (the PyPI wheel `make install` puts beside Python, or a site's)
is mpi4py's default; Open MPI is selected with `MPI4PY_LIBMPI=<its libmpi.so.40>`.

What each MPI needs, and why:
* Open MPI 4.x's one-sided components. Its default on hosts without UCX devices is
  `osc/pt2pt`, which refuses windows under `MPI_THREAD_MULTIPLE` across hosts (`MPI_ERR_WIN:
  invalid window`; the ring and weight plane need that thread level); `osc/ucx` alone cannot
  make a shared-memory window (`MPI_ERR_INTERN` in `Win.Allocate_shared`). `sm,ucx` works on
  one host and across hosts, over TCP as over InfiniBand/RoCE (UCX picks the fabric; restrict
  it with `UCX_NET_DEVICES=mlx5_0:1` or `UCX_TLS`); without UCX, `sm,rdma`. Open MPI 5 has no
  pt2pt, and its own choice works (ucx where its UCX reaches a fabric, else rdma, sm for the
  node-shared windows), where forcing `ucx` fails across hosts whose UCX has no RMA transport
  (PyPI's wheel over TCP: `MPI_ERR_WIN` in `Win.Allocate`): nothing is set for it. (Such a
  build prints "OSC UCX component priority set inside component query failed" as each window
  is made, harmless: open-mpi/ompi#12517; `OMPI_MCA_osc=^ucx` silences it.) A value the user
  exported is kept.
* Open MPI as root (containers, CI) needs `OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)`, and
  `--oversubscribe` to start more ranks than cores on a workstation.
* In a Slurm job MPICH starts its ranks with its own `mpiexec` (Hydra; it starts one proxy
  per node with srun), not with srun: under srun MPICH wires up through Slurm's PMI-2 server
  (`--mpi=pmi2`; with pmix it silently starts N singletons), and MPI_Init then fails once a
  rank's UCX address is longer than one PMI value ("mpi/pmi2: value not properly terminated",
  "UCX ERROR failed to unpack address"; pmodels/mpich#6924). How long the address is depends
  on the node's network devices: on the test cluster 8 interfaces per host pass and 10 fail,
  and an 8-GPU node's InfiniBand adapters lie past that. `HPCVLA_LAUNCHER=srun` still
  chooses srun. Open MPI under srun wires up through PMIx (`srun --mpi=pmix`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hpcvla.config.schema import MPI_FLAVOURS



class LaunchError(RuntimeError):
    """A world that cannot be started here (no ranks, nothing to run, no usable MPI): bad
    input, said before any rank starts (cli.main: exit 2)."""


class MpiSelectError(LaunchError):
    pass


@dataclass
class MpiInstall:
    flavour: str                                 # mpich | openmpi
    mpiexec: str                                 # its launcher
    env: dict = field(default_factory=dict)      # what the ranks' environment needs
    args: list = field(default_factory=list)     # launcher flags for a workstation
    # what keeps a workstation world (`--ranks N`, `hpcvla launch`, the doctor's world of 2) on
    # this machine inside a scheduler's job of several nodes: both launchers take the job's
    # nodes and start ranks there (by srun, a step an `srun --pty` shell leaves no CPUs for:
    # it waits for ever)
    here_env: dict = field(default_factory=dict)
    srun_mpi: str = "pmi2"                       # srun --mpi plugin for this MPI
    slurm_launcher: str = "mpiexec"              # what starts the ranks in a Slurm job
    # an Open MPI 4.x with no one-sided component that works across hosts (openmpi_osc's "",
    # OMPI_MCA_osc unset): the trajectory ring's windows would fail (hpcvla doctor says so)
    lacks_windows: bool = False
    # what asks its ranks to stop with a checkpoint (process/preempt.py): Open MPI's mpirun
    # SIGKILLs every rank ~1 s after a SIGTERM (4.x and 5: mpirun(1), "Signal Propagation")
    # but passes SIGUSR1 on untouched; MPICH's mpiexec passes SIGTERM on
    stop_signal: str = "TERM"


def launcher_rank() -> int | None:
    """This process's rank as an MPI launcher (mpiexec of either MPI, or srun) set it, without
    starting MPI; None when no launcher started this process."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    if "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"])
    return None


def launcher_size() -> int | None:
    """The size of the world an MPI launcher (or srun) started this process in, without
    starting MPI; None when no launcher started it."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if var in os.environ:
            return int(os.environ[var])
    if "SLURM_STEP_ID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:
        return int(os.environ["SLURM_STEP_NUM_TASKS"])
    return None


def check_not_nested(ranks: int | None) -> None:
    """`--ranks N` starts a world of this process's own: inside a launcher's world of several
    ranks each of them would start one, the same job once per rank. Raises a LaunchError; a
    world of one (an interactive `srun --pty` shell) may start one."""
    size = launcher_size()
    if ranks is not None and size is not None and size > 1:
        raise LaunchError(f"--ranks {ranks}: this process is a rank of a world of {size} that "
                          "srun/mpirun started, each of whose ranks would start a world of its "
                          "own; leave --ranks out (the launcher's ranks are the job's), or run "
                          "without the launcher")


def thread_level_problem() -> str | None:
    """Why this process's MPI cannot run a rank (it initialises MPI), or None. The weight
    plane and the ring's progress agent call MPI from threads of their own beside the main
    thread's calls, which MPI allows only at MPI_THREAD_MULTIPLE; mpi4py asks for it and takes
    whatever the library gives (a library built without it, MPI4PY_RC_THREAD_LEVEL set)."""
    from mpi4py import MPI
    given = MPI.Query_thread()
    if given == MPI.THREAD_MULTIPLE:
        return None
    names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
             MPI.THREAD_SERIALIZED: "SERIALIZED"}
    library = " ".join(MPI.Get_library_version().splitlines()[0].split())[:60]
    return (f"the MPI library ({library}) runs at MPI_THREAD_{names.get(given, given)}, not "
            "MPI_THREAD_MULTIPLE, which the weight plane's and the ring's threads need")


def unlink_mpich_shared_memory() -> None:
    """Unlink the MPICH shared-memory files this process maps (/dev/shm/mpich_*): a world
    that ends in MPI_Abort leaves them (MPI_Finalize removes them), and a node's /dev/shm
    fills over failed runs until a later job's window dies of SIGBUS. For a rank aborting
    its world: its peers keep their mappings until they end."""
    try:
        with open("/proc/self/maps") as maps:
            names = {line.split(maxsplit=5)[-1].strip() for line in maps
                     if " /dev/shm/mpich_" in line and not line.rstrip().endswith("(deleted)")}
    except OSError:  # not Linux
        return
    for name in names:
        try:
            os.unlink(name)
        except OSError:  # a peer on this node was first
            pass


THREAD_LEVEL_FIX = ("unset MPI4PY_RC_THREAD_LEVEL, or use an MPI built with thread support "
                    "(MPICH: --enable-threads=multiple)")


def flavour_of(mpiexec: str) -> str:
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


def _candidates(flavour: str) -> list[str]:
    """The launchers that may be `flavour`'s: those beside this Python, then each folder's
    on PATH in its order, not only the first of each name (the venv's MPICH `mpirun` would
    hide a loaded module's Open MPI `mpirun` behind it)."""
    names = {"mpich": ["mpiexec", "mpiexec.hydra", "mpiexec.mpich"],
             "openmpi": ["mpirun", "mpiexec", "mpirun.openmpi"]}[flavour]
    folders = [Path(sys.executable).parent,
               *(Path(d) for d in os.environ.get("PATH", "").split(os.pathsep) if d)]
    return list(dict.fromkeys(str(f / n) for f in folders for n in names
                              if (f / n).is_file() and os.access(f / n, os.X_OK)))


def select_mpi(choice: str = "auto", mpiexec: str = "auto") -> MpiInstall:
    """The MPI to start ranks with: `choice` mpich/openmpi, or `auto` (the launcher beside
    this Python, else PATH's). `mpiexec` names the launcher explicitly."""
    if choice not in MPI_FLAVOURS:
        raise MpiSelectError(f"--mpi {choice!r}: one of {', '.join(MPI_FLAVOURS)}")
    if mpiexec != "auto":
        exe = shutil.which(mpiexec)
        if not exe:
            raise MpiSelectError(f"launch.mpiexec = {mpiexec!r} is not an executable; give a "
                                 "path to mpiexec/mpirun or `auto`")
        launchers = [exe]
    elif choice == "auto":
        launchers = _candidates("mpich")[:1] or _candidates("openmpi")[:1]
    else:
        launchers = _candidates(choice)
    for exe in launchers:
        flavour = flavour_of(exe)
        if choice in ("auto", flavour):
            return _install(flavour, exe)
    if choice == "auto" and not launchers:
        raise MpiSelectError("no mpiexec found: run `make install` (it installs MPICH from "
                             "PyPI) or load your site's MPI module")
    hint = {"mpich": "`make install` puts MPICH's mpiexec beside the venv's Python",
            "openmpi": "install Open MPI (Debian: `apt-get install openmpi-bin`) or load "
                       "the site's module"}.get(choice, "")
    raise MpiSelectError(f"no {choice} launcher found (looked at {launchers or 'PATH'}); "
                         f"{hint}")


def _install(flavour: str, exe: str) -> MpiInstall:
    if flavour != "openmpi":
        return MpiInstall(flavour, exe, here_env={"HYDRA_RMK": "user", "HYDRA_LAUNCHER": "fork"})
    osc = os.environ.get("OMPI_MCA_osc") or openmpi_osc(exe)
    env = {"MPI4PY_LIBMPI": openmpi_library(exe), **({"OMPI_MCA_osc": osc} if osc else {})}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # none of the schedulers' components: 4.x's ORTE reads OMPI_MCA_, 5's PRRTE PRTE_MCA_
    schedulers = "^slurm,tm,pbs,lsf,gridengine"
    here = {f"{layer}_MCA_{framework}": schedulers for layer in ("OMPI", "PRTE")
            for framework in ("ras", "plm")}
    return MpiInstall(flavour, exe, env, ["--oversubscribe"], here, srun_mpi="pmix",
                      slurm_launcher="srun", lacks_windows=osc == "", stop_signal="USR1")


def _ompi_info(exe: str, *args) -> str:
    info = Path(exe).parent / "ompi_info"
    info = str(info) if info.exists() else shutil.which("ompi_info") or "ompi_info"
    try:
        return subprocess.run([info, *args], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def openmpi_library(exe: str) -> str:
    """Open MPI's libmpi.so.40 for the launcher `exe` (what MPI4PY_LIBMPI must name)."""
    dirs = []
    for line in _ompi_info(exe, "--parsable", "--path", "libdir").splitlines():
        if line.startswith("path:libdir:"):
            libdir = Path(line.split(":", 2)[2])
            dirs += [libdir, libdir.parent, libdir.parent.parent]
    prefix = Path(exe).resolve().parent.parent
    dirs += [prefix / "lib", prefix / "lib64", Path("/usr/lib/x86_64-linux-gnu")]
    for d in dirs:
        if (d / "libmpi.so.40").exists():
            return str(d / "libmpi.so.40")
    raise MpiSelectError(f"cannot find Open MPI's libmpi.so.40 for {exe} (looked in "
                         f"{', '.join(map(str, dirs))}): set MPI4PY_LIBMPI to it")


def openmpi_osc(exe: str) -> str | None:
    """The one-sided components to set (module docstring): None for Open MPI 5 and later,
    whose own choice works (it has no pt2pt); for 4.x sm + ucx, else sm + rdma, else ""
    (neither: no usable windows across hosts)."""
    info = _ompi_info(exe, "--parsable")
    version = next((line.split(":")[3] for line in info.splitlines()
                    if line.startswith("ompi:version:full:")), "")
    if version.split(".")[0].isdigit() and int(version.split(".")[0]) >= 5:
        return None
    have = {line.split(":")[2] for line in info.splitlines()
            if line.startswith("mca:osc:") and line.count(":") >= 3}
    for pair in (("sm", "ucx"), ("sm", "rdma")):
        if set(pair) <= have:
            return ",".join(pair)
    return ""


def main(argv: list[str]) -> int:
    """`export` lines for jobs/launch.sh: the selected MPI's environment and launcher."""
    try:
        install = select_mpi(argv[0] if argv else "auto")
    except MpiSelectError as err:
        print(f"launch.sh: error: {err}", file=sys.stderr)  # launch.sh keeps stdout alone
        return 2
    lines = {**{k: v for k, v in install.env.items() if v},
             "HPCVLA_MPI_FLAVOUR": install.flavour, "HPCVLA_MPIEXEC": install.mpiexec,
             "HPCVLA_SRUN_MPI_DEFAULT": install.srun_mpi,
             "HPCVLA_SLURM_LAUNCHER_DEFAULT": install.slurm_launcher,
             "HPCVLA_MPI_STOP_SIGNAL": install.stop_signal}
    for key, value in lines.items():
        print(f"export {key}={shlex.quote(value)}")  # a path may hold a quote (O'Brien)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
