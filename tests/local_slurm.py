"""A real Slurm cluster for tests, from the Debian packages (`make install-cluster`): one node,
or several nodes that are separate hosts (tests/multihost/hosts.py).

    with LocalSlurm() as slurm:                    # one node, `localhost`
        job = slurm.sbatch("jobs/slurm/demo.sbatch", "configs/default.yaml")
        info = slurm.wait(job, timeout=300)        # scontrol's fields: JobState, ExitCode, ...

    with LocalSlurm(nodes=3) as slurm:             # nodes h0, h1, h2 on three emulated hosts
        ...                                        # (or LocalSlurm(hosts=EmulatedHosts(3)))

No systemd: munged, slurmctld and slurmd are started here as plain processes (munged as user
munge, the Slurm daemons as root), each with its own socket, ports, state and spool
directories under one private directory, so several instances (and a site's own Slurm) can
coexist. The node claims more CPUs than the machine has (`SlurmdParameters=config_overrides`)
and the partitions oversubscribe, so multi-rank jobs fit on 2 cores.

Two partitions on the one node: `batch` (default) and `pbs`. Jobs in `pbs` get what a PBS
site gives a job and Slurm does not: a TaskProlog writes `$PBS_NODEFILE` (one line per MPI
rank) next to the PBS_* variables that Slurm's `spank_pbs` plugin sets. PBS job scripts are
submitted with Slurm's `qsub` wrapper (slurm-wlm-torque); sbatch reads their `#PBS` lines.

Several nodes: each node is an emulated host (its own network namespace, address 10.77.0.<i+1>
and host name h<i>; tests/multihost/hosts.py). slurmctld runs on h0 (SlurmctldHost=h0), one
`slurmd -N h<i>` on every host, so job steps run in that host's namespaces under its name and
MPI ranks on different nodes talk TCP. The filesystem is shared, as on a cluster: one munged
(its socket is a file) serves every host. Slurm's commands reach slurmctld only from inside
the hosts: `sbatch`, `qsub`, `scontrol`, ... run on h0 (`scontrol listpids` on the job's batch
host). Jobs find an `ssh` on PATH that runs its command on the named host (the hosts' remote
shell stand-in), as a cluster's passwordless ssh between nodes: MPICH's Hydra under PBS starts
its proxies on the other nodes through it; with `tm_bin` on their PATH they find PBS's
`pbs_tmrsh` too (PBS_TMRSH). With `gpus=N` every node schedules N GPUs (no device behind them).

Everything started is stopped, and the private directory removed, by `stop()` (or leaving the
`with` block), also when start-up fails halfway; with several nodes also the hosts, when
LocalSlurm made them, and every process left on them. Start-up failures raise `SlurmError` with
the daemon logs: a test that needs Slurm fails loudly, it never skips.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcvla.job.leftovers import remove_orphans, segments

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "qsub", "srun")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
PLUGIN_DIR = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm")

# cred_expire: a requeued job waits that long before it may start again; 5 s is the least
# Slurm takes (below it falls back to its default, 120 s).
SLURM_CONF = """\
ClusterName=hpcvla-test
FirstJobId={first_job}
SlurmctldHost={ctld_host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={base}/munge/munge.socket,cred_expire=5
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool{node_dir}
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd{node_suffix}.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd{node_suffix}.log
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
TmpFS={base}/tmp{tmp_dir}
{gres_types}ReturnToService=2
MinJobAge=3600
KillWait=10
SchedulerParameters=sched_interval=2
{node_lines}\
PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
PartitionName=pbs Nodes=ALL MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
NODE_LINE = "NodeName={name} NodeAddr={addr} CPUs={cpus}{gres} State=UNKNOWN\n"

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


# PBS's `pbs_tmrsh` for the PBS layer on this Slurm: it starts a program on a node of the job
# through the job's resource manager (PBS: TM; here: a step of the Slurm job under it), so
# that it is the job's process there, not an ssh session's. As TM's tm_spawn, it executes its
# arguments as they are, with no shell reading them. It drops its options (-l user, -n), and
# Slurm's step variables from what it starts (a PBS task sees PBS's), keeping the GPUs the
# node's step was given, as PBS's cgroup hook gives a task its node's.
PBS_TMRSH = """\
#!/bin/sh
while [ $# -gt 0 ]; do
    case $1 in -l) shift 2 ;; -*) shift ;; *) break ;; esac
done
host=$1
shift
exec env SLURM_CONF={conf} srun --jobid="${{PBS_JOBID%%.*}}" --overlap --nodes=1 --ntasks=1 \\
    --nodelist="$host" --mpi=none sh -c \\
    'for v in $(env | sed -n "s/^\\(SLURM_[A-Za-z0-9_]*\\)=.*/\\1/p"); do unset "$v"; done
     exec "$@"' sh "$@"
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
    def __init__(self, cpus: int = 64, start_timeout: float = 60.0, nodes: int = 1,
                 hosts=None, fabric_ports: int = 0, gpus: int = 0, no_tmpfs: bool = False,
                 shm_mib: dict[str, int] | None = None):
        """One node (`localhost`), or `nodes` > 1 nodes h0.. on emulated hosts that this
        instance makes (with `fabric_ports` more interfaces each) and removes; or the nodes
        of `hosts` (an EmulatedHosts, started here and stopped again if it was not started
        yet). `gpus`: GPUs each node's slurmd schedules (gres/gpu on device files of
        /dev/null's kind: no GPU behind them), which a job asks for with --gpus-per-node and
        its steps' tasks see as CUDA_VISIBLE_DEVICES, as on a GPU cluster. `no_tmpfs`: the
        nodes' TmpFS is missing (a fault: Slurm's PMIx plugin then fails every task's
        launch, and srun exits 0). `shm_mib`: nodes (of several) whose /dev/shm is a tmpfs of
        their own of that many MiB, as a node whose /dev/shm is small or that earlier jobs
        filled (a fault: their slurmd and what it starts see it, in a mount namespace of
        their own)."""
        self.cpus, self.start_timeout, self.fabric_ports = cpus, start_timeout, fabric_ports
        self.no_tmpfs, self.shm_mib = no_tmpfs, shm_mib or {}
        self.gpus = gpus
        self.hosts = hosts
        self.nodes = hosts.n if hosts is not None else nodes
        if self.nodes < 1:
            raise SlurmError(f"{self.nodes} nodes: need at least 1")
        self.multihost = self.nodes > 1 or hosts is not None
        if self.shm_mib and not self.multihost:  # (one node's mount would be the machine's)
            raise SlurmError("shm_mib needs nodes on emulated hosts (nodes > 1)")
        self._own_hosts = False
        self.base: Path | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}

    @property
    def tm_bin(self) -> Path:
        """The folder of this cluster's `pbs_tmrsh` (PBS_TMRSH), for a job's PATH."""
        assert self.base is not None and self.multihost
        return self.base / "tm"

    @property
    def node_names(self) -> list[str]:
        return list(self.hosts.names) if self.multihost else ["localhost"]

    # -- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> "LocalSlurm":
        for attempt in (1, 2, 3):
            try:
                self.start()
                return self
            except SlurmError as err:
                self.stop()
                # a port _free_port found free was taken before the daemon bound it (the
                # suite runs two test files at a time): again, with new ports
                if attempt == 3 or "Address already in use" not in str(err):
                    raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

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
        self.shm_before = segments()
        self.base = Path(tempfile.mkdtemp(prefix="hpcvla-slurm-"))
        self.base.chmod(0o755)  # munged (user munge) must reach its directory inside
        base = self.base
        for sub in ("state", "spool", "nodefiles", "tmp"):
            (base / sub).mkdir()
        (base / "nodefiles").chmod(0o1777)
        if self.multihost:
            self._start_hosts()
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
        if self.multihost:  # per-node spool, pid and log files: %n is the node's name
            names, addrs = self.hosts.names, [self.hosts.addresses[h] for h in self.hosts.names]
            ctld_host, node_dir, node_suffix = f"{names[0]}({addrs[0]})", "/%n", "-%n"
        else:
            names, addrs = ["localhost"], ["127.0.0.1"]
            ctld_host, node_dir, node_suffix = "localhost(127.0.0.1)", "", ""
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        node_lines = "".join(NODE_LINE.format(name=name, addr=addr, cpus=self.cpus, gres=gres)
                             for name, addr in zip(names, addrs))
        if self.gpus:
            (base / "dev").mkdir()
            for i in range(self.gpus):  # what slurmd checks a GPU's file is: a device
                os.mknod(base / "dev" / f"gpu{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            (base / "gres.conf").write_text(
                f"Name=gpu File={base}/dev/gpu[0-{self.gpus - 1}]\n")
        conf.write_text(SLURM_CONF.format(
            base=base, cpus=self.cpus, ctld_port=_free_port(), slurmd_port=_free_port(),
            first_job=first_job, ctld_host=ctld_host, node_dir=node_dir,
            tmp_dir="/missing" if self.no_tmpfs else node_dir,
            node_suffix=node_suffix, node_lines=node_lines,
            gres_types="GresTypes=gpu\n" if self.gpus else ""))
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        if self.multihost:
            for name in names:
                (base / "spool" / name).mkdir()
                # a node's own TmpFS, as each real node's /tmp: Slurm's PMIx plugin makes its
                # per-step directory there (srun --mpi=pmix), one name on every node
                (base / "tmp" / name).mkdir()
            # `ip netns exec` mounts a fresh /sys for the host: no cgroup hierarchy under it,
            # and slurmd (22.05) refuses to start when the autodetected plugin finds none.
            # Nothing here uses cgroups (proctrack/linuxproc, task/none): name a version.
            (base / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
            # the nodes' remote shell, for jobs (Hydra's proxies under PBS)
            (base / "bin").mkdir()
            (base / "bin" / "ssh").symlink_to(self.hosts.standin)
            # and PBS's TM start, for jobs that put `tm_bin` on their PATH
            (base / "tm").mkdir()
            (base / "tm" / "pbs_tmrsh").write_text(PBS_TMRSH.format(conf=conf))
            (base / "tm" / "pbs_tmrsh").chmod(0o755)
            self.env["PATH"] = f"{base / 'bin'}:{self.env.get('PATH', os.defpath)}"
        self.procs["slurmctld"] = self._daemon(["/usr/sbin/slurmctld", "-D", "-c", "-f", conf],
                                               "slurmctld", host=names[0])
        self._until(lambda: self._run(["scontrol", "ping"], check=False).returncode == 0,
                    "slurmctld answers `scontrol ping`")
        for name in names:
            self._start_slurmd(name)
        self._until(self._nodes_ready, f"node(s) {','.join(names)} are idle in `sinfo`")

    def _start_hosts(self) -> None:
        """The emulated hosts the nodes run on (made here unless given started)."""
        if self.hosts is None:
            sys.path.insert(0, str(Path(__file__).parent / "multihost"))
            try:
                from hosts import EmulatedHosts
            finally:
                sys.path.pop(0)
            self.hosts = EmulatedHosts(self.nodes, fabric_ports=self.fabric_ports)
        if self.hosts.base is None:
            self._own_hosts = True
            try:
                self.hosts.start()
            except Exception as err:  # HostsError: no root, no `ip`, a namespace refused
                raise SlurmError(f"cannot make {self.nodes} emulated hosts: {err}") from err

    def clear(self) -> None:
        """Between tests sharing the cluster: every job cancelled, its steps gone, every node
        idle again (what a test that failed left included)."""
        self._run(["scancel", "--full", "--user", "root"], check=False, timeout=10)
        self._wait_no_steps(timeout=20)
        self.wait_idle()

    def stop(self) -> None:
        """Cancel jobs, stop the daemons (TERM, then KILL), remove the private directory."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._run(["scancel", "--full", "--user", "root"], check=False, timeout=10)
            self._wait_no_steps(timeout=20)
        slurmds = sorted(name for name in self.procs if name.startswith("slurmd"))
        for name in (*slurmds, "slurmctld", "munged"):
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
        if self._own_hosts:  # kills what is left on the hosts (ranks, Hydra proxies), too
            self.hosts.stop()
            self._own_hosts = False
        if self.base is not None:
            remove_orphans(self.shm_before)  # what killed ranks of our jobs left
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None

    def fail_node(self, host: str) -> None:
        """A node failure as a job sees it: every process on emulated host `host` is killed
        at once, its slurmd included (`restore_node` brings the node back)."""
        sys.path.insert(0, str(Path(__file__).parent / "multihost"))
        try:
            from hosts import kill_namespace
        finally:
            sys.path.pop(0)
        kill_namespace(self.hosts.ns(host), rounds=5)
        self.procs.pop(f"slurmd-{host}").wait(10)

    def restore_node(self, host: str, wait: bool = True) -> None:
        """Start the slurmd of a node `fail_node` killed; with `wait`, until every node is
        idle (a job that held the node completes only once its slurmd is back)."""
        self._start_slurmd(host)
        self._run(["scontrol", "update", f"nodename={host}", "state=resume"], check=False)
        if wait:
            self.wait_idle()

    def wait_idle(self) -> None:
        """Until every node is idle (no job holds one, none is down)."""
        self._until(self._nodes_ready, "every node is idle in `sinfo`")

    def cancel(self, job_id: str) -> None:
        """scancel, whatever the job's state."""
        self._run(["scancel", job_id], check=False)

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

    def _start_slurmd(self, name: str) -> None:
        """Node `name`'s slurmd (on its host with several nodes; `shm_mib`'s /dev/shm)."""
        daemon = f"slurmd-{name}" if self.multihost else "slurmd"
        argv = ["/usr/sbin/slurmd", "-D", "-N", name, "-f", self.base / "slurm.conf"]
        if name in self.shm_mib:  # (`ip netns exec` gave the host a mount namespace)
            argv = ["sh", "-c", f"mount -t tmpfs -o size={self.shm_mib[name]}m shm /dev/shm "
                    '&& exec "$@"', "sh", *argv]
        self.procs[daemon] = self._daemon(argv, daemon, host=name if self.multihost else None)

    def _daemon(self, argv, name, host=None, **user) -> subprocess.Popen:
        """Start a daemon (on `host`'s namespaces with several nodes); it dies with us."""
        if host is not None and self.multihost:
            argv = self.hosts.on(host, argv)  # ip netns exec + unshare + sh: all exec, no fork
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

    def _nodes_ready(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-p", "batch", "-o", "%N %t"], check=False)
        states = dict(line.split()[:2] for line in out.stdout.splitlines() if line.strip())
        return states == {name: "idle" for name in self.node_names}

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

    def _run(self, argv, check=True, timeout=60, host=None, **kwargs
             ) -> subprocess.CompletedProcess:
        """A Slurm command; with several nodes run on `host` (default h0), where slurmctld
        can be reached."""
        shown = argv
        if self.multihost:
            argv = self.hosts.on(host or self.hosts.names[0], argv)
        out = subprocess.run([str(a) for a in argv], env={**self.env, **kwargs.pop("env", {})},
                             capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and out.returncode != 0:
            raise SlurmError(f"{' '.join(map(str, shown))} failed ({out.returncode}):\n"
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

    def _query(self, argv, attempts=3, host=None) -> subprocess.CompletedProcess:
        """A read-only command, retried: on a loaded machine munged may time a slow client
        out and close its socket, and the client then dies of SIGPIPE (CI saw exit -13)."""
        for attempt in range(1, attempts + 1):
            out = self._run(argv, check=attempt == attempts, host=host)
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
        # listpids asks the slurmstepds of the node it runs on: the batch shell's node
        host = self.job(job_id).get("BatchHost") if self.multihost else None
        out = self._query(["scontrol", "listpids", job_id], host=host).stdout.split("\n")[1:]
        batch = {int(line.split()[0]) for line in out if line.split()[2:3] == ["batch"]}

        def parent(pid):
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        (shell,) = [pid for pid in batch if parent(pid) not in batch]
        os.kill(shell, sig)
