"""The runs of one configuration but their seed, as postprocess/report.py reports them: their
groups, the table of each group's final figures (mean and 95 % t interval over its seeds) and
its curves (seeds.png, seeds-held-out.png)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hpcvla.metrics.charts import seed_curves
from hpcvla.metrics.progress import settled
from hpcvla.metrics.stats import mean_interval


# the settings that tell neither what a run learns nor how fast: its name, folder, seed and logs
# (a trajectory dump stays: it costs throughput)
NOT_CONFIGURATION = {"run.name", "run.root", "run.seed", "run.resume", "run.tensorboard",
                     "run.wandb", "run.timeline_s"}


def seed_groups(runs: list[dict]) -> dict[str, list[dict]]:
    """The runs of one configuration but their seed, two or more, each of its own seed (a
    seed run twice would count as two: such runs make no group): every setting equal but
    NOT_CONFIGURATION's, as each run last ran (a resume's config). Label -> runs; the label
    is the runs' run.name, followed by the settings that tell the group from another group
    of that name."""
    by_key: dict[frozenset, list[dict]] = {}
    for run in runs:
        if run["settings"]:
            key = frozenset((k, json.dumps(v, sort_keys=True))
                            for k, v in run["settings"].items() if k not in NOT_CONFIGURATION)
            by_key.setdefault(key, []).append(run)
    groups = {key: sorted(rs, key=lambda r: (r["settings"].get("run.seed", 0), r["name"]))
              for key, rs in by_key.items()
              if len(rs) == len({r["settings"].get("run.seed") for r in rs}) > 1}
    names = {key: "/".join(sorted({str(r["settings"].get("run.name")) for r in rs}))
             for key, rs in groups.items()}
    labelled = {}
    for key, rs in groups.items():
        namesakes = [k for k in groups if names[k] == names[key]]
        differ = sorted(key - frozenset.intersection(*namesakes))
        labelled[names[key] + "".join(f" {k}={json.loads(v)}" for k, v in differ)] = rs
    return labelled


def final_held_out(run: dict) -> tuple[int, float, int] | None:
    """A run's last held-out evaluation (version, success rate, episodes): its training's own
    (eval.every, in metrics.jsonl), else `hpcvla eval`'s newest version (eval.jsonl)."""
    held = [m["held_out"] for m in run["metrics"] if "held_out" in m]
    if held:
        return held[-1]["version"], held[-1]["success_rate"], held[-1]["episodes"]
    if run["evals"]:
        e = max(run["evals"], key=lambda e: e["version"])
        return e["version"], e["success_rate"], e["episodes"]
    return None


def _interval(values, digits: int = 3, rate: bool = True) -> str:
    """mean [low, high] (n=...): the interval cut to what the figure can be, [0, 1] for a
    rate, 0 and up otherwise, where a t interval over a few seeds reaches past it."""
    if not values:
        return "—"
    mean, low, high = mean_interval(values)
    low, high = max(low, 0.0), min(high, 1.0) if rate else high
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}] (n={len(values)})"


def seeds_table(groups: dict[str, list[dict]]) -> str:
    lines = ["| configuration | seeds | env steps/s | training success | held-out success | "
             "held out at |", "|---|---|---|---|---|---|"]
    for label, rs in groups.items():
        held = [h for h in map(final_held_out, rs) if h]
        trained = [r["summary"].get("success_rate") for r in rs]
        lines.append(
            f"| {label} | {', '.join(str(r['settings'].get('run.seed')) for r in rs)} | "
            f"{_interval([r['summary']['env_steps_per_s'] for r in rs], 0, rate=False)} | "
            f"{_interval([v for v in trained if v is not None])} | "
            f"{_interval([rate for _, rate, _ in held if rate is not None])} | "
            f"{', '.join(sorted({f'v{v} ({n} episodes)' for v, _, n in held})) or '—'} |")
    return "\n".join(lines)


def _on_grid(curves: list[list[tuple[float, float]]]) -> tuple[np.ndarray, list[list[float]]]:
    """`curves` (each a list of (x, y)) on one grid of 50 points over all of them, each
    interpolated where it has values and NaN outside them (none extrapolated: a group of a
    shorter run has its band end where its runs do)."""
    grid = np.linspace(min(c[0][0] for c in curves), max(c[-1][0] for c in curves), 50)
    out = []
    for curve in curves:
        xs, ys = (np.asarray(v, float) for v in zip(*curve))
        out.append(np.where((grid >= xs[0]) & (grid <= xs[-1]), np.interp(grid, xs, ys),
                            np.nan).tolist())
    return grid, out


def seeds_section(groups: dict[str, list[dict]], out: Path) -> list[str]:
    """The table of seed_groups and their charts (seeds.png, seeds-held-out.png)."""
    md = ["## Seeds", "", "Runs of one configuration but their seed: each group's figures as "
          "the mean over its seeds and its 95 % Student-t interval (4.30 standard errors at 3 "
          "seeds); training success is the learners' last episodes at the run's end, held-out "
          "success its last evaluation on fixed initial states.", "", seeds_table(groups), ""]
    trained = {label: [[(m["trained_env_steps"], m["success_rate"]) for m in settled(
        [m for m in r["metrics"] if m.get("success_rate") is not None])] for r in rs]
        for label, rs in groups.items()}
    held = {label: [[(m["held_out"]["trained_env_steps"], m["held_out"]["success_rate"])
                     for m in r["metrics"] if "held_out" in m
                     and m["held_out"]["success_rate"] is not None] for r in rs]
            for label, rs in groups.items()}  # (None: an evaluation of no verdict)
    held = {label: cs for label, cs in held.items() if all(len(c) > 1 for c in cs)}
    for name, curves, what in (("seeds", trained, "training success (the learners' last "
                                "episodes)"),
                               ("seeds-held-out", held, "held-out success (eval.every)")):
        curves = {label: cs for label, cs in curves.items() if all(cs)}
        if not curves:
            continue
        grid, ys = _on_grid([c for cs in curves.values() for c in cs])
        drawn, at = {}, 0
        for label, cs in curves.items():
            drawn[label], at = ys[at:at + len(cs)], at + len(cs)
        seed_curves(out / f"{name}.png", grid, drawn, f"Seeds: {what}", "trained env steps",
                    "success", ylim=(0, 1))
        md += [f"![{name}]({name}.png)", ""]
    return md
