"""Run `hpcvla train` as a user would, in its own process, and read what it wrote: the one
way the benchmarks and the scale model's validation start a training world."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def train_run(args: list, root: Path, label: str | None = None, timeout: float = 1800,
              cwd=None, log: Path | None = None) -> tuple[Path, dict]:
    """`python -m hpcvla train *args run.root=<root>` (`args`: a config, `--ranks N`,
    overrides); returns the run directory it made under `root` (which must hold no other)
    and its summary.json. With `log`, its output goes there as it comes (a job cut by its time
    limit keeps it). Raises RuntimeError with the end of its stderr (or log) if it fails."""
    cmd = [sys.executable, "-m", "hpcvla", "train", *map(str, args), f"run.root={root}"]
    if log is None:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        code, errors = out.returncode, out.stderr
    else:
        with open(log, "w") as f:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                  cwd=cwd).returncode
        errors = Path(log).read_text()
    if code != 0:
        raise RuntimeError(f"{label or ' '.join(cmd)} failed:\n{errors[-3000:]}")
    (run_dir,) = Path(root).iterdir()
    return run_dir, json.loads((run_dir / "summary.json").read_text())
