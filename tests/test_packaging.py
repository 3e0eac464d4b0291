"""The pins live in requirements.txt; environment.yml must name the same packages and versions."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pins(lines):
    pins = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("=")
            version = version.lstrip("=").split("=")[0].split()[0] if version else ""
            pins[re.sub(r"[-_.]+", "-", name.strip().lower())] = version.strip()
    return pins


def test_environment_yml_mirrors_requirements():
    pip_pins = _pins((ROOT / "requirements.txt").read_text().splitlines())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_lines, pip_lines = [], []
    for dep in env["dependencies"]:
        (pip_lines.extend(dep["pip"]) if isinstance(dep, dict) else conda_lines.append(dep))
    conda_pins = {k: v for k, v in _pins(conda_lines).items() if k not in ("python", "pip")}
    # MPI is the one conda-side package: any release of the pinned series (same ABI) will do,
    # since conda-forge may lag PyPI by a patch release.
    mpich_series = conda_pins.pop("mpich")
    assert pip_pins["mpich"].startswith(mpich_series + "."), (mpich_series, pip_pins["mpich"])
    assert {**conda_pins, **_pins(pip_lines), "mpich": pip_pins["mpich"]} == pip_pins
    assert all("==" in line for line in (ROOT / "requirements.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#")), "pin every requirement exactly"


def test_installed_versions_match_pins():
    from importlib.metadata import version
    for name, pinned in _pins((ROOT / "requirements.txt").read_text().splitlines()).items():
        assert version(name).split("+")[0] == pinned, name


def test_the_command_leaves_its_objects_frozen_for_the_exit():
    """`hpcvla` and `python -m hpcvla` end in __main__.run, which freezes the collector's
    objects before the exit: the interpreter then spares every rank its final search of the
    objects torch made (~1 s of CPU per process, each rank of a world at once)."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "hpcvla"]
    assert script.value == "hpcvla.__main__:run"
    probe = ("import atexit, gc, sys\n"
             "atexit.register(lambda: print('frozen objects at exit:', gc.get_freeze_count()))\n"
             "sys.argv = ['hpcvla', 'config']\n"
             "from hpcvla.__main__ import run\n"
             "run()\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert int(out.rsplit("frozen objects at exit:", 1)[1]) > 1000
