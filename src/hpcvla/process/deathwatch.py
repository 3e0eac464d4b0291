"""Which rank died first, when one dies without a word (kill -9, the OOM killer, a segfault).

A rank that raises says who it is before it aborts the world (job/runtime.py). One killed outright
says nothing, and mpiexec then only reports an exit code and some pid. So every rank registers
itself (rank, roles, node, host, pid) in a directory the launcher passes down
(`HPCVLA_RANK_DIR`) and holds a connection to the launcher (its lifeline); the launcher notes the
first rank to go and, when the world ends badly, names it with the run's last progress (the
newest line of metrics.jsonl).

The lifeline closes when the dying rank's files close, the moment mpiexec's proxy also learns of
the death (its pipes and PMI socket close then) and before it kills the other ranks. A pidfd
(also watched, for a rank whose lifeline a forked child still holds) signals only when the
process has wholly exited: on a loaded machine, after the ranks the proxy killed in the meantime.
A rank killed outright counts as gone once it begins to exit (process_gone), before either.

A rank that ends its work marks its card done. A job script's launcher (jobs/launch.sh) thus
also learns that a world has failed while its launcher still runs, and which of its host's
ranks died first: the same watch, on the job's rank directory (first_failure), a rank gone
without that mark. After a node failure that is how the world ends in seconds: mpiexec and
srun wait for the dead node's processes until the scheduler declares the node down (Slurm's
SlurmdTimeout: minutes), though the ranks left aborted long before.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from hpcvla.files import replace_text
from hpcvla.process.last_progress import last_progress
from hpcvla.process.mpi_select import unlink_mpich_shared_memory
from hpcvla.process.stdio import until_forwarded

ENV = "HPCVLA_RANK_DIR"
# The subcommands whose ranks are an MPI world's and register here (jobs/launch.sh's
# in_a_world says the same)
WORLD_COMMANDS = ("train", "sft", "eval")
LIFELINE = "lifeline.sock"  # in the directory; only `hpcvla`'s own launcher listens on one
RUN_DIR_FILE = "run_dir"  # in the directory: the path of rank 0's run (register_run_dir)
PF_EXITING = 0x4  # a task's flag in /proc/PID/stat (linux/sched.h): it has begun to exit
# a failing rank's time for its launcher's folder (a stalled file system): then it aborts
LAST_WORDS_S = 5.0

_lifeline: socket.socket | None = None  # this rank's end, open for the life of the process


class Refused(Exception):
    """Raised alike by every rank of a world on one collective verdict (its GPUs would be
    overfilled, say): the world ends with one message and exit 2, not an abort
    (job/runtime.py), and no rank counts as dead."""


def register(rank: int, roles: str, node: int, host: str) -> None:
    """Rank side: leave this rank's card for the launcher and hold its lifeline (nothing
    without a launcher)."""
    if folder := os.environ.get(ENV):
        card = {"rank": rank, "roles": roles, "node": node, "host": host, "pid": os.getpid()}
        replace_text(Path(folder) / f"rank{rank}.json", json.dumps(card))
        _hold_lifeline(Path(folder) / LIFELINE, rank)


def _hold_lifeline(path: Path, rank: int) -> None:
    global _lifeline
    if not path.exists():  # a job script's launcher: it watches pids
        return
    line = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    line.settimeout(10)  # a launcher that stopped accepting must not hold the rank up
    try:
        line.connect(str(path))
        line.sendall(f"{rank}\n".encode())
    except OSError:  # another host's launcher, or one gone or stuck: pids only
        line.close()
        return
    # A forked child (an env worker) drops its copy, so the line closes when this rank dies.
    os.register_at_fork(after_in_child=line.close)
    _lifeline = line


def abort_world(world, rank: int, why: str, code: int, detail: str = "") -> None:
    """Rank side, on a failure the world cannot outlive: print `why` (then `detail`, e.g. a
    traceback), leave it with the launcher (said_why, within LAST_WORDS_S) and abort `world`
    (every rank goes down with exit status `code`). Ranks of this host already gone without a
    word are named as the first to die: a rank killed outright fails its peers' MPI calls to
    it, and only now, before MPI_Abort, is its death known to have come first."""
    print(f"{why}\n{detail}" if detail else why, file=sys.stderr, flush=True)
    left = threading.Event()

    def look_and_leave(said: str = why) -> None:
        try:
            before = _gone_before(rank)
        except (OSError, ValueError):  # the directory going, a card half read: abort regardless
            before = []
        if before:
            said += f"\nhpcvla: {_who(before)} died first, without a word, before this failure"
            print(said.rpartition("\n")[2], file=sys.stderr, flush=True)
        try:  # the failure may be the file system's (full, gone): the abort must happen anyway
            said_why(rank, said)
        except OSError as err:
            print(f"hpcvla: rank {rank} could not leave its failure with the launcher ({err}); "
                  "the words above are all there is", file=sys.stderr, flush=True)
        left.set()
    try:
        threading.Thread(target=look_and_leave, name="hpcvla-last-words", daemon=True).start()
    except RuntimeError:  # no thread to be had (the rank may be failing of that): unbounded
        look_and_leave()
    if not left.wait(LAST_WORDS_S):
        print(f"hpcvla: rank {rank} could not reach its launcher's folder {os.environ.get(ENV)} "
              f"in {LAST_WORDS_S:g} s (a stalled file system?)", file=sys.stderr, flush=True)
    until_forwarded(sys.stderr)  # read by mpiexec's proxy before the abort stops it
    unlink_mpich_shared_memory()
    world.Abort(code)


def _gone_before(rank: int) -> list[dict]:
    """The cards of the ranks of this rank's host (by its own card) whose process is gone
    (process_gone), neither finished nor having said why; none without a launcher's
    directory."""
    if not (folder := os.environ.get(ENV)):
        return []
    folder_path = Path(folder)
    cards = {c["rank"]: c for c in _cards(folder_path)}
    host = _short(cards.get(rank, {}).get("host", socket.gethostname()))
    said = {int(p.name.removeprefix("failed.rank")) for p in _failures(folder_path)}
    return [card for other, card in sorted(cards.items())
            if other != rank and other not in said and _short(card["host"]) == host
            and not _done_mark(folder_path, other).exists() and process_gone(card["pid"])]


def _cards(folder: Path) -> list[dict]:
    """The cards the world's ranks left in `folder` (register), by rank."""
    return sorted((json.loads(p.read_text()) for p in folder.glob("rank*.json")),
                  key=lambda card: card["rank"])


def _short(host: str) -> str:
    """A host's name without its domain: a rank's card and the launcher's host name may
    carry it or not."""
    return host.split(".")[0]


def _failures(folder: Path) -> list[Path]:
    """The failure messages of the ranks that said why (said_why), the first said first."""
    return sorted(folder.glob("failed.rank*"), key=lambda path: path.stat().st_mtime_ns)


def process_gone(pid: int) -> bool:
    """Reaped, a zombie, or exiting. A process killed outright first tears down its memory
    (0.4 s for 6 GB on a 2-core VM), flagged PF_EXITING, and only then closes its files (its
    lifeline, its MPI sockets) and becomes a zombie (its pidfd readable): its peers may see it
    gone from the first of its sockets to close, before the last. Its stat is read once: a
    process being reaped may vanish between two looks at its /proc entry."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # reaped
        return True
    state, *fields = stat.rpartition(")")[2].split()  # after the name, which may hold ")"
    return state in ("Z", "X") or bool(int(fields[5]) & PF_EXITING)


def said_why(rank: int, why: str) -> None:
    """Rank side, before it aborts the world: it failed and explained itself (`why`: what it
    printed, its traceback aside), so the others' deaths that follow are not news. The
    launcher repeats `why` at the end: on MPI_Abort mpiexec may stop forwarding the rank's
    output before its words are through."""
    if folder := os.environ.get(ENV):
        replace_text(Path(folder) / f"failed.rank{rank}", why)


def finished(rank: int) -> None:
    """Rank side, after its work: this rank's exit is no failure."""
    if folder := os.environ.get(ENV):
        _done_mark(Path(folder), rank).touch()


def _done_mark(folder: Path, rank: int) -> Path:
    return folder / f"done.rank{rank}"


def first_failure(folder: Path, launcher: int, poll_s: float = 0.2) -> str | None:
    """Launcher side (a job script's): wait while the process `launcher` runs until a rank
    says it failed or a rank of this host is gone without finishing; say which. None if the
    launcher ended first. This host's ranks are watched as `hpcvla`'s own launcher watches
    them (DeathWatch on `folder`: their lifelines, which close before the MPI launcher ends
    the others, and pids); another host's pid means nothing here."""
    watch = DeathWatch(folder, host=socket.gethostname())
    try:
        while _alive(launcher):
            watch.wait(poll_s)
            failed = [p.name.removeprefix("failed.rank") for p in _failures(folder)]
            if failed:
                # and the deaths until now: a rank may have said why after one that this
                # watch, not running meanwhile (a loaded machine), has not seen
                watch.wait(0)
                silent = [c for c in (watch.first[0] if watch.first else [])
                          if str(c["rank"]) not in failed]
                # one check found both: which came first cannot be told, and a rank gone
                # without a word fails its peers' MPI calls to it: both named
                return f"rank {failed[0]} failed" + (
                    f", and {_who(silent)} gone, by the same check" if silent else "")
            if watch.first and watch.first[0]:
                return watch.first_to_die()
        return None
    finally:
        watch.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or the pid reused by another user
        return False
    return True


def register_run_dir(run_dir: Path) -> None:
    """Rank 0 side: where the run's metrics are, for the last progress."""
    if folder := os.environ.get(ENV):
        (Path(folder) / RUN_DIR_FILE).write_text(str(run_dir))


class DeathWatch:
    """Launcher side: `env()` for the world, `wait(seconds)` instead of sleeping while it
    runs, `report()` after it ended badly. In a directory of its own, or in `folder` (a job
    script's, which it leaves), watching the ranks of `host` only (None: every rank's)."""

    def __init__(self, folder: Path | None = None, host: str | None = None):
        self.owned = folder is None
        self.dir = Path(tempfile.mkdtemp(prefix="hpcvla-ranks-")) if folder is None else folder
        self.host = None if host is None else _short(host)
        self.poller = select.poll()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(str(self.dir / LIFELINE))
        except OSError:  # a TMPDIR too long for a socket's path (108 bytes): pidfds alone
            pass
        else:
            self.listener.listen(socket.SOMAXCONN)
            self.poller.register(self.listener, select.POLLIN)
        self.cards: dict[int, dict] = {}  # rank -> card
        self.pidfds: dict[int, int] = {}  # pidfd -> rank
        self.lines: dict[int, tuple[socket.socket, int | None]] = {}  # fd -> lifeline, rank
        self.gone: set[int] = set()
        # the cards of the ranks seen dead in the first check that found any, and its time:
        # ranks that die within one check cannot be told apart
        self.first: tuple[list[dict], float] | None = None

    def env(self) -> dict:
        return {ENV: str(self.dir)}

    def wait(self, seconds: float) -> None:
        dead = self._discover()
        for fd, _ in self.poller.poll(seconds * 1000):
            if fd == self.listener.fileno():
                line, _ = self.listener.accept()
                self.lines[line.fileno()] = (line, None)
                self.poller.register(line, select.POLLIN)
            elif fd in self.pidfds:
                dead.append(self.pidfds.pop(fd))
                self.poller.unregister(fd)
                os.close(fd)
            else:
                dead += self._read_lifeline(fd)
        # exiting, its lifeline and pidfd not yet closed (process_gone)
        dead += [rank for rank in self.pidfds.values()
                 if process_gone(self.cards[rank]["pid"])]
        dead = [rank for rank in dict.fromkeys(dead) if rank not in self.gone
                and not _done_mark(self.dir, rank).exists()]  # done: no death
        self.gone.update(dead)
        if dead and self.first is None:
            self._discover()  # a lifeline may name a rank whose card came after the last look
            self.first = ([self.cards[rank] for rank in sorted(dead) if rank in self.cards],
                          time.monotonic())

    def _read_lifeline(self, fd: int) -> list[int]:
        """The rank whose lifeline closed, if it did; its rank number if it arrives."""
        line, rank = self.lines[fd]
        data = line.recv(64)
        if data:
            self.lines[fd] = (line, int(data))
            return []
        self.poller.unregister(fd)
        line.close()
        del self.lines[fd]
        return [] if rank is None else [rank]

    def _discover(self) -> list[int]:
        """Watch the ranks registered since the last check; the ranks already gone."""
        gone = []
        for path in self.dir.glob("rank*.json"):
            if int(path.stem.removeprefix("rank")) in self.cards:
                continue
            card = json.loads(path.read_text())
            self.cards[card["rank"]] = card
            if self.host is not None and _short(card["host"]) != self.host:
                continue  # its pid is another host's
            try:
                fd = os.pidfd_open(card["pid"])
            except ProcessLookupError:  # gone before we looked
                gone.append(card["rank"])
                continue
            except OSError:  # no pidfds here (old kernel): the lifeline alone
                continue
            self.pidfds[fd] = card["rank"]
            self.poller.register(fd, select.POLLIN)
        return gone

    def report(self, ended: float) -> str | None:
        """What a rank that failed said (said_why), or else who died first, how long before
        the world ended (`ended`, monotonic), and the run's last progress; None if no rank
        was seen to die."""
        self.wait(0)
        if said := _failures(self.dir):  # the failing rank said why itself
            why = said[0].read_text().strip()
            return (f"hpcvla: the world ended on this failure:\n{why}\nhpcvla: "
                    + last_progress(self.dir / RUN_DIR_FILE)) if why else None
        if not (self.first and self.first[0]):
            return None  # nobody died
        text = (f"hpcvla: {self.first_to_die()}, {max(ended - self.first[1], 0):.1f} s before "
                "the world ended")
        return text + "; " + last_progress(self.dir / RUN_DIR_FILE)

    def first_to_die(self) -> str:
        """Who died first (`first`: the ranks one check found dead), as a sentence."""
        cards = self.first[0] if self.first else []
        return f"{_who(cards)} died first" + (" (gone by the same check)" if len(cards) > 1
                                              else "")

    def close(self) -> None:
        for fd in self.pidfds:
            os.close(fd)
        for line, _ in self.lines.values():
            line.close()
        self.listener.close()
        self.pidfds.clear()
        self.lines.clear()
        if self.owned:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:  # the job script's directory: the next world's ranks must not find a lifeline
            (self.dir / LIFELINE).unlink(missing_ok=True)


def _who(cards: list[dict]) -> str:
    return " or ".join(f"rank {c['rank']} ({c['roles']}) on node {c['node']} (host "
                       f"{c['host']}, pid {c['pid']})" for c in cards)


def describe(folder: Path) -> str:
    """What a job script prints after its launcher ended the world badly: every registered
    rank, what the first rank that failed said (said_why: the launcher may have cut its own
    output), and the run's last progress."""
    cards = _cards(folder)
    lines = [f"hpcvla: the world ended badly; its ranks ({len(cards)} registered):"]
    lines += [f"  rank {c['rank']}: {c['roles']} on node {c['node']} (host {c['host']}, pid "
              f"{c['pid']})" for c in cards]
    if (said := _failures(folder)) and (why := said[0].read_text().strip()):
        rank = said[0].name.removeprefix("failed.rank")
        lines.append(f"  rank {rank} said: " + why.replace("\n", "\n    "))
    return "\n".join(lines + ["  " + last_progress(folder / RUN_DIR_FILE)])


def unfinished(folder: Path, host: str) -> str | None:
    """Launcher side, after a launcher that exited 0: why the world did not run to its end,
    or None. Each of this host's ranks must have left its card and its done mark (another
    host's files on a network file system may show late): a launcher can report success for
    tasks it never started (srun, when Slurm's MPI plugin fails every task's launch)."""
    mine = [c["rank"] for c in _cards(folder) if _short(c["host"]) == _short(host)]
    if not mine:
        return f"no rank of the world registered on this host ({host}): none ran here"
    left = [r for r in mine if not _done_mark(folder, r).exists()]
    if left:
        return (f"rank(s) {', '.join(map(str, left))} on this host ({host}) ended without "
                "finishing their work")
    return None


def never_started(folder: Path) -> bool:
    """Launcher side, after a failed world: whether it ended while starting, before any rank
    registered (MPI_Init, the ranks' first collectives) and before rank 0 made a run
    directory. Starting such a world again loses nothing and trains nothing twice."""
    return not _cards(folder) and not (folder / RUN_DIR_FILE).exists()


def _main(argv: list[str]) -> int:
    """python -m hpcvla.process.deathwatch describe RANK_DIR
    python -m hpcvla.process.deathwatch first-failure RANK_DIR LAUNCHER_PID   (jobs/launch.sh)
    python -m hpcvla.process.deathwatch unfinished RANK_DIR
    python -m hpcvla.process.deathwatch never-started RANK_DIR
    first-failure prints the failure and exits 0, or exits 1 when the launcher ended first;
    unfinished prints why and exits 1 where this host's ranks did not all finish;
    never-started exits 0 where the world ended before any rank registered, else 1."""
    if argv[:1] == ["describe"] and len(argv) == 2:
        print(describe(Path(argv[1])), file=sys.stderr, flush=True)
        return 0
    if argv[:1] == ["unfinished"] and len(argv) == 2:
        why = unfinished(Path(argv[1]), socket.gethostname())
        if why is not None:
            print(why, flush=True)
        return int(why is not None)
    if argv[:1] == ["never-started"] and len(argv) == 2:
        return int(not never_started(Path(argv[1])))
    if argv[:1] == ["first-failure"] and len(argv) == 3:
        failure = first_failure(Path(argv[1]), int(argv[2]))
        if failure is None:
            return 1
        print(failure, flush=True)
        return 0
    print(_main.__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
