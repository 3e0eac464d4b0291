"""YAML + dotted overrides -> a checked `Config`, or one `ConfigError` naming every problem.

    cfg = load_config("configs/default.yaml", ["learner.zero_stage=3", "placement.mode=hybrid"])

Override values are parsed as YAML scalars (`3` is an int, `true` a bool, `{a: 1}` a dict).
Nothing here touches MPI: it runs in the launching process, before any rank starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import time
import typing
from pathlib import Path
from typing import Any

import yaml

from hpcvla.config.checks import cross_field_problems, unread_setting_problems
from hpcvla.config.imitation import job_unread_problems, trains_only
from hpcvla.config.schema import Config
from hpcvla.config.values import checked_value, home_expanded


class ConfigError(ValueError):
    """Bad configuration. The message has one line per problem: field, value (None: a problem
    of the field as a whole, e.g. a file that is missing), what is valid."""

    def __init__(self, problems: list[tuple[str, Any, str]], source: str = "config"):
        self.problems = problems
        lines = [f"  {name}{'' if value is None else f' = {value!r}'}: expected {valid}"
                 for name, value, valid in problems]
        super().__init__(f"invalid {source}:\n" + "\n".join(lines))


def config_source(path: str | Path | None, overrides: list[str] = ()) -> str:
    """What a ConfigError names as the settings' origin: a problem may be the command line's,
    not the file's (or the built-in defaults', which are valid by themselves)."""
    if path is None:
        return "command-line settings over the built-in defaults" if overrides \
            else "built-in defaults"
    return f"{path} with its command-line overrides" if overrides else str(path)


def config_argument(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """A command's optional CONFIG argument and its overrides as load_config takes them: a
    first argument that is an override, not a file (`hpcvla train a.b=1`), is one of the
    overrides over the built-in defaults."""
    if config and "=" in config and not Path(config).is_file():
        return None, [config, *overrides]
    return config, overrides


def whole_number(least: int):
    """An argparse type for a command-line count: a whole number >= `least`; argparse refuses
    anything else, naming the flag (exit 2)."""
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, {least} or more")
        return int(text)
    return parse


def seconds(text: str) -> float:
    """An argparse type for a command-line time: a finite number of seconds above 0 (0 or
    below ended a world as it started, nan never)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds, a number above 0")
    return value


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key a mapping gives twice: PyYAML keeps the last one
    silently (a second `learner:` section would drop the first one's settings)."""


def _unique_mapping(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False) -> dict:
    lines: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: its keys may repeat
            continue
        key = loader.construct_object(key_node, deep=deep)
        if key in lines:
            raise yaml.constructor.ConstructorError(
                None, None, f"`{key}` given twice (lines {lines[key]} and "
                f"{key_node.start_mark.line + 1}); YAML would keep only the last: merge them",
                key_node.start_mark)
        lines[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                record: bool = False, job: str = "") -> Config:
    """Read `path` (None = built-in defaults, or with `run.resume=DIR` the config that run last
    ran with, as every command resolves it), apply `key.sub=value` overrides, check all.
    `record`: `path` is a run's own record of what it ran (last_run_config's), read as it was
    written: the settings its choices did not read (a re-pointed recipe's) are not judged as
    a user's file's are (checks.unread_setting_problems). `job`: the command it is for
    ("train", "sft"): the overrides that command does not read are refused with the rest
    (imitation.job_unread_problems); "" for a config any command may read."""
    data: dict = {}
    if path is None:
        path = resumed_run_config(list(overrides))
        record = path is not None
    source = config_source(path, overrides)
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as err:  # `hpcvla train learner.epochs 4`: a setting's `=` forgotten?
            setting = re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", str(path)) and \
                not str(path).endswith((".yaml", ".yml", ".json")) and \
                str(path).split(".")[0] in {f.name for f in dataclasses.fields(Config)}
            run = Path(path).is_dir() and (Path(path) / "config.yaml").is_file()
            raise ConfigError([("config file", str(path), f"a readable YAML file ({err.strerror})"
                                + (f"; as a setting it needs a value: {path}=VALUE"
                                   if setting else "")
                                + (f"; this is a run directory: to go on with it, "
                                   f"run.resume={path}; the settings it ran with are "
                                   f"{Path(path) / 'config.yaml'}" if run else ""))],
                              str(path)) from None
        except UnicodeDecodeError as err:  # a binary file, or text in another encoding
            raise ConfigError([("config file", str(path), f"UTF-8 text, as YAML is (byte "
                                f"{err.start}: {err.reason})")], str(path)) from None
        try:
            data = yaml.load(text, Loader=_UniqueKeys)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
            raise ConfigError([(f"YAML at {where}", getattr(err, "problem", str(err)),
                                "well-formed YAML")], str(path)) from None
        if data is None:  # an empty file (or comments alone): not silently the defaults
            raise ConfigError([("config file", str(path), "settings (it holds none: give no "
                                "CONFIG, or `{}`, for the built-in defaults)")], str(path))
        if not isinstance(data, dict):
            raise ConfigError([("top level", data, "a mapping of sections")], str(path))
    return _checked(data, overrides, source, file_settings={} if record else _flat(data),
                    job=job)


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of `cfg` with `key.sub=value` overrides applied, checked as `load_config`'s."""
    return _checked(config_to_dict(cfg), overrides, "overrides of a config")


def _checked(data: dict, overrides: list[str], source: str,
             file_settings: dict[str, Any] | None = None, job: str = "") -> Config:
    """The Config of `data` with `overrides` applied; every problem raised at once.
    `file_settings`: the settings a config file set, by dotted name (those its own choices
    do not read are refused: checks.unread_setting_problems); `job`: load_config's."""
    problems: list = []
    for item in overrides:
        _apply_override(data, item, problems)
    cfg = _build(Config, data, "", problems)
    if not problems:
        # train's own settings are not sft's to judge: typed for it, it refuses them itself
        problems.extend(p for p in cross_field_problems(cfg) + unread_setting_problems(
            cfg, overrides, file_settings) if job != "sft" or not trains_only(p[0]))
    problems.extend(job_unread_problems(job, overrides) if job else [])
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _apply_override(data: dict, item: str, problems: list) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        problems.append(("override", item, "the form section.field=value"))
        return
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    *parents, leaf = key.split(".")
    if _setting_at(key.split("."))[0] is str and not isinstance(value, str):
        # YAML 1.1 reads `off`, `yes`, `1.5`: a text setting takes what was typed; `null`
        # (or nothing) unsets it, as "" does
        value = "" if value is None else raw
    node = data
    for depth, part in enumerate(parents):
        # one key of a mapping setting the config leaves at its default (placement.per_node.
        # learner=2): the default's other keys stay
        child = node.setdefault(part, _mapping_default(parents[:depth + 1]))
        if not isinstance(child, dict):
            problems.append((key, item, f"`{part}` to be a section, it is {child!r}"))
            return
        node = child
    node[leaf] = value


def _setting_at(path: list[str]) -> tuple[Any, Any]:
    """(type, dataclass field) of the setting or section at `path`; (None, None) if none."""
    cls: Any = Config
    field = None
    for part in path:
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) \
            else {}
        if part not in fields:
            return None, None
        field, cls = fields[part], typing.get_type_hints(cls)[part]
    return cls, field


def _mapping_default(path: list[str]) -> dict:
    """A copy of the default of the mapping setting at `path` (e.g. placement.per_node), {} for
    a section or anything else."""
    kind, field = _setting_at(path)
    if typing.get_origin(kind) is dict and field.default_factory is not dataclasses.MISSING:
        return dict(field.default_factory())
    return {}


def _nearest(key: str, fields) -> str:
    """A hint for an unknown `key` among a section's `fields`: a close spelling there, else
    the same name in other sections (`learner.lr`: algorithm.lr or sft.lr)."""
    close = difflib.get_close_matches(key, fields, n=1)
    if close:
        return f" (did you mean `{close[0]}`?)"
    elsewhere = [name for name, *_ in describe_settings() if name.rsplit(".", 1)[-1] == key]
    return f" here (it is {' or '.join(f'`{n}`' for n in elsewhere)})" if elsewhere else ""


def _build(cls, data: Any, prefix: str, problems: list):
    """Instantiate dataclass `cls` from `data`, appending problems instead of raising."""
    where = prefix.rstrip(".") or "top level"
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(data, dict):  # `env: reach` for `env: {name: reach}`
        named = f" (did you mean `{where}: {{name: {data}}}`?)" if "name" in fields and \
            isinstance(data, str) else " (it is empty: indent its settings under it)" \
            if data is None else ""
        problems.append((where, data, "a mapping" + named))
        return cls()
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            section, _, rest = str(key).partition(".")
            nest = f" (in a file, nest it: `{section}: {{{rest}: ...}}`)" if rest and \
                section in fields else _nearest(str(key), fields)
            problems.append((prefix + (str(key) or "''"), data[key],
                             f"no such setting{nest}; valid: {', '.join(fields)}"))
    values = {}
    for name, f in fields.items():
        if name not in data:
            continue
        full, value, kind = prefix + name, data[name], hints[name]
        if dataclasses.is_dataclass(kind):
            values[name] = _build(kind, value, full + ".", problems)
            continue
        checked = checked_value(full, value, kind, f.metadata, problems)
        if checked is not None:
            values[name] = checked
    return cls(**values)


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def recorded(cfg):
    """`cfg` as a run records it (dump_config): the settings that name files or folders
    (`paths`) made absolute, so that `hpcvla eval`, `export` and `run.resume` read the run
    from any directory (as a record: load_config's `record`)."""
    changes = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            changes[f.name] = recorded(value)
        elif f.metadata.get("paths") and value:
            changes[f.name] = ",".join(os.path.abspath(part.strip())
                                       for part in value.split(","))
    return dataclasses.replace(cfg, **changes)


def dump_config(cfg, path: str | Path) -> None:
    """Write the fully resolved config, its paths absolute; `load_config` of the file gives
    back `recorded(cfg)`."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(recorded(cfg)), sort_keys=False))


def last_run_config(run_dir: str | Path) -> Path | None:
    """The config file a run directory's run last ran with: its newest config.resume-*.yaml
    (one per resume), else its config.yaml; None if it has neither."""
    run_dir = Path(run_dir)
    configs = sorted(run_dir.glob("config.resume-*.yaml")) or [run_dir / "config.yaml"]
    return configs[-1] if configs[-1].is_file() else None


def run_settings(run_dir: str | Path) -> dict[str, Any]:
    """The settings a run directory's run last ran with (last_run_config), by dotted name;
    {} where it has no config file."""
    path = last_run_config(run_dir)
    return _flat(yaml.safe_load(path.read_text()) or {}) if path else {}


def resumed_run_config(overrides: list[str]) -> str | None:
    """The config a run resumed by `run.resume=DIR` last ran with (its newest
    config.resume-*.yaml, else config.yaml), or None without run.resume; ConfigError where
    DIR holds none."""
    resumes = [o.split("=", 1)[1] for o in overrides if o.startswith("run.resume=")]
    if not resumes or not resumes[-1] or resumes[-1] in ("null", "None"):
        return None
    config = last_run_config(home_expanded(resumes[-1]))
    if config is None:  # not the built-in defaults: their layout's refusal would be the message
        folder = Path(resumes[-1])
        raise ConfigError([("run.resume", resumes[-1], "a run's directory, holding the "
                            "config.yaml it ran with: none is there" + (
                                f" (a checkpoint's folder: the run is {folder.parent.parent})"
                                if folder.parent.name == "checkpoints" else ""))],
                          "run.resume")
    return str(config)


RUN_DIRECTORY = ("run.resume", "run.root", "run.name")  # where a run's directory is


def write_run_config(cfg, run_dir: Path) -> list[str]:
    """Record the config a run runs with in its directory: config.yaml, or for a resume
    config.resume-<time>.yaml (config.yaml stays the first run's). Returns what a resume
    changed against the config the run last ran with, a `name: old -> new` line each: a
    resume may change any setting, and the run says which (the settings that name the run
    directory left out: it is the one resumed)."""
    previous = last_run_config(run_dir) if cfg.run.resume else None
    changed = []
    if previous is not None:
        before = _flat(yaml.safe_load(previous.read_text()) or {})
        after = _flat(config_to_dict(recorded(cfg)))
        changed = [f"{name}: {before.get(name)!r} -> {value!r}" for name, value in after.items()
                   if name not in RUN_DIRECTORY and before.get(name) != value]
    name = f"config.resume-{time.strftime('%Y%m%d-%H%M%S')}.yaml" if cfg.run.resume \
        else "config.yaml"
    dump_config(cfg, run_dir / name)
    return changed


def _flat(sections: dict, prefix: str = "") -> dict[str, Any]:
    """A config's settings by dotted name (a setting whose value is a mapping stays one)."""
    flat: dict[str, Any] = {}
    for name, value in sections.items():
        if isinstance(value, dict) and not prefix:
            flat.update(_flat(value, f"{name}."))
        else:  # a key YAML reads as no text (`?`: None) is named by the checks after this
            flat[f"{prefix}{name}"] = value
    return flat


def settings_doc(cfg: Config | None = None, only: str = "") -> str:
    """`hpcvla config --doc [SECTION|KEY]`: every setting (or `only` those of a section, or
    one setting), its type, default and documentation; given a config, also its value there
    where that is not the default."""
    values = {} if cfg is None else _flat(config_to_dict(cfg))
    rows = [row for row in describe_settings()
            if not only or row[0] == only or row[0].startswith(only.rstrip(".") + ".")]
    if not rows:
        sections = {name.split(".")[0] for name, *_ in describe_settings()}
        raise ConfigError([("--doc", only, "a section or a setting" + _nearest(
            only, sorted(sections) + [n for n, *_ in describe_settings()]))])
    lines = []
    for name, type_name, default, doc in rows:
        here = f", here {values[name]!r}" if name in values and values[name] != default else ""
        lines.append(f"{name}  ({type_name}, default {default!r}{here})\n    {doc}\n")
    return "\n".join(lines) + "\n"


def describe_settings(cls=Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(name, type, default, doc) of every setting, in declaration order."""
    rows = []
    default = cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            rows += describe_settings(kind, prefix + f.name + ".")
            continue
        doc = f.metadata.get("doc", "")
        if f.metadata.get("choices"):
            doc += f" Choices: {', '.join(f.metadata['choices'])}."
        type_name = getattr(kind, "__name__", str(kind))
        rows.append((prefix + f.name, type_name, getattr(default, f.name), doc))
    return rows
