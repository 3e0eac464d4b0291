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
            version = version.lstrip("=").split("=")[0]  # conda build string: x==1.0=external_*
            pins[re.sub(r"[-_.]+", "-", name.strip().lower())] = version.strip()
    return pins


def test_environment_yml_mirrors_requirements():
    pip_pins = _pins((ROOT / "requirements.txt").read_text().splitlines())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_lines, pip_lines = [], []
    for dep in env["dependencies"]:
        (pip_lines.extend(dep["pip"]) if isinstance(dep, dict) else conda_lines.append(dep))
    conda_pins = {k: v for k, v in _pins(conda_lines).items() if k not in ("python", "pip")}
    assert {**conda_pins, **_pins(pip_lines)} == pip_pins
    assert all("==" in line for line in (ROOT / "requirements.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#")), "pin every requirement exactly"


def test_installed_versions_match_pins():
    from importlib.metadata import version
    for name, pinned in _pins((ROOT / "requirements.txt").read_text().splitlines()).items():
        assert version(name).split("+")[0] == pinned, name
