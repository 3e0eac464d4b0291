"""What code and software a run ran with, start by start: `<run dir>/software.jsonl`, a line
each start of the run writes as its world starts (rank 0; a run that dies keeps it). The
config alone does not say how a run was made: the same settings under other code, another
torch or another MPI train otherwise. A resumed start that runs with other software than the
run's last start says what changed, as it says which settings changed (config/loader.py's
write_run_config): after a `git pull`, or a torch upgrade, between the two.

    {"began": ISO time (UTC),
     "hpcvla": {"version", "source": the package's folder,
                "commit": the HEAD of the git checkout that tracks that folder,
                "changed": its uncommitted changes to tracked files (`git status`; at most
                           MAX_CHANGED, then "..."),
                "diff_sha256": of `git diff HEAD`, null where nothing changed,
                "untracked": the package's files git does not track (a new module, not yet
                             added; at most MAX_CHANGED),
                "git_error": why git could not say, where it could not (then the four
                             above are null: not a checkout, a package installed from one,
                             git missing, GIT_TIMEOUT_S passed)},
     "python": "3.11.7", "mpi": the MPI library's own version line ("" without MPI),
     "packages": {name: version} of those of PACKAGES installed}
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from hpcvla.config.families import SIMULATORS
from hpcvla.files import open_log, read_log

SOFTWARE = "software.jsonl"
PACKAGES = ("torch", "numpy", "mpi4py", "deepspeed", "horovod", "transformers", "peft",
            "safetensors", "h5py", "gymnasium",
            *(traits.package[1] for traits in SIMULATORS.values() if traits.package),
            "robosuite", "mujoco", "lerobot", "wandb")
MAX_CHANGED = 50
GIT_TIMEOUT_S = 10.0  # for all of git's calls: rank 0 asks while the world waits for it


def software() -> dict:
    """This process's software (the module docstring's record); its MPI library's where it
    runs one (mpi4py.MPI imported: importing it would start MPI), else "" for it."""
    import hpcvla

    packages = {}
    for name in PACKAGES:
        try:
            packages[package_key(name)] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    source = Path(hpcvla.__file__).resolve().parent
    return {"began": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "hpcvla": {"version": hpcvla.__version__, "source": str(source), **_git(source)},
            "python": platform.python_version(),
            "mpi": mpi.Get_library_version().strip().split("\n")[0]
            if (mpi := sys.modules.get("mpi4py.MPI")) else "",
            "packages": packages}


def _git(folder: Path) -> dict:
    """The git checkout that tracks `folder` (the package runs from it: an editable install,
    or the source tree itself): its commit and uncommitted changes; else why not. Git never
    stops a run: any failure is recorded instead."""
    deadline = time.monotonic() + GIT_TIMEOUT_S

    def git(*args: str) -> bytes:
        # no optional locks: git status would take the index's lock to refresh it, and one
        # killed at the deadline would leave it behind in the user's checkout
        out = subprocess.run(["git", "--no-optional-locks", "-c", "safe.directory=*",
                              "-c", "core.fsmonitor=false", "-C", str(folder), *args],
                             capture_output=True, timeout=max(0.1, deadline - time.monotonic()))
        if out.returncode:
            raise RuntimeError(out.stderr.decode(errors="replace").strip().split("\n")[0])
        return out.stdout

    try:
        git("ls-files", "--error-unmatch", "__init__.py")  # this checkout's own file
        commit = git("rev-parse", "HEAD").decode().strip()
        status = git("status", "--porcelain", "--untracked-files=no").decode(
            errors="replace").splitlines()
        diff = git("diff", "HEAD", "--no-ext-diff", "--no-textconv", "--no-color") \
            if status else b""
        untracked = git("ls-files", "--others", "--exclude-standard").decode(
            errors="replace").splitlines()
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as err:
        return {"commit": None, "changed": None, "diff_sha256": None, "untracked": None,
                "git_error": f"{type(err).__name__}: {err}"}
    return {"commit": commit, "changed": _capped([line[3:] for line in status]),
            "diff_sha256": hashlib.sha256(diff).hexdigest() if diff else None,
            "untracked": _capped(untracked)}


def _capped(names: list[str]) -> list[str]:
    return names[:MAX_CHANGED] + ["..."] * (len(names) > MAX_CHANGED)


def record_start(run_dir: Path) -> list[str]:
    """Append this start's software to the run's record; what differs from the run's last
    start (a resumed one), a `name: old -> new` line each (none for a new run)."""
    path = Path(run_dir) / SOFTWARE
    now = software()
    previous = [line for line in read_log(path) if isinstance(line, dict)] \
        if path.exists() else []
    with open_log(path) as log:
        log.write(json.dumps(now) + "\n")
    if not previous:
        return []
    before, after = _flat(previous[-1]), _flat(now)
    return [f"{name}: {before.get(name)!r} -> {after.get(name)!r}"
            for name in sorted(set(before) | set(after))
            if name != "began" and before.get(name) != after.get(name)]


def package_key(name: str) -> str:
    """A distribution's name as the record keys it: PEP 503's normal form (mani_skill and
    mani-skill are one package, whichever a release of hpcvla asked for)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _flat(record: dict, prefix: str = "") -> dict:
    flat: dict = {}
    for name, value in record.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[prefix + (package_key(name) if prefix == "packages." else name)] = value
    return flat
