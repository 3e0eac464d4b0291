"""No dead knobs: every setting of the schema is read by the code that runs, and every value a
setting offers (`choices`) is acted on somewhere, not accepted and ignored.

A static walk over src/hpcvla (but the schema definitions) and jobs/. A setting
`section.field` counts as read where code reads that field of that section: `cfg.learner.backend`,
`learner.backend`, `learner_cfg.backend`, `alg.critic_lr` (ALIASES: the names code gives a
section), the dotted name as a string ("learner.backend": job scripts, getattr paths), or for
`policy.*` a policy family's settings (config.families: the PolicyConfig fields its class
is built with, registry.policy_kwargs). A bare
`.size` on anything does not count. A choice counts as acted on when its string appears outside
the schema (a dispatch table, a comparison, a job script, a refusal)."""

import dataclasses
import re
from pathlib import Path

import pytest

from hpcvla.config.families import FAMILIES
from hpcvla.config.schema import Config

ROOT = Path(__file__).resolve().parents[1]
# where settings are defined, not read
SCHEMA_FILES = {"schema.py", "env.py", "learning.py", "policy.py", "evaluation.py"}


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
ALIASES = {"algorithm": ("alg",)}
# the PolicyConfig fields the policy families take (registry.policy_kwargs reads them)
CONFIG_FIELDS = {name for traits in FAMILIES.values() for name in traits.settings}


def _reads(name: str) -> re.Pattern:
    section, _, field = name.rpartition(".")
    owner = section.split(".")[-1]
    owners = "|".join((owner, *ALIASES.get(owner, ())))
    return re.compile(rf"\b(?:{owners})(?:_cfg)?\.{field}\b|[\"']{re.escape(name)}[\"']")


def test_the_walk_sees_the_whole_schema():
    assert len(SETTINGS) > 80 and "learner.backend" in SETTINGS and "run.seed" in SETTINGS


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_setting_is_read(name):
    read = _reads(name)
    assert any(read.search(text) for text in SOURCES.values()) or \
        (name.startswith("policy.") and SETTINGS[name].name in CONFIG_FIELDS), \
        f"{name}: no code reads it (remove it, or make the code honour it)"


# the default is what the code does when nothing dispatches on the field; every other choice
# must be acted on, or refused by name before any rank starts
CHOICES = [(name, choice) for name, f in sorted(SETTINGS.items())
           for choice in (f.metadata.get("choices") or ()) if choice != f.default]


@pytest.mark.parametrize("name,choice", CHOICES)
def test_every_choice_is_acted_on(name, choice):
    literal = re.compile(rf"[\"']{re.escape(str(choice))}[\"']")
    assert any(literal.search(text) for text in SOURCES.values()), \
        f"{name}={choice!r} is accepted but no code acts on it"
