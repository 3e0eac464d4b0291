"""process/heap.py: glibc's thresholds set for a rank's process, a user's own kept."""

import os
import subprocess
import sys

import pytest

# a backward pass's way with memory: forty live buffers of 128 KiB-2 MiB, all freed, again
PROBE = """
import resource, sys
import numpy as np
from hpcvla.process import heap
print(heap.keep_freed_buffers() if sys.argv[1] == "set" else "-")
rng = np.random.default_rng(0)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    buffers = [np.ones(n) for n in rng.integers(1 << 14, 1 << 18, 40)]
    del buffers
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


def _probe(mode: str, **malloc_env: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"} | malloc_env
    said, faults = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True,
                                  text=True, env=env, check=True).stdout.split()
    return said, int(faults)


def test_freed_buffers_are_reused_not_faulted_in_again():
    """glibc's defaults map and unmap such buffers, or trim them, and fault them in again each
    round (~300,000 faults here); with the thresholds set they come back from the heap."""
    (_, default), (said, kept) = _probe("default"), _probe("set")
    assert said == "True" and kept * 5 < default, (kept, default)


@pytest.mark.parametrize("setting", [{"MALLOC_MMAP_THRESHOLD_": "131072"},
                                     {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}])
def test_a_users_own_malloc_settings_stand(setting):
    """A user who set one of glibc's variables or tunables chose for the process: it is not
    overridden (here a threshold below the buffers: each is mapped and faulted in again)."""
    (_, kept), (said, users) = _probe("set"), _probe("set", **setting)
    assert said == "False" and users > kept * 5, (users, kept)
