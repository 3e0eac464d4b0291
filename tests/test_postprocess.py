"""postprocess/report.py on real short runs: tables, swimlanes, curves and histograms."""

import json
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from hpcvla.metrics.charts import STAGE_COLORS, stage_color
from hpcvla.metrics.progress import settled
from hpcvla.metrics.stats import mean_interval
from helpers import ROOT, hpcvla, reach_demos

sys.path.insert(0, str(ROOT / "postprocess"))  # postprocess/report.py is a script, not a package
from report import lanes_of, load_run  # noqa: E402
from seed_report import seed_groups, seeds_table  # noqa: E402


def read_png(path) -> np.ndarray:
    """RGB pixels (uint8) of a PNG, read back by matplotlib."""
    return (imread(path)[..., :3] * 255).round().astype(np.uint8)


def report(*args):
    return subprocess.run([sys.executable, ROOT / "postprocess" / "report.py", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def train(root, *args):
    out = hpcvla("train", *args, f"run.root={root}", timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = root.iterdir()
    return run_dir, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.mpi
@pytest.mark.slow
def test_report_of_a_streamer_and_a_colocated_run(tmp_path):
    """postprocess/report.py over two real runs (a streamer one with its trajectory dump, a
    colocated one). ~35 s: the two training worlds it reports on."""
    streamer, s1 = train(tmp_path / "a", "configs/default.yaml", "--ranks", 4,
                         "pipeline.total_updates=3", "run.dump_trajectories=true")
    colocated, s2 = train(tmp_path / "b", "configs/colocated.yaml", "--ranks", 2,
                          "pipeline.total_updates=2")
    out = hpcvla("eval", streamer, "--all", "--episodes", 32)  # writes its eval.jsonl
    assert out.returncode == 0, out.stderr
    assert "one policy, no curve: the run kept one checkpoint" in out.stderr  # and says how
    out = report(streamer, colocated, "--out", tmp_path / "report")
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    # the throughput table: a row per run, gains against the sync-colocated baseline
    assert "| vs sync-colocated |" in md
    gain = (s1["env_steps_per_s"] / s2["env_steps_per_s"] - 1) * 100
    assert f"| {streamer.name} | streamer | 4 | 1:1 | {s1['env_steps']} |" in md
    assert f"| {s1['env_steps_per_s']:.0f} | {gain:+.1f}% |" in md
    assert f"| {colocated.name} | sync-colocated | 2 | colocated | {s2['env_steps']} |" in md
    # staleness as fractions of the trained segments, from the learner's histogram
    total = sum(s1["staleness_hist"].values())
    assert f"| {streamer.name} | {s1['staleness_hist']['0'] / total:.3f} | " \
           f"{s1['staleness_hist']['1'] / total:.3f} |" in md
    assert "## Trajectory dumps" in md and "| rank0.h5 |" in md
    assert f"`hpcvla eval --all` of {streamer.name}: v3 0." in md  # beside training's curve
    assert f"hpcvla eval --all` of {colocated.name}" not in md
    lanes = {r: len(lanes_of(load_run(r))) for r in (streamer, colocated)}  # (rank, role)s
    assert lanes[streamer] >= 4
    for name, shape in (("throughput", (420, 900)), ("success", (420, 900)),
                        ("staleness", (420, 900)),
                        *((f"timeline-{r.name}{zoom}", (130 + 22 * n, 1000))
                          for r, n in lanes.items() for zoom in ("", "-zoom"))):
        assert f"({name}.png)" in md
        pixels = read_png(tmp_path / "report" / f"{name}.png")
        assert pixels.shape == (*shape, 3), name
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20, name  # not blank
    # the swimlanes show each stage in its fixed colour: simulators, inference, learner
    pixels = read_png(tmp_path / "report" / f"timeline-{streamer.name}.png").reshape(-1, 3)
    colours = {tuple(c) for c in np.unique(pixels, axis=0)}
    for stage in ("simulate", "infer", "train"):
        assert tuple(round(v * 255) for v in to_rgb(STAGE_COLORS[stage])) in colours, stage
    # two runs of one name (another folder) get a chart each; a folder that is no finished
    # run (here the folder of the colocated run) is skipped, said why, and the rest reported
    twin = tmp_path / "c" / streamer.name
    shutil.copytree(streamer, twin)
    out = report(streamer, twin, tmp_path / "b", "--out", tmp_path / "again")
    assert out.returncode == 0 and "skipped" in out.stderr, out.stderr
    md = (tmp_path / "again" / "report.md").read_text()
    assert f"Skipped {tmp_path / 'b'}: a folder of runs ({colocated.name}): give them, " \
        f"{tmp_path / 'b'}/*" in md, md
    for folder in ("a", "c"):
        assert (tmp_path / "again" / f"timeline-{folder}-{streamer.name}.png").exists()


@pytest.mark.mpi
@pytest.mark.slow
def test_runs_differing_only_by_seed_are_reported_as_one_group_over_its_seeds(tmp_path):
    """Two real runs of one config but their seed (held-out evaluations while training), and
    a copy of both with another learning rate: two groups of the runs' name, told apart by
    that setting, each with its seeds' mean and 95 % t interval; a run alone is in none.
    ~25 s: two short training worlds."""
    runs = [train(tmp_path / f"seed{seed}", "configs/colocated.yaml", "pipeline.total_updates=4",
                  f"run.seed={seed}", "eval.every=2", "eval.states_per_task=16")[0]
            for seed in (1, 2)]
    for run in runs:  # the same runs as if another learning rate had made them
        copy = tmp_path / "lr" / run.name
        shutil.copytree(run, copy)
        config = (copy / "config.yaml").read_text()
        assert "  lr: 0.0003\n" in config
        (copy / "config.yaml").write_text(config.replace("  lr: 0.0003\n", "  lr: 0.001\n"))
    alone, _ = train(tmp_path / "alone", "configs/colocated.yaml", "pipeline.total_updates=2")
    out = report(*runs, *(tmp_path / "lr").iterdir(), alone, "--out", tmp_path / "report")
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    loaded = [load_run(r) for r in runs]
    groups = seed_groups(loaded + [load_run(alone)])
    assert list(groups) == ["colocated"]  # the copies are loaded by the script, not here
    summaries = [r["summary"] for r in loaded]
    rates = [s["success_rate"] for s in summaries]
    mean, low, high = mean_interval(rates)
    held = [[m["held_out"] for m in r["metrics"] if "held_out" in m][-1] for r in loaded]
    assert len({h["version"] for h in held}) == 1 and held[0]["version"] == 4
    steps = mean_interval([s["env_steps_per_s"] for s in summaries])
    for lr in ("0.0003", "0.001"):
        assert (f"| colocated algorithm.lr={lr} | 1, 2 | {steps[0]:.0f} [{max(steps[1], 0):.0f}, "
                f"{steps[2]:.0f}] (n=2) | {mean:.3f} [{max(low, 0):.3f}, {min(high, 1):.3f}] "
                f"(n=2) | ") in md, md
    heldmean = mean_interval([h["success_rate"] for h in held])[0]
    assert f"| {heldmean:.3f} [" in md and f"| v4 ({held[0]['episodes']} episodes) |" in md
    assert alone.name not in md.split("## Seeds")[1].split("## Staleness")[0]
    for chart in ("seeds.png", "seeds-held-out.png"):
        assert read_png(tmp_path / "report" / chart).shape[:2] == (460, 900)


@pytest.mark.mpi
@pytest.mark.slow
def test_a_resumed_run_is_reported_as_its_last_start_said_so(tmp_path):
    """A resumed run appends each start's spans to its timelines, timed from that start: the
    report drew every start's on one axis, over each other, beside a table row of the last
    start's summary.json, named as the whole run. Now the row and the swimlanes are the last
    start's (each start's spans follow a line with its origin), said so, with the whole
    run's env steps. ~30 s: two short colocated starts."""
    run_dir, first = train(tmp_path / "runs", "configs/colocated.yaml",
                           "pipeline.total_updates=3")
    out = hpcvla("train", f"run.resume={run_dir}", "pipeline.total_updates=5", timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    second = json.loads((run_dir / "summary.json").read_text())
    files = sorted(run_dir.glob("timeline.rank*.jsonl"))
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [i for i, line in enumerate(lines) if "opened" in line][0] == 0
    (at,) = [i for i, line in enumerate(lines) if "opened" in line][1:]
    run = load_run(run_dir)
    drawn = sorted(span for (rank, _), spans in run["spans"].items() if rank == 0
                   for span in spans)
    assert drawn == sorted((s["start"], s["end"], s["stage"]) for s in lines[at + 1:])
    # the report as the run's last line gives it (beside its evaluation)
    printed = re.search(r"\(next: hpcvla eval \S+; its report: (.*)\)$", out.stdout, re.M)
    assert printed, out.stdout[-1000:]
    made = subprocess.run(shlex.split(printed.group(1)), capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    md = (run_dir / "report" / "report.md").read_text()
    assert f"| {run_dir.name} (last start) | sync-colocated | {second['ranks']} |" in md, md
    assert f"| {second['env_steps']} |" in md
    assert (f"* {run_dir.name}: the last of 2 starts (from version 3); the whole run "
            f"{first['env_steps'] + second['env_steps']} env steps in ") in md, md


def test_a_resumed_runs_last_start_is_its_ranks_newest_section_on_every_rank():
    """The last start's spans are those after its origin line on every rank's file: a rank
    the last start did not have (a resume on fewer ranks) drew its first start's as the
    last's. Files written before the origin line: all of one start, none of several."""
    from report import last_start_spans

    def span(stage):
        return {"rank": 0, "role": "learner", "stage": stage, "start": 0.0, "end": 1.0}
    first, last = {"opened": 100.0}, {"opened": 200.0}
    files = [[first, span("a"), last, span("b")], [first, span("c")], [last, span("d")]]
    assert [s["stage"] for s in last_start_spans(files, 2)] == ["b", "d"]
    assert [s["stage"] for s in last_start_spans([[span("a"), span("b")]], 1)] == ["a", "b"]
    assert last_start_spans([[span("a"), span("b")]], 2) == []


def test_runs_of_one_seed_or_another_trajectory_dump_are_no_seed_group():
    """Two runs of seed 0, one of them writing a trajectory dump, were reported as a group of
    seeds, their env steps/s interval reaching below 0: a dump is part of a configuration
    (it costs throughput), a run's name, logs and seed are not, and a group has two seeds
    or more."""
    def run(seed, steps, **settings):
        return {"name": f"r{seed}", "summary": {"success_rate": 0.5, "env_steps_per_s": steps},
                "evals": [], "metrics": [], "settings": {
                    "run.seed": seed, "run.name": "r", "run.dump_trajectories": False,
                    "run.tensorboard": True, **settings}}
    dumped = {"run.dump_trajectories": True}
    assert seed_groups([run(0, 6150), run(0, 15500, **dumped)]) == {}
    assert seed_groups([run(0, 100), run(0, 120)]) == {}  # one seed twice: no seeds
    assert seed_groups([run(0, 100), run(0, 120), run(1, 110)]) == {}  # nor counted twice
    groups = seed_groups([run(0, 500), run(1, 15000, **{"run.tensorboard": False}),
                          run(2, 600, **dumped)])
    assert [[r["settings"]["run.seed"] for r in rs] for rs in groups.values()] == [[0, 1]]
    assert "| 0, 1 | 7750 [0, " in seeds_table(groups), seeds_table(groups)


def test_an_evaluation_of_no_verdict_is_left_out_of_the_seeds_figures():
    """A held-out evaluation every episode of which was an env fault reports no success rate
    (None): the seeds' held-out figure is over the seeds that have one."""

    def run(seed, held):
        return {"summary": {"success_rate": 0.5, "env_steps_per_s": 100.0},
                "settings": {"run.seed": seed}, "evals": [],
                "metrics": [{"held_out": {"version": 4, "success_rate": held, "episodes": 16}}]}
    table = seeds_table({"reach": [run(1, 0.25), run(2, None), run(3, 0.75)]})
    assert "| 0.500 [0.000, 1.000] (n=2) | v4 (16 episodes) |" in table, table


def test_the_statistics_leave_out_the_figures_not_known():
    """bench learning's means and differences over seeds: a seed whose evaluation gave no
    verdict (None) is left out and counted; a side with none gives none."""
    from hpcvla.metrics.stats import known_difference, known_mean, welch_interval
    assert known_mean([0.5, None, 1.0]) == 0.75 and known_mean([None]) is None
    found = known_difference([0.5, None, 0.7], [0.1, 0.2, 0.3], "a_minus_b")
    diff, low, high = welch_interval([0.5, 0.7], [0.1, 0.2, 0.3])
    assert found == {"a_minus_b": diff, "ci95": [low, high], "seeds": [2, 3]}
    assert known_difference([0.5, None], [0.25])["ci95"] == [0.25, 0.25]  # one a side
    assert known_difference([None, None], [0.25]) is None


def test_a_mean_over_seeds_has_the_student_t_interval():
    from scipy.stats import t
    values = [0.2, 0.5, 0.6]
    mean, low, high = mean_interval(values)
    half = t.ppf(0.975, 2) * np.std(values, ddof=1) / np.sqrt(3)
    assert (mean, low, high) == pytest.approx((13 / 30, 13 / 30 - half, 13 / 30 + half),
                                              abs=1e-3)
    assert mean_interval([0.7]) == (0.7, 0.7, 0.7)  # one seed: no interval


def test_report_refuses_what_is_not_a_run(tmp_path):
    """Each path that is no run said once, why: no run there, a folder of runs (runs/
    for runs/*), nothing there (one reason for all three, said twice)."""
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "summary.json").write_text("{}")
    out = report(tmp_path, tmp_path / "runs", tmp_path / "none", "--out", tmp_path / "r")
    assert out.returncode == 2 and "nothing to report" in out.stderr, out.stderr
    assert out.stderr.count(f"{tmp_path}: no summary.json (not a run directory") == 1
    assert f"{tmp_path / 'runs'}: a folder of runs (a): give them, {tmp_path / 'runs'}/*" \
        in out.stderr and f"{tmp_path / 'none'}: no such directory" in out.stderr, out.stderr


@pytest.mark.mpi
def test_report_skips_an_sft_run_saying_where_its_losses_are(tmp_path):
    """An `hpcvla sft` run directory among RL runs (`report.py runs/*`): skipped, said. ~8 s."""
    demos = reach_demos(tmp_path / "demos.h5", 2)
    out = hpcvla("sft", "configs/default.yaml", f"sft.demos={demos}", "sft.steps=3",
                 f"run.root={tmp_path / 'runs'}")
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    out = report(run_dir, "--out", tmp_path / "r")
    assert out.returncode == 2 and "an `hpcvla sft` run (its losses are in" in out.stderr, \
        out.stderr


def test_stage_colours_are_fixed_and_unknown_stages_stable():
    assert stage_color("train") == STAGE_COLORS["train"]
    assert stage_color("no-such-stage") == stage_color("no-such-stage")  # crc32, not hash()
    assert stage_color("no-such-stage") not in STAGE_COLORS.values()
    assert len(set(STAGE_COLORS.values())) == len(STAGE_COLORS)


def test_benchmark_bars_draw_the_ideal_bound(tmp_path):
    bench = {"workload": "emulated", "gpus": 2, "updates": 3, "modes": {
        m: {"mode": m, "ranks": 2, "throughput": tp, "ideal_bound": bound,
            "efficiency": tp / bound} for m, tp, bound in
        (("sync-colocated", 500.0, 600.0), ("streamer", 1200.0, 1500.0))}}
    (tmp_path / "b.json").write_text(json.dumps(bench))
    out = report("--bench", tmp_path / "b.json", "--out", tmp_path / "r")
    assert out.returncode == 0, out.stderr
    pixels = read_png(tmp_path / "r" / "b.png")
    assert pixels.shape == (420, 900, 3)
    # the bounds: a black line across each bar (at two heights; the frame spans the width)
    black = (pixels == 0).all(axis=2).sum(axis=1)
    assert ((black > 100) & (black < 400)).sum() >= 2


def test_a_bench_file_of_another_benchmark_is_refused_naming_it(tmp_path):
    """`--bench` takes `hpcvla bench modes --json`; `bench learning`'s (it has `modes` too,
    of arms) and `bench checkpoint`'s are named, not a traceback."""
    for name, bench in (("learning.json", {"modes": {"changed": {"runs": []}}}),
                        ("checkpoint.json", {"arms": {}})):
        (tmp_path / name).write_text(json.dumps(bench))
        out = report("--bench", tmp_path / name, "--out", tmp_path / "r")
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"{name}: not the JSON of `hpcvla bench modes --json`" in out.stderr


def test_a_resumed_starts_records_replace_the_versions_it_trained_again():
    """A start resumed from version 2 behind records up to 4 (a crash between checkpoints):
    its records stand for versions 3 and 4, as TensorBoard's purge keeps them."""
    from hpcvla.metrics.progress import standing_records
    first = [{"update": u, "from_version": 0, "start": 1} for u in (1, 2, 3, 4)]
    second = [{"update": u, "from_version": 2, "start": 2} for u in (3, 4, 5)]
    third = [{"update": 6, "from_version": 5, "start": 3}]
    kept = standing_records(first + second + third)
    assert [(r["update"], r["start"]) for r in kept] == [(1, 1), (2, 1), (3, 2), (4, 2),
                                                         (5, 2), (6, 3)]
    assert standing_records(first) == first
    # two starts from the same checkpoint (the second died before its first): the later one's
    # stand, told apart by its clock starting again
    timed = [{**r, "time": float(i)} for i, r in enumerate(first)]
    again = [{"update": u, "from_version": 2, "start": s, "time": float(u)}
             for s, updates in ((2, (3, 4)), (3, (3, 4, 5))) for u in updates]
    kept = standing_records(timed + again)
    assert [(r["update"], r["start"]) for r in kept] == [(1, 1), (2, 1), (3, 3), (4, 3),
                                                         (5, 3)]


def test_the_success_curve_starts_once_its_window_holds_episodes():
    """The first rolling-success records rate one or two episodes (1.0 or 0.0): the chart
    starts at the first whose window holds 20, or as many as the run ever held."""
    records = [{"episodes": n, "success_rate": 1.0 if n < 3 else 0.1} for n in (1, 2, 19, 20, 200)]
    assert [m["episodes"] for m in settled(records)] == [20, 200]
    short = [{"episodes": n, "success_rate": 0.5} for n in (1, 3, 5)]  # a run of 5 episodes
    assert [m["episodes"] for m in settled(short)] == [5]
    assert settled([]) == []

