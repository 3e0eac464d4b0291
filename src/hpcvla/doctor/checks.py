"""A check's result (Check) and a fresh Python to run one in, where a crash cannot take the
doctor down."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass


@dataclass
class Check:
    name: str
    ok: bool
    found: str       # what the check saw
    fix: str = ""    # what to do, when it failed

    def line(self) -> str:
        head = f"{'ok' if self.ok else 'FAIL':<5}{self.name:<12}{self.found}"
        return head if self.ok else f"{head}\n{'':17}fix: {self.fix}"


def run_python(code: str, env: dict, timeout: float = 120,
               launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python (under `launcher`), where a crash cannot take us down,
    with the environment `env`."""
    try:
        return subprocess.run([*launcher, sys.executable, "-c", code], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess([], 124, "", f"no answer within {timeout:.0f} s")


def last_line(out: subprocess.CompletedProcess) -> str:
    lines = (out.stderr or out.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {out.returncode}"
