"""The exchange's doorbells (transport/doorbell.py): a ring ends a wait at once, rings pile up
into one wake-up, and a bell nobody rings sleeps its whole time."""

import errno
import json
import subprocess
import time
import uuid

import pytest

from hpcvla.transport.backoff import Backoff
from hpcvla.transport.doorbell import Doorbell

from helpers import MPI_DIR, ROOT


def _bells(count: int) -> list[Doorbell]:
    """`count` bells of one node's ranks, in this process (`Doorbell.on` without MPI)."""
    token = uuid.uuid4().hex
    return [Doorbell(token, rank) for rank in range(count)]


def test_a_ring_ends_the_wait_at_once_and_many_rings_are_one_wake_up():
    server, client = _bells(2)
    server.reach([1])
    try:
        assert client.wait(0.05) >= 0.05  # nobody rang: the whole sleep
        for _ in range(2000):  # far more than a socket holds: the rest are not needed
            server.ring(1)
        start = time.monotonic()
        assert client.wait(5.0) < 0.5 and time.monotonic() - start < 0.5
        assert client.wait(0.05) >= 0.05  # the one wake-up took every ring
    finally:
        server.close(), client.close()


def test_a_ring_the_kernel_refuses_is_said_once_and_does_not_end_the_rank(capsys):
    """A ring is a hint: ENOBUFS (or a security module's denial) on its send leaves the peer
    to wake at its next poll; the ringing rank says so once and goes on."""
    class Refusing:
        def send(self, data):
            raise OSError(errno.ENOBUFS, "No buffer space available")

        def close(self):
            pass

    server, client = _bells(2)
    server.reach([1])
    server._bells[1].close()
    server._bells[1] = Refusing()
    try:
        server.ring(1)
        server.ring(1)
        said = capsys.readouterr().err
        assert said.count("could not ring rank 1") == 1 and "No buffer space" in said
    finally:
        server.close(), client.close()


def test_rings_busy_peers_leave_unread_do_not_keep_an_idle_one_asleep():
    """The server rings 63 simulators that are stepping (they read no rings) again and again,
    then an idle one once: that one wakes at once. Each peer is rung through a socket of its
    own: a datagram is charged to its sender's socket until read, and through one socket for
    all, the unread rings would fill it (here from ~20 busy peers) and drop the idle one's."""
    server, *clients = bells = _bells(65)
    server.reach(range(1, 65))
    try:
        for _ in range(100):
            for busy in range(1, 64):
                server.ring(busy)
        server.ring(64)
        assert clients[-1].wait(2.0) < 0.5
    finally:
        for bell in bells:
            bell.close()


def test_a_backoff_sleeps_in_the_bell_and_a_ring_cuts_its_sleep_short():
    server, client = _bells(2)
    server.reach([1])
    try:
        backoff = Backoff(first=0.2, cap=0.2, sleep=client.wait)
        assert backoff.wait(at_most=0.02) < 0.15  # at_most bounds one sleep
        server.ring(1)
        assert backoff.wait() < 0.15  # rung: far less than its 0.2 s
        assert backoff.wait() >= 0.2
        assert client.wait(0.0034) >= 0.0034  # 3 ms in poll (it counts whole ms), then asleep
    finally:
        server.close(), client.close()


@pytest.mark.mpi
def test_an_exchange_across_network_namespaces_is_refused_by_name():
    """A node's ranks in two network namespaces (a container per rank): the bells of one
    cannot ring the other's, so its exchange is refused when built, saying why."""
    script = ["python", "-m", "mpi4py", str(MPI_DIR / "exchange_namespaces.py")]
    out = subprocess.run(["timeout", "-k", "5", "60", "mpiexec", "-n", "1", *script, ":",
                          "-n", "1", "unshare", "-n", *script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "the two are in different network namespaces" in out.stdout + out.stderr
    assert "the exchange was built" not in out.stdout


@pytest.mark.mpi
@pytest.mark.alone  # a wake-up's lateness: another worker's world on the cores would add its own
def test_a_simulator_notices_its_answer_when_it_is_given_not_at_its_next_poll():
    """The exchange rings: a simulator asleep in its bell (10 ms a sleep at most) notices an
    answer given 25 ms after its request within a few ms of it, and spends less CPU waiting
    than one polling at DATA_POLL_CAP."""
    out = subprocess.run(["timeout", "-k", "5", "60", "mpiexec", "-n", "2", "python", "-m",
                          "mpi4py", str(MPI_DIR / "exchange_wakes.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("wakes: ")]
    wakes = json.loads(line.removeprefix("wakes: "))
    (bells_cpu, bells_late), (polled_cpu, _) = wakes["bells"], wakes["polled"]
    assert bells_late < 2.5e-3 and bells_cpu < polled_cpu, wakes
