"""Every `make` target the docs, job scripts and environment.yml tell people to run exists in
the Makefile."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `make target` in backticks, or a command line starting with make (code blocks, scripts)
NAMED = re.compile(r"`make ([a-z][\w-]*)|^\s*#?\s*make ([a-z][\w-]*)", re.MULTILINE)


def _documents():
    yield from (ROOT / name for name in ("README.md", "environment.yml", "requirements.txt"))
    for folder in ("docs", "jobs", "configs", "postprocess", ".ci", "tests/fixtures"):
        yield from (p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in
                    ("", ".sh", ".md", ".yaml", ".yml", ".py", ".pbs", ".slurm", ".txt"))


def test_every_make_target_the_docs_name_exists():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    named = {}
    for path in _documents():
        for match in NAMED.finditer(path.read_text(errors="replace")):
            named.setdefault(match.group(1) or match.group(2), path.relative_to(ROOT))
    assert {"install", "test"} <= set(named), named  # the README's two set-up commands
    missing = {t: str(p) for t, p in named.items() if t not in targets}
    assert not missing, f"named but not in the Makefile: {missing}"
