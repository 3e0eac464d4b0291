"""The exchange's doorbells (transport/doorbell.py): a ring ends a wait at once, rings pile up
into one wake-up, and a bell nobody rings sleeps its whole time."""

import subprocess
import time

import pytest
from mpi4py import MPI

from hpcvla.transport.backoff import Backoff
from hpcvla.transport.doorbell import Doorbell

from helpers import MPI_DIR, ROOT


def test_a_ring_ends_the_wait_at_once_and_many_rings_are_one_wake_up():
    bell = Doorbell(MPI.COMM_SELF, check=[0])  # its own peer: rank 0 of a one-rank comm
    try:
        assert bell.wait(0.05) >= 0.05  # nobody rang: the whole sleep
        for _ in range(2000):  # far more than a socket's queue holds: the rest are not needed
            bell.ring(0)
        start = time.monotonic()
        assert bell.wait(5.0) < 0.5 and time.monotonic() - start < 0.5
        assert bell.wait(0.05) >= 0.05  # the one wake-up took every ring
    finally:
        bell.close()


def test_a_backoff_sleeps_in_the_bell_and_a_ring_cuts_its_sleep_short():
    bell = Doorbell(MPI.COMM_SELF)
    try:
        backoff = Backoff(first=0.2, cap=0.2, sleep=bell.wait)
        assert backoff.wait(at_most=0.02) < 0.15  # at_most bounds one sleep
        bell.ring(0)
        assert backoff.wait() < 0.15  # rung: far less than its 0.2 s
        assert backoff.wait() >= 0.2
    finally:
        bell.close()


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
