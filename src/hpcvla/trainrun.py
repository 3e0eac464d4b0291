"""Run `hpcvla train` as a user would, in its own process, and read what it wrote: the one
way the benchmarks and the scale model's validation start a training world."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def train_run(args: list, root: Path, label: str | None = None, timeout: float = 1800,
              cwd=None) -> tuple[Path, dict]:
    """`python -m hpcvla train *args run.root=<root>` (`args`: a config, `--ranks N`,
    overrides); returns the run directory it made under `root` (which must hold no other)
    and its summary.json. Raises RuntimeError with the end of its stderr if it fails."""
    cmd = [sys.executable, "-m", "hpcvla", "train", *map(str, args), f"run.root={root}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if out.returncode != 0:
        raise RuntimeError(f"{label or ' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    (run_dir,) = Path(root).iterdir()
    return run_dir, json.loads((run_dir / "summary.json").read_text())
