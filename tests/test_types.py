"""Static types: `mypy --strict` passes on the role loops (src/hpcvla/roles/), the transport
(src/hpcvla/transport/) and the modes' schedules (src/hpcvla/schedule.py), with the settings
of pyproject.toml's [tool.mypy]; the hpcvla modules they import are read for their types but
not reported.

Slow from a clean checkout: ~25 s on 2 cores, mostly mypy reading torch's type information;
its cache (.mypy_cache, beside pyproject.toml) brings a rerun down to about 2 s.
"""

import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow  # ~25 s without mypy's cache (module docstring)


def test_mypy_strict_passes():
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, f"mypy failed ({out.returncode}):\n{out.stdout}{out.stderr}"
