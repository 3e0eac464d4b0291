"""Tables and charts from hpcvla run directories and `hpcvla bench modes --json` files.

    python postprocess/report.py runs/default-* [--bench bench.json ...] [--out report]

Writes into --out (default `report/`):
    report.md            throughput table across modes and rank ratios (RL-VLA³ Tables 1, 3
                         and 4: throughput, wall time, per-stage busy seconds), benchmark
                         tables, busy fractions, staleness, trajectory dumps, and the charts:
    throughput.png       env steps/s per run
    <bench>.png          env steps/s per case of each --bench file, its ideal bound a line
    timeline-<run>.png   swimlanes: one lane per rank, a coloured bar per busy span of each
                         stage, white = idle; `-zoom` shows two seconds mid-run (a resumed
                         run's last start, as its summary.json and table row)
    success.png          success rate against trained env steps, one curve per run (the
                         training's last 200 episodes), and one per run that has an
                         eval.jsonl (`hpcvla eval RUN --all`: fixed initial states)
    seeds.png            runs of one configuration but their seed (every setting equal but
                         name, folder, seed and logs: seed_report.py), two or more of a seed each:
                         each seed's training success thin, their mean thick with its 95 % t
                         interval; `seeds-held-out.png` the same of
                         their held-out evaluations (eval.every), and the table of each
                         group's final figures, mean and interval over its seeds
    staleness.png        fraction of trained segments per policy-version lag, per run

A run directory is what `hpcvla train` writes (summary.json, metrics.jsonl, config.yaml,
plan.json, timeline.rank<R>.jsonl, optional trajectories/). Charts are drawn by
hpcvla.metrics.charts (matplotlib, Agg backend): stages keep one colour in every report,
benchmark bars carry their ideal bound as a black line, and bar charts whose values span two
decades or more get a log axis.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from hpcvla.config.loader import run_settings
from hpcvla.files import read_log
from hpcvla.metrics.charts import bar_chart, line_chart, swimlane
from hpcvla.metrics.progress import settled, standing_records
from seed_report import seed_groups, seeds_section  # postprocess/, beside this script


class ReportError(ValueError):
    pass


def load_run(path) -> dict:
    """Everything a report uses from one run directory."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path}: no such directory")
    if not (path / "summary.json").exists():
        runs = sorted(p.name for p in path.iterdir() if (p / "summary.json").is_file())
        raise ReportError(f"{path}: a folder of runs ({', '.join(runs[:3])}"
                          f"{', ...' if len(runs) > 3 else ''}): give them, {path}/*" if runs
                          else f"{path}: no summary.json (not a run directory, or the run "
                          "did not finish)")
    summary = json.loads((path / "summary.json").read_text())
    if "demonstrations" in summary:  # an imitation run: losses, no rollouts to report
        raise ReportError(f"{path}: an `hpcvla sft` run (its losses are in its summary.json, "
                          "metrics.jsonl and TensorBoard's sft/*; `hpcvla eval` measures its "
                          "success)")
    plan = json.loads((path / "plan.json").read_text()) if (path / "plan.json").exists() \
        else {}
    roles = Counter(role for r in plan.get("ranks", []) for role in r["roles"])
    starts = summary.get("starts") or [{}]  # a run's before starts were listed: one
    spans: dict = {}
    for s in last_start_spans([read_log(f) for f in sorted(path.glob("timeline.rank*.jsonl"))],
                              len(starts)):
        spans.setdefault((s["rank"], s["role"]), []).append((s["start"], s["end"], s["stage"]))
    metrics = standing_records(read_log(path / "metrics.jsonl")) \
        if (path / "metrics.jsonl").exists() else []
    evals = read_log(path / "eval.jsonl") if (path / "eval.jsonl").exists() else []
    return {"name": path.name, "path": path, "summary": summary, "plan": plan,
            "ratio": "colocated" if plan.get("mode") == "colocated" else
                     f"{roles['inference']}:{roles['learner']}",
            "spans": spans, "starts": starts, "metrics": metrics, "evals": evals,
            "settings": run_settings(path),
            "dumps": sorted((path / "trajectories").glob("rank*.h5"))}


def last_start_spans(files: list[list[dict]], starts: int) -> list[dict]:
    """The spans of a run's last start from its timeline files' lines: each start writes,
    after a line with its origin (`opened`, one value on every rank of a start), spans timed
    from it, appended to its ranks' files; a rank the last start did not have wrote none of
    it. Files written before the origin line (hpcvla before 2026-12-07) cannot be cut so:
    theirs if the run had one start, else none."""
    newest = max((line["opened"] for lines in files for line in lines if "opened" in line),
                 default=None)
    if newest is None:
        return [line for lines in files for line in lines] if starts == 1 else []
    out = []
    for lines in files:
        section = None
        for line in lines:
            if "opened" in line:
                section = line["opened"]
            elif section == newest:
                out.append(line)
    return out


def stage_seconds(run: dict, stage: str) -> float | None:
    """Mean busy seconds of `stage` over the ranks that ran it (RL-VLA³'s Rollout/Actor)."""
    values = [r["busy_s"][stage] for r in run["summary"]["per_rank"] if stage in r["busy_s"]]
    return sum(values) / len(values) if values else None


def _fmt(v, digits=1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def throughput_table(runs: list[dict]) -> str:
    base = next((r for r in runs if r["summary"]["mode"] == "sync-colocated"), None) or \
        next((r for r in runs if r["summary"]["mode"] == "sync-disaggregated"), None)
    base_tp = base["summary"]["env_steps_per_s"] if base else None
    lines = [f"| run | mode | ranks | inference:learner | env steps | time (s) | env steps/s | "
             f"vs {base['summary']['mode'] if base else 'baseline'} | simulate (s) | "
             "infer (s) | train (s) | learner wait (s) | success |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    resumed = []
    for r in in_table_order(runs):
        s = r["summary"]
        gain = f"{(s['env_steps_per_s'] / base_tp - 1) * 100:+.1f}%" if base_tp else "—"
        starts = r["starts"]
        if len(starts) > 1:  # summary.json and the timelines drawn are the last start's
            resumed.append(f"{r['name']}: the last of {len(starts)} starts (from version "
                           f"{starts[-1]['from_version']}); the whole run "
                           f"{sum(st['env_steps'] for st in starts)} env steps in "
                           f"{sum(st['wall_s'] for st in starts):.1f} s")
        lines.append(
            f"| {r['name']}{' (last start)' if len(starts) > 1 else ''} | {s['mode']} | "
            f"{s['ranks']} | {r['ratio']} | {s['env_steps']} | "
            f"{s['wall_s']:.1f} | {s['env_steps_per_s']:.0f} | {gain} | "
            f"{_fmt(stage_seconds(r, 'simulate'))} | {_fmt(stage_seconds(r, 'infer'))} | "
            f"{_fmt(stage_seconds(r, 'train'))} | {_fmt(stage_seconds(r, 'wait_data'))} | "
            f"{_fmt(s.get('success_rate'), 3)} |")
    return "\n".join(lines + ([""] + [f"* {line}" for line in resumed] if resumed else []))


def in_table_order(runs: list[dict]) -> list[dict]:
    """The runs as the throughput table and chart list them: by inference:learner ratio, then
    world size."""
    return sorted(runs, key=lambda r: (r["ratio"], r["summary"]["ranks"]))


def bench_modes(name: str, bench: dict) -> dict:
    """The cases of an `hpcvla bench modes --json` file, checked to be one."""
    cases = bench.get("modes") if isinstance(bench, dict) else None
    if not isinstance(cases, dict) or not cases or not all(
            isinstance(c, dict) and {"mode", "ranks", "throughput", "ideal_bound",
                                     "efficiency"} <= set(c) for c in cases.values()):
        raise ReportError(f"{name}: not the JSON of `hpcvla bench modes --json` (--bench takes "
                          "only that benchmark's)")
    return cases


def bench_table(bench: dict) -> str:
    speedup = bench.get("speedup_vs_sync_colocated", {})
    lines = ["| case | mode | ranks | env steps/s | ideal bound | efficiency | "
             "vs sync-colocated | success |", "|---|---|---|---|---|---|---|---|"]
    for label, r in bench["modes"].items():
        lines.append(f"| {label} | {r['mode']} | {r['ranks']} | {r['throughput']:.0f} | "
                     f"{r['ideal_bound']:.0f} | {r['efficiency']:.2f} | "
                     f"{_fmt(speedup.get(label), 2)}{'x' if label in speedup else ''} | "
                     f"{_fmt(r.get('success_rate'), 3)} |")
    return "\n".join(lines)


def busy_table(run: dict) -> str:
    rows = ["| role:stage | busy fraction |", "|---|---|"]
    rows += [f"| {k} | {v:.3f} |" for k, v in run["summary"]["busy_fraction"].items()]
    return "\n".join(rows)


def staleness_of(run: dict) -> dict[int, float]:
    hist = {int(k): v for k, v in run["summary"]["staleness_hist"].items()}
    total = sum(hist.values()) or 1
    return {k: v / total for k, v in sorted(hist.items())}


def dump_table(runs: list[dict]) -> str:
    from hpcvla.metrics.dump import DumpError, summarize
    lines = ["| run | file | episodes | steps | success | mean return | policy versions | "
             "complete |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for path in run["dumps"]:
            try:
                d = summarize(path)
            except DumpError as err:
                lines.append(f"| {run['name']} | {path.name} | unreadable: {err} ||||||")
                continue
            versions = "—" if d["policy_versions"] is None else \
                f"{d['policy_versions'][0]}..{d['policy_versions'][1]}"
            lines.append(f"| {run['name']} | {path.name} | {d['episodes']} | {d['steps']} | "
                         f"{_fmt(d['success_rate'], 3)} | {_fmt(d['mean_return'], 2)} | "
                         f"{versions} | {d['complete']} |")
    return "\n".join(lines)


def lanes_of(run: dict) -> list:
    return [(f"r{rank} {role}", spans) for (rank, role), spans in sorted(run["spans"].items())]


def _unique_names(runs: list[dict]) -> None:
    """Run names that name one run each (their charts' files): a name two runs share (runs of
    one config at the same second, in different folders) takes its parent folder's name, then
    a number."""
    shared = {name for name, n in Counter(r["name"] for r in runs).items() if n > 1}
    for run in runs:
        if run["name"] in shared:
            run["name"] = f"{Path(run['path']).resolve().parent.name}-{run['name']}"
    taken: set[str] = set()
    for run in runs:
        name, n = run["name"], 1
        while run["name"] in taken:
            n += 1
            run["name"] = f"{name}-{n}"
        taken.add(run["name"])


def write_report(run_dirs, bench_files=(), out="report") -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs, skipped = [], []
    for path in run_dirs:  # a run that died or was stopped has no summary: report the rest
        try:
            runs.append(load_run(path))
        except ReportError as err:
            print(f"report: skipped {err}", file=sys.stderr)
            skipped.append(str(err))
    _unique_names(runs)
    benches = [(Path(p).name, json.loads(Path(p).read_text())) for p in bench_files]
    for name, bench in benches:
        bench_modes(name, bench)  # before anything is drawn
    if not runs and not benches:
        raise ReportError("nothing to report: give run directories and/or --bench files"
                          " (each skipped one said above)")
    md = ["# hpcvla report", ""] + [f"Skipped {why}." for why in skipped] + \
        ([""] if skipped else [])
    if runs:
        md += ["Runs: " + ", ".join(f"`{r['path']}`" for r in runs), "",
               "## Throughput", "",
               "Env steps per second over the run (RL-VLA³ Eq. 2); stage columns are the mean "
               "busy seconds of the ranks running that stage (RL-VLA³ Tables 3, 4: rollout = "
               "simulate + infer, actor = train).", "", throughput_table(runs), "",
               "![throughput](throughput.png)", ""]
        names = [r["name"] for r in runs]
        listed = in_table_order(runs)
        bar_chart(out / "throughput.png",
                  [f"{r['name']}\n{r['summary']['mode']} {r['ratio']}" for r in listed],
                  {"env steps/s": [r["summary"]["env_steps_per_s"] for r in listed]},
                  "Throughput per run", "env steps/s")
    for name, bench in benches:
        md += [f"## Benchmark `{name}` ({bench.get('workload')} workload, "
               f"{bench.get('gpus')} accelerator ranks, {bench.get('updates')} updates)", "",
               bench_table(bench), "", f"![{name}]({Path(name).stem}.png)", ""]
        cases = list(bench["modes"])
        bar_chart(out / f"{Path(name).stem}.png", cases,
                  {"env steps/s": [bench["modes"][c]["throughput"] for c in cases]},
                  f"Benchmark {Path(name).stem}", "env steps/s",
                  markers={"ideal bound": [bench["modes"][c]["ideal_bound"] for c in cases]})
    if runs:
        md += ["## Timelines", "",
               "One lane per rank; a coloured bar per busy span of a stage, white is idle "
               "(`wait_data`: a learner waiting for trajectories).", ""]
        for run in runs:
            lanes = lanes_of(run)
            if not lanes:
                if len(run["starts"]) > 1:  # last_start_spans gave none
                    md += [f"### {run['name']}", "", "Not drawn: its timelines hold every "
                           "start's spans, which files written before 2026-12-07 do not tell "
                           "apart.", ""]
                continue
            swimlane(out / f"timeline-{run['name']}.png", lanes,
                     f"{run['name']} ({run['summary']['mode']})")
            begin = min(s for _, spans in lanes for s, _, _ in spans)
            middle = (begin + max(e for _, spans in lanes for _, e, _ in spans)) / 2
            window = (max(begin, middle - 1.0), middle + 1.0)
            swimlane(out / f"timeline-{run['name']}-zoom.png", lanes,
                     f"{run['name']}: {window[0]:.1f}-{window[1]:.1f} s", window=window)
            md += [f"### {run['name']}", "", f"![timeline](timeline-{run['name']}.png)", "",
                   f"![timeline zoom](timeline-{run['name']}-zoom.png)", "", busy_table(run),
                   ""]
        ended = [settled([m for m in r["metrics"] if m.get("success_rate") is not None])
                 for r in runs]  # an episode had ended
        curves = {n: ([m["trained_env_steps"] for m in records],
                      [m["success_rate"] for m in records]) for n, records in zip(names, ended)}
        curves.update({f"{n} (hpcvla eval)": ([e["trained_env_steps"] for e in r["evals"]],
                                              [e["success_rate"] for e in r["evals"]])
                       for n, r in zip(names, runs) if r["evals"]})
        line_chart(out / "success.png", curves, "Success rate: last 200 training episodes, "
                   "and hpcvla eval", "trained env steps", "success",
                   ylim=(0, 1))
        lags = sorted({k for r in runs for k in staleness_of(r)})
        bar_chart(out / "staleness.png", [f"lag {k}" for k in lags],
                  {n: [staleness_of(r).get(k) for k in lags] for n, r in zip(names, runs)},
                  "Staleness of trained segments", "fraction of segments", logy=False)
        md += ["## Success", "", "![success](success.png)", ""]
        for r in runs:
            if r["evals"]:  # hpcvla eval --all: one policy per point, fixed initial states
                md += [f"`hpcvla eval --all` of {r['name']}: " + ", ".join(
                    f"v{e['version']} {_fmt(e['success_rate'], 3)}" for e in r["evals"]), ""]
        groups = seed_groups(runs)
        if groups:
            md += seeds_section(groups, out)
        md += ["## Staleness", "",
               "Policy versions between the one that acted and the one that trained on it.",
               "", "| run | " + " | ".join(f"lag {k}" for k in lags) + " |",
               "|---|" + "---|" * len(lags)]
        md += [f"| {r['name']} | " + " | ".join(_fmt(staleness_of(r).get(k), 3) for k in lags)
               + " |" for r in runs]
        md += ["", "![staleness](staleness.png)", ""]
        if any(r["dumps"] for r in runs):
            md += ["## Trajectory dumps", "", dump_table(runs), ""]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return out / "report.md"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="run directories (hpcvla train output)")
    parser.add_argument("--bench", nargs="*", default=[], help="hpcvla bench modes JSON files")
    parser.add_argument("--out", default="report", help="output directory (default report/)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.runs, args.bench, args.out)
    except (ReportError, OSError, json.JSONDecodeError) as err:
        print(f"report: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path} and its charts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
