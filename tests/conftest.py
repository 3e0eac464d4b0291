"""The suite's tiers and its CPU pinning.

Tiers (registered in pyproject.toml, `--strict-markers`; a test may carry several):
  unit      in-process. Given by this file to every test that carries none of the kinds below.
  mpi       starts an MPI world or runs the `hpcvla` CLI in a subprocess
  learning  trains until a policy measurably learns (minutes)
  bench     a benchmark's smoke run (`hpcvla bench ... --quick`)
  cluster   needs root, a local Slurm, Open MPI or network namespaces (tests/test_slurm.py,
            tests/multihost/): `make install` provides them where it runs as root
  gpu       needs a CUDA GPU: every test under tests/gpu/ (skipped, saying so, without one)
and, across them,
  slow      takes more than ~10 s on 2 cores (a training run, many ranks, a big model)
  alone     holds most of the machine's memory, or times a latency that needs the cores
            (a thread's wake-up): `make test` runs it after the others, with nothing beside
            it (the others run two test files at a time)
Test files mark themselves (`pytestmark` or a decorator); `make test` runs every tier,
`make test-fast` the unit and mpi tests that are not slow (the Makefile's FAST).

CPU pinning: a test outside tests/gpu/ must behave the same on a machine with GPUs. Each such
test runs with CUDA_VISIBLE_DEVICES="" (inherited by every rank, job and process it starts:
devices.visible_gpus then finds none and every rank binds the CPU) and with torch.cuda
reporting no device in this process. The pinning is per test, not for the session, so that
tests/gpu/ still sees the GPUs when the whole suite runs in one process: CUDA reads
CUDA_VISIBLE_DEVICES once, when this process first asks it for devices, and when GPU tests are
collected that happens below, with the real value, before any test runs. What the GPU tests see
is the machine's setting.
"""

import ctypes
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # `from helpers import ...` from every folder of the suite

KINDS = ("mpi", "learning", "bench", "cluster", "gpu")  # a test with none of them is `unit`

# What a test that is left `unit` must not do: start the CLI (and so maybe a world) itself.
STARTS_THE_CLI = re.compile(r"\b(hpcvla|run_train)\(|\"-m\", \"hpcvla\"|LocalSlurm|EmulatedHosts")


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") and os.geteuid() == 0:
        _private_dev_shm()


def _private_dev_shm():
    """A /dev/shm of this pytest-xdist worker's own (`make test` runs two beside each other),
    as each node has one: the MPICH segments of the worlds its tests start land there, and a
    test's check that its world left none behind (helpers.hpcvla) sees no neighbour's world
    between its ranks' end and its launcher's cleanup. A mount namespace of this thread's
    own (what `unshare --mount` gives a command, here for the worker itself), which every
    process it starts inherits: ranks, Slurm's daemons, `ip netns exec`."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x20000) != 0:  # CLONE_NEWNS
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_NEWNS): {os.strerror(errno)}")
    for mount in (["--make-rprivate", "/"],  # nothing mounted here reaches the host
                  ["-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm"]):
        subprocess.run(["mount", *mount], check=True)


def pytest_collection_modifyitems(config, items):
    gpu_tests = False
    for item in items:
        if TESTS / "gpu" in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("gpu"):
            gpu_tests = True
        if not any(item.get_closest_marker(kind) for kind in KINDS):
            function = getattr(item, "function", None)
            if function and STARTS_THE_CLI.search(inspect.getsource(function)):
                raise pytest.UsageError(
                    f"{item.nodeid} runs the hpcvla CLI but is not marked: give it "
                    "@pytest.mark.mpi (and slow, bench, learning or cluster where they apply)")
            item.add_marker(pytest.mark.unit)
    if gpu_tests:
        _skip_gpu_tests_without_cuda(items)


def _skip_gpu_tests_without_cuda(items):
    # Asking here, before any test pins the CPU, fixes this process's view of the GPUs.
    import torch

    if torch.cuda.is_available():
        return
    reason = "needs a CUDA GPU: this machine has none (torch.cuda.is_available() is False)"
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def cpu_only(request, monkeypatch):
    """Every test but the gpu ones sees no GPU, in this process and in what it starts."""
    if request.node.get_closest_marker("gpu"):
        yield
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("HPCVLA_GPU", raising=False)
    torch = sys.modules.get("torch")
    if torch is not None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    yield
