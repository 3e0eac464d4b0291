"""A real single-node Slurm cluster for tests, from the Debian packages (`make install-cluster`).

    with LocalSlurm(tmp_dir) as slurm:
        job = slurm.sbatch("jobs/slurm/demo.sbatch", "configs/default.yaml")
        info = slurm.wait(job, timeout=300)        # scontrol's fields: JobState, ExitCode, ...

No systemd: munged, slurmctld and slurmd are started here as plain processes (munged as user
munge, the Slurm daemons as root), each with its own socket, ports, state and spool
directories under one private directory, so several instances (and a site's own Slurm) can
coexist. The node claims more CPUs than the machine has (`SlurmdParameters=config_overrides`)
and the partitions oversubscribe, so multi-rank jobs fit on 2 cores.

Two partitions on the one node: `batch` (default) and `pbs`. Jobs in `pbs` get what a PBS
site gives a job and Slurm does not: a TaskProlog writes `$PBS_NODEFILE` (one line per MPI
rank) next to the PBS_* variables that Slurm's `spank_pbs` plugin sets. PBS job scripts are
submitted with Slurm's `qsub` wrapper (slurm-wlm-torque); sbatch reads their `#PBS` lines.

Everything started is stopped, and the private directory removed, by `stop()` (or leaving the
`with` block), also when start-up fails halfway. Start-up failures raise `SlurmError` with the
daemon logs: a test that needs Slurm fails loudly, it never skips.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from hpcvla.launch import _remove_orphaned_shm, _shm_files

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "qsub", "srun")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
PLUGIN_DIR = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm")

SLURM_CONF = """\
ClusterName=hpcvla-test
FirstJobId={first_job}
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={base}/munge/munge.socket,cred_expire=10
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd.log
PlugStackConfig={base}/plugstack.conf
TaskProlog={base}/task_prolog.sh
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=10
SchedulerParameters=sched_interval=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=batch Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
PartitionName=pbs Nodes=localhost MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""

# What a PBS MOM provides and Slurm does not: the node file, one line per rank (PBS Pro:
# per mpiprocs), for jobs in the `pbs` partition, written once per job by slurm-wlm-torque's
# generate_pbs_nodefile. Runs before every task, the batch script included; its `export`
# lines land in the task's environment.
TASK_PROLOG = """\
#!/bin/sh
[ "$SLURM_JOB_PARTITION" = pbs ] || exit 0
export SLURM_CONF={base}/slurm.conf TMPDIR={base}/nodefiles
nodefile="$TMPDIR/$SLURM_JOB_ID"
[ -s "$nodefile" ] || mv -f "$(generate_pbs_nodefile)" "$nodefile"
echo "export PBS_NODEFILE=$nodefile"
"""


class SlurmError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """In a daemon's child process: get SIGTERM when the test process dies, even by SIGKILL
    (a killed test run must not leave a cluster behind)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalSlurm:
    def __init__(self, cpus: int = 64, start_timeout: float = 60.0):
        self.cpus, self.start_timeout = cpus, start_timeout
        self.base: Path | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}

    # -- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> "LocalSlurm":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        missing = [tool for tool in DAEMONS if shutil.which(tool) is None and
                   not Path("/usr/sbin", tool).exists()]
        if missing:
            raise SlurmError(f"Slurm/munge not installed (missing {', '.join(missing)}): run "
                             "`make install-cluster` (as root) to install the Debian packages")
        if os.geteuid() != 0:
            raise SlurmError("starting munged/slurmctld/slurmd needs root (as in CI)")
        self.shm_before = _shm_files()
        self.base = Path(tempfile.mkdtemp(prefix="hpcvla-slurm-"))
        self.base.chmod(0o755)  # munged (user munge) must reach its directory inside
        base = self.base
        for sub in ("state", "spool", "nodefiles"):
            (base / sub).mkdir()
        (base / "nodefiles").chmod(0o1777)
        self._start_munge()
        (base / "plugstack.conf").write_text(
            f"required {PLUGIN_DIR / 'spank_pbs.so'}\n")
        prolog = base / "task_prolog.sh"
        prolog.write_text(TASK_PROLOG.format(base=base))
        prolog.chmod(0o755)
        conf = base / "slurm.conf"
        # Job ids unlike any earlier instance's: MPICH names its shared-memory segments after
        # job and step id, and a segment a killed rank left would be joined by a new job 1.
        first_job = random.randrange(10 ** 5, 6 * 10 ** 7)  # MaxJobId is 67043328
        conf.write_text(SLURM_CONF.format(base=base, cpus=self.cpus, ctld_port=_free_port(),
                                          slurmd_port=_free_port(), first_job=first_job))
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        self.procs["slurmctld"] = self._daemon(["/usr/sbin/slurmctld", "-D", "-c", "-f", conf],
                                               "slurmctld")
        self._until(lambda: self._run(["scontrol", "ping"], check=False).returncode == 0,
                    "slurmctld answers `scontrol ping`")
        self.procs["slurmd"] = self._daemon(["/usr/sbin/slurmd", "-D", "-N", "localhost",
                                             "-f", conf], "slurmd")
        self._until(self._node_ready, "node localhost is idle in `sinfo`")

    def stop(self) -> None:
        """Cancel jobs, stop the daemons (TERM, then KILL), remove the private directory."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._run(["scancel", "--full", "--user", "root"], check=False, timeout=10)
            self._wait_no_steps(timeout=20)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._kill_leftover_steps()
        if self.base is not None:
            _remove_orphaned_shm(self.shm_before)  # what killed ranks of our jobs left
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None

    def _start_munge(self) -> None:
        munge = self.base / "munge"
        munge.mkdir()
        munge.chmod(0o755)  # munged wants its socket directory reachable by all
        shutil.chown(munge, "munge", "munge")
        as_munge = {"user": "munge", "group": "munge", "extra_groups": []}
        subprocess.run(["mungekey", "--create", "--keyfile", munge / "munge.key"], check=True,
                       capture_output=True, **as_munge)
        self.procs["munged"] = self._daemon(
            ["munged", "--foreground", "--socket", munge / "munge.socket",
             "--key-file", munge / "munge.key", "--pid-file", munge / "munged.pid",
             "--seed-file", munge / "munged.seed", "--log-file", munge / "munged.log"],
            "munged", **as_munge)
        self._until(lambda: (munge / "munge.socket").exists(), "munged creates its socket")

    def _daemon(self, argv, name, **user) -> subprocess.Popen:
        with open(self.base / f"{name}.stdout", "wb") as log:
            return subprocess.Popen([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env or None, start_new_session=True,
                                    preexec_fn=_die_with_parent, **user)

    def _until(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited with {proc.returncode} while waiting until "
                                     f"{what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise SlurmError(f"timed out after {self.start_timeout:g} s waiting until {what}\n"
                         f"{self.logs()}")

    def _node_ready(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
        return out[:2] == ["localhost", "idle"]

    def logs(self, tail: int = 40) -> str:
        """The last lines of every daemon log (for failure messages)."""
        if self.base is None:
            return ""
        parts = []
        for path in sorted([*self.base.glob("*.log"), *self.base.glob("*.stdout"),
                            *self.base.glob("munge/*.log")]):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def _wait_no_steps(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self._run(["squeue", "-h", "-o", "%i"], check=False)
            if out.returncode != 0 or not out.stdout.strip():
                return
            time.sleep(0.5)

    def _kill_leftover_steps(self) -> None:
        """slurmstepd processes of this instance that outlived slurmd (they are not in our
        session): found by the spool directory on their command line or environment."""
        if self.base is None:
            return
        mark = str(self.base).encode()
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if mark in (proc / "environ").read_bytes() or \
                        mark in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue

    # -- jobs ----------------------------------------------------------------------------------

    def _run(self, argv, check=True, timeout=60, **kwargs) -> subprocess.CompletedProcess:
        out = subprocess.run([str(a) for a in argv], env={**self.env, **kwargs.pop("env", {})},
                             capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and out.returncode != 0:
            raise SlurmError(f"{' '.join(map(str, argv))} failed ({out.returncode}):\n"
                             f"{out.stdout}{out.stderr}\n{self.logs()}")
        return out

    def sbatch(self, script, *args, options=(), env=None, cwd=None) -> str:
        """Submit with sbatch; returns the job id."""
        out = self._run(["sbatch", "--parsable", *options, script, *args], env=env or {},
                        cwd=cwd)
        return out.stdout.strip().split(";")[0]

    def qsub(self, script, options=(), env=None, cwd=None) -> str:
        """Submit through the PBS `qsub` wrapper into the `pbs` partition; returns the id."""
        out = self._run(["qsub", "-q", "pbs", *options, script], env=env or {}, cwd=cwd)
        job = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
        if not job.isdigit():
            raise SlurmError(f"qsub gave no job id:\n{out.stdout}{out.stderr}")
        return job

    def _query(self, argv, attempts=3) -> subprocess.CompletedProcess:
        """A read-only command, retried: on a loaded machine munged may time a slow client
        out and close its socket, and the client then dies of SIGPIPE (CI saw exit -13)."""
        for attempt in range(1, attempts + 1):
            out = self._run(argv, check=attempt == attempts)
            if out.returncode == 0:
                return out
            time.sleep(1.0)

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict of its Key=Value fields."""
        out = self._query(["scontrol", "show", "job", "--oneliner", job_id])
        fields = {}
        for item in out.stdout.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait(self, job_id: str, timeout: float, states=TERMINAL) -> dict:
        """Poll until the job reaches one of `states`; its fields. TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after "
                                   f"{timeout:g} s\n{self.logs()}")
            time.sleep(1.0)

    def signal_batch_shell(self, job_id: str, sig: int) -> None:
        """Signal the batch shell alone, as `#SBATCH --signal=B:<sig>@<time>` does before the
        time limit (`scancel --batch` would also signal its children, srun included)."""
        out = self._query(["scontrol", "listpids", job_id]).stdout.split("\n")[1:]
        batch = {int(line.split()[0]) for line in out if line.split()[2:3] == ["batch"]}

        def parent(pid):
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        (shell,) = [pid for pid in batch if parent(pid) not in batch]
        os.kill(shell, sig)
