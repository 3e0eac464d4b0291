"""No dead knobs: every setting of the schema is read by the code that runs, and every value a
setting offers (`choices`) is acted on somewhere, not accepted and ignored.

A static walk: a field counts as read when some module outside the schema definitions
accesses it as an attribute (`cfg.learner.backend`, `alg.critic_lr`) or as a string key (the
job scripts and `getattr`/`policy_kwargs` paths); a choice counts as acted on when its string
appears outside the schema (a dispatch table, a comparison, a job script, a refusal)."""

import dataclasses
import re
from pathlib import Path

import pytest

from hpcvla.config.schema import Config

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_FILES = {"schema.py", "learning.py"}  # where settings are defined, not read


def _sources() -> dict[Path, str]:
    files = [p for p in (ROOT / "src" / "hpcvla").rglob("*.py")
             if not (p.parent.name == "config" and p.name in SCHEMA_FILES)]
    files += [p for p in (ROOT / "jobs").rglob("*") if p.is_file()]
    return {p: p.read_text() for p in files}


def _settings(cls=Config, prefix=""):
    for f in dataclasses.fields(cls):
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            yield from _settings(sub, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


SETTINGS = dict(_settings())
SOURCES = _sources()


def test_the_walk_sees_the_whole_schema():
    assert len(SETTINGS) > 80 and "learner.backend" in SETTINGS and "run.seed" in SETTINGS


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_setting_is_read(name):
    field = SETTINGS[name].name
    read = re.compile(rf"\.{field}\b|[\"']{field}[\"']")
    assert any(read.search(text) for text in SOURCES.values()), \
        f"{name}: no code reads it (remove it, or make the code honour it)"


# the default is what the code does when nothing dispatches on the field; every other choice
# must be acted on (or refused, config/checks.py REFUSED)
CHOICES = [(name, choice) for name, f in sorted(SETTINGS.items())
           for choice in (f.metadata.get("choices") or ()) if choice != f.default]


@pytest.mark.parametrize("name,choice", CHOICES)
def test_every_choice_is_acted_on(name, choice):
    literal = re.compile(rf"[\"']{re.escape(str(choice))}[\"']")
    assert any(literal.search(text) for text in SOURCES.values()), \
        f"{name}={choice!r} is accepted but no code acts on it"
