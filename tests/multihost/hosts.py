"""Several real hosts on one machine, for tests of what crosses a network.

    with EmulatedHosts(3) as hosts:                # hosts.names == ["h0", "h1", "h2"]
        hosts.run("h1", ["hostname"])              # -> "h1", inside h1's namespaces
        hosts.mpiexec("mpich", 12, [python, "-m", "mpi4py", "prog.py"])  # 4 ranks per host

Each host is a network namespace with its own `eth0` (a veth pair whose other end sits on a
bridge in one more namespace), an address in a private /24 and a loopback; with
`fabric_ports=K` also `fab0`..`fab<K-1>`, port j of every host on subnet 10.78.j (a multi-rail
fabric's many devices, which lengthen every rank's UCX address); every process
started on a host also gets its own UTS namespace carrying the host's name. MPI then sees
separate nodes (`COMM_TYPE_SHARED` splits by host name, `Get_processor_name` differs) and talks
TCP between them: no shared memory, no loopback shortcut. Names resolve through
`/etc/netns/<ns>/hosts`, which `ip netns exec` mounts over /etc/hosts.

MPI is started the way a cluster starts it, through a remote shell: MPICH's Hydra with
`-launcher ssh -launcher-exec <stand-in>` and Open MPI's mpirun with `plm_rsh_agent`, where the
stand-in (`ssh_standin.sh`) drops ssh's options and runs the command on the named host.

Needs root (CI is root). Every namespace and file made is removed by `stop()` (or leaving the
`with` block), also when start-up fails halfway or the test failed; the processes left in a
namespace are killed first; what a run killed before `stop()` left is removed by the next
start (tags carry the test process's pid). Without root or `ip`, start-up raises `HostsError`
naming why: a test that needs hosts fails loudly, it never skips.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from helpers import OPENMPI5

SUBNET = "10.77.0"  # host i is SUBNET.(i + 1); private, and only inside our namespaces
FABRIC = "10.78"    # fabric port j of host i is FABRIC.j.(i + 1)
_INSTANCES = itertools.count()  # several sets of hosts alive in one process get distinct tags


class HostsError(RuntimeError):
    pass


def _sh(*argv, check=True, timeout=30) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                         timeout=timeout)
    if check and out.returncode:
        raise HostsError(f"`{' '.join(map(str, argv))}` failed ({out.returncode}): "
                         f"{out.stderr.strip()}")
    return out


def kill_namespace(ns: str, rounds: int = 3) -> None:
    """SIGKILL every process in network namespace `ns` (again, for what was forked meanwhile)."""
    for _ in range(rounds):
        pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.2)


def _remove_ns(ns: str) -> None:
    """Kill what runs in namespace `ns`, then remove it and its /etc/netns files."""
    kill_namespace(ns)
    _sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def _remove_stale() -> None:
    """Remove what earlier runs killed before `stop()` left: namespaces and temporary folders
    tagged hv<pid> whose test process is gone (a live run's are never touched)."""
    names = _sh("ip", "netns", "list", check=False).stdout.split()
    folders = list(Path(tempfile.gettempdir()).glob("hpcvla-hv*"))
    for item in names + [f.name.removeprefix("hpcvla-") for f in folders]:
        tag = re.match(r"hv(\d+)(x\d+)?-", item)
        if tag is None or _alive(int(tag.group(1))):
            continue
        if item in names:
            _remove_ns(item)
        else:
            shutil.rmtree(Path(tempfile.gettempdir()) / f"hpcvla-{item}", ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmulatedHosts:
    def __init__(self, n: int, tag: str | None = None, fabric_ports: int = 0):
        if not 1 <= n <= 200:
            raise HostsError(f"{n} hosts: need 1..200")
        if not 0 <= fabric_ports <= 64:
            raise HostsError(f"{fabric_ports} fabric ports: need 0..64")
        self.n, self.fabric_ports = n, fabric_ports
        if tag is None:  # unique per test process and instance (the first keeps hv<pid>)
            instance = next(_INSTANCES)
            tag = f"hv{os.getpid()}" + (f"x{instance}" if instance else "")
        self.tag = tag
        self.names = [f"h{i}" for i in range(n)]
        self.addresses = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(self.names)}
        self.bridge_ns = f"{self.tag}-br"
        self.base: Path | None = None
        self._made: list[str] = []

    # ---------------------------------------------------------------- life cycle
    def __enter__(self) -> "EmulatedHosts":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def start(self) -> None:
        if os.geteuid() != 0:
            raise HostsError("emulated hosts need root (network and UTS namespaces), as in CI")
        for tool in ("ip", "unshare"):
            if shutil.which(tool) is None:
                raise HostsError(f"`{tool}` not found: install iproute2 / util-linux")
        _remove_stale()
        self.base = Path(tempfile.mkdtemp(prefix=f"hpcvla-{self.tag}-"))
        self.base.chmod(0o755)
        self._add_ns(self.bridge_ns)
        _sh("ip", "netns", "exec", self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge")
        _sh("ip", "netns", "exec", self.bridge_ns, "ip", "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{addr} {name}\n" for name, addr in self.addresses.items())
        for i, name in enumerate(self.names):
            ns = self.ns(name)
            self._add_ns(ns)
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            (etc / "hostname").write_text(name + "\n")
            ports = [("eth0", f"{self.addresses[name]}/24", f"v{self.tag[-6:]}{i}")]
            ports += [(f"fab{j}", f"{FABRIC}.{j}.{i + 1}/24", f"f{self.tag[-6:]}{i}x{j}")
                      for j in range(self.fabric_ports)]
            for port, address, peer in ports:  # interface names: at most 15 characters
                _sh("ip", "link", "add", peer, "type", "veth", "peer", "name", port,
                    "netns", ns)
                _sh("ip", "link", "set", peer, "netns", self.bridge_ns)
                _sh("ip", "netns", "exec", self.bridge_ns, "ip", "link", "set", peer,
                    "master", "br0", "up")
                for cmd in (["ip", "addr", "add", address, "dev", port],
                            ["ip", "link", "set", port, "up"]):
                    _sh("ip", "netns", "exec", ns, *cmd)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        self.standin = self.base / "ssh_standin.sh"
        self.standin.write_text(STANDIN.format(tag=self.tag))
        self.standin.chmod(0o755)

    def _add_ns(self, ns: str) -> None:
        _sh("ip", "netns", "del", ns, check=False)  # a leftover of a killed earlier run
        _sh("ip", "netns", "add", ns)
        self._made.append(ns)

    def stop(self) -> None:
        for ns in reversed(self._made):
            _remove_ns(ns)
        self._made.clear()
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None

    # ---------------------------------------------------------------- processes
    def on(self, host: str, argv: list) -> list[str]:
        """argv that runs `argv` on `host` (its network namespace, its own host name)."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', host, *map(str, argv)]

    def run(self, host: str, argv: list, timeout: float = 60, **kwargs):
        return subprocess.run(self.on(host, argv), capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    def hostfile(self, per_host: int, flavour: str) -> Path:
        path = self.base / f"hosts.{flavour}"
        line = "{h}:{n}\n" if flavour == "mpich" else "{h} slots={n}\n"
        path.write_text("".join(line.format(h=h, n=per_host) for h in self.names))
        return path

    def mpi_command(self, mpi: str, n: int, program: list, per_host: int | None = None
                    ) -> tuple[list[str], dict]:
        """argv (to run on h0) and environment that start `program` (an hpcvla subcommand or
        a script) on n ranks, in blocks of `per_host` over the hosts, through the remote-shell
        stand-in, as a cluster's mpiexec would; `mpi` is mpich, openmpi (the system's) or
        openmpi5 (OPENMPI5)."""
        from hpcvla.job.launch import rank_program
        from hpcvla.process.mpi_select import select_mpi

        install = select_mpi("openmpi", str(OPENMPI5)) if mpi == "openmpi5" else select_mpi(mpi)
        per_host = per_host or n // self.n
        hostfile = self.hostfile(per_host, install.flavour)
        if install.flavour == "mpich":
            launcher = [install.mpiexec, "-n", n, "-f", hostfile, "-launcher", "ssh",
                        "-launcher-exec", self.standin]
        else:
            launcher = [install.mpiexec, "-n", n, *install.args, "--hostfile", hostfile,
                        "--map-by", f"ppr:{per_host}:node", "--mca", "plm_rsh_agent",
                        self.standin, "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24",
                        "--mca", "oob_tcp_if_include", f"{SUBNET}.0/24"]
        env = {**os.environ, **install.env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        return [*map(str, launcher), *rank_program(list(map(str, program)))], env

    def mpiexec(self, mpi: str, n: int, program: list, per_host: int | None = None,
                timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run `program` on n ranks across the hosts (see mpi_command), under a timeout."""
        argv, full_env = self.mpi_command(mpi, n, program, per_host)
        return subprocess.run(self.on(self.names[0], argv), capture_output=True, text=True,
                              timeout=timeout, env={**full_env, **(env or {})})


# The remote shell MPI launchers call (`ssh [options] host command...`): options are dropped,
# the command runs on `host` inside that host's namespaces, with the caller's environment.
STANDIN = r"""#!/bin/sh
while [ $# -gt 0 ]; do
    case $1 in
        -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;   # options that take a value
        -*) shift ;;
        *) break ;;
    esac
done
host=$1; shift
exec ip netns exec "{tag}-$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' \
    "$host" "$*"
"""
