"""One setting's value against its field: its type (with PyYAML's readings of numbers and
text undone), finite, in range, among its choices (or a name users bring from elsewhere), a
path's leading `~` expanded; a problem recorded, naming the fix, where it is not."""

from __future__ import annotations

import difflib
import math
import os
import re
import typing
from typing import Any


def checked_value(name: str, value: Any, kind, meta, problems: list):
    """The value converted to `kind` if it is valid, else None (and a problem recorded)."""
    origin = typing.get_origin(kind)
    if origin is dict:
        key_t, val_t = typing.get_args(kind)
        ok = isinstance(value, dict) and all(
            _is_type(k, key_t) and _is_type(v, val_t) for k, v in value.items())
        if not ok:
            problems.append((name, value, f"a mapping of {key_t.__name__} to {val_t.__name__}"))
            return None
        return {k: float(v) if val_t is float else v for k, v in value.items()}
    if kind is float and isinstance(value, str):
        try:  # PyYAML reads `1e-3` (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if kind is str and _is_type(value, int):  # PyYAML reads `0` (eval.tasks=0) as an int
        value = str(value)
    if not _is_type(value, kind):
        quoted = kind in (int, float) and isinstance(value, str) and \
            re.fullmatch(r"\s*[-+]?\d+\s*", value) is not None
        hint = " (quoted: drop the quotes)" if quoted else ""
        if kind is str and isinstance(value, bool):  # YAML 1.1 (PyYAML's) read a word
            hint = _word_hint(value, meta)
        problems.append((name, value, _a(kind.__name__) + hint))
        return None
    if kind is float:
        try:
            value = float(value)
        except OverflowError:  # an int beyond any float
            value = math.inf
        if not math.isfinite(value):  # YAML's .nan/.inf pass every bound check
            problems.append((name, value, "a finite number"))
            return None
    if meta.get("paths") and isinstance(value, str):
        value = home_expanded(value)
    if meta.get("choices") and value not in meta["choices"]:
        known = meta.get("known_as", {}).get(str(value).lower())  # a name from elsewhere
        lowered = {str(c).lower(): str(c) for c in meta["choices"]}  # PPO for ppo too
        close = [known] if known else [lowered[m] for m in difflib.get_close_matches(
            str(value).lower(), list(lowered), n=1)]
        problems.append((name, value, f"one of {', '.join(map(str, meta['choices']))}"
                         + (f" (did you mean `{close[0]}`?)" if close else "")))
        return None
    low, high = meta.get("ge"), meta.get("le")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = " and ".join(s for s in (low is not None and f">= {low}",
                                          high is not None and f"<= {high}") if s)
        problems.append((name, value, f"{_a(kind.__name__)} {bounds}"))
        return None
    return value


def _word_hint(value: bool, meta: dict) -> str:
    """For a text setting YAML read as a boolean (off, on, no, yes unquoted): its choices and
    the one the word names, if any, else 'quote the word'."""
    choices, names = meta.get("choices") or (), meta.get("known_as", {})
    words = ("on", "yes", "true") if value else ("off", "no", "false")
    meant = next((names.get(w, w) for w in words if w in names or w in choices), None)
    return (f", one of {', '.join(map(str, choices))}" if choices else "") + \
        " (YAML reads off, on, no and yes unquoted as false or true: " + \
        (f"did you mean `{meant}`?)" if meant else "quote the word)")


def home_expanded(paths: str) -> str:
    """A path setting's value (comma-separated), a leading `~` the home folder (YAML, quotes
    and `key=~/x` leave it to us: a run went to a folder named `~`)."""
    if "~" not in paths:
        return paths
    return ",".join(os.path.expanduser(part.strip()) for part in paths.split(","))


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _is_type(value: Any, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)
