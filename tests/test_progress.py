"""The progress line's ETA: the remaining versions at the recent versions' rate, shown only
once three versions have ended, so that start-up and the first, slower versions do not make
the first estimates wrong by a factor; and the launch the start and stop are timed from."""

import os
import time

import pytest

from hpcvla.metrics import progress
from hpcvla.metrics.progress import Progress


def test_the_eta_follows_the_recent_rate_not_the_start_up(monkeypatch, capsys):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    line = Progress(None, total_updates=20, chunk_len=4, every_s=0, enabled=True)
    clock[0] = 60.0  # a minute of start-up before the first version ends
    line.on_update(1)
    clock[0] += 5.0  # then 5 s per version, except a slow second one
    line.on_update(2)
    clock[0] += 2.0
    line.on_update(3)
    printed = capsys.readouterr().out.splitlines()
    assert [p.rsplit("ETA ", 1)[1] for p in printed] == ["--", "--", "0m59s"]  # 17 x 7 s / 2
    for n in range(4, 11):
        clock[0] += 2.0
        line.on_update(n)
    assert line.eta_s() == 20.0  # the window (8 versions) now holds only the 2 s ones
    assert capsys.readouterr().out.splitlines()[-1].endswith("ETA 0m20s")
    clock[0] += 1.0
    line.on_update(20)
    assert capsys.readouterr().out.splitlines()[-1].endswith("ETA 0m00s")


def test_a_held_out_evaluation_is_logged_at_the_trained_steps_of_its_version(tmp_path, capsys):
    """A report may arrive versions after the one it evaluated: its record and its point on the
    curve carry that version's trained env steps, and the progress lines show it after."""
    import json

    line = Progress(tmp_path / "metrics.jsonl", total_updates=9, chunk_len=4, every_s=0,
                    enabled=True, evaluated=True)
    for version, steps in ((1, 100), (2, 200), (3, 300)):
        line.steps = steps
        line.on_update(version)
    report = {"success_rate": 0.25, "success_ci95": [0.1, 0.5], "mean_return": 1.5,
              "episodes": 16, "actions": "deterministic", "env_faults": 0,
              "protocol": {"name": "libero", "steps": 220, "suite": "libero_spatial"}}
    line.on_held_out(2, report)
    line.on_update(4)
    assert list(line.steps_at) == [2, 3, 4]  # from the last reported on: reports come in order
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("[hpcvla] held-out evaluation of version 2: success 0.250 "
                              "(95 % 0.100-0.500) over 16 episodes (deterministic actions, "
                              "libero protocol, 220 steps)")  # which figure it is
    assert "| held-out 0.25 (v2) | ETA" in out[-1]
    line.close()
    (record,) = [json.loads(r)["held_out"] for r in (tmp_path / "metrics.jsonl").open()]
    assert record == {"version": 2, "trained_env_steps": 200, "success_rate": 0.25,
                      "mean_return": 1.5, "success_ci95": [0.1, 0.5], "episodes": 16,
                      "actions": "deterministic", "env_faults": 0,
                      "protocol": {"name": "libero", "steps": 220}}


def test_a_run_without_held_out_evaluations_keeps_no_steps_per_version():
    """Each version's trained env steps are kept for the held-out evaluations only: a run of
    days without them held one entry per version (~100 B: ~0.2 GB a day at reach's pace)."""
    line = Progress(None, total_updates=10 ** 6, chunk_len=4, every_s=1e9, enabled=True)
    for version in range(1, 1000):
        line.on_update(version)
    assert line.steps_at == {0: 0}


def test_no_success_figure_before_an_episode_ends_and_the_learners_pooled(tmp_path, capsys):
    """Before any episode has ended the rolling success is no figure (`-`, null), not 0; the
    run's figure pools every learner's last episodes (summary.json)."""
    import json

    import numpy as np

    from hpcvla.config import load_config
    from hpcvla.metrics.tensorboard import RunBoard, read_scalars
    from hpcvla.roles.outputs import _pooled
    line = Progress(tmp_path / "metrics.jsonl", total_updates=2, chunk_len=4, every_s=0,
                    enabled=True, board=RunBoard(tmp_path, load_config().run))
    running = {"done": np.zeros((2, 3), bool), "env_fault": np.zeros((2, 3), bool),
               "success": np.zeros((2, 3), bool), "episode_return": np.zeros((2, 3)),
               "episode_length": np.zeros((2, 3), np.int32)}
    line.on_segments(running)
    line.on_micro_batch({"loss": 1.0})
    line.on_update(1)
    assert "success - (last 0 eps) | return - |" in capsys.readouterr().out
    ended = {**running, "done": np.eye(2, 3, dtype=bool), "success": np.eye(2, 3, dtype=bool),
             "episode_return": np.full((2, 3), 2.0), "episode_length": np.full((2, 3), 5)}
    line.on_segments(ended)
    line.on_micro_batch({"loss": 1.0})
    line.on_update(2)
    assert "success 1.00 (last 2 eps) | return 2.00 |" in capsys.readouterr().out
    line.close()
    records = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["success_rate"] for r in records] == [None, 1.0]
    scalars = read_scalars(tmp_path)  # TensorBoard (closed with the line): only the figures
    assert [v for _, v in scalars["rollout/success_rate"]] == [1.0]
    assert [v for _, v in scalars["rollout/mean_return"]] == [2.0]
    # two learners' windows: 0.5 over 4 episodes and 1.0 over 2 are 4/6 over all 6; a learner
    # with none ended adds nothing; no episode anywhere: no figure
    assert _pooled([(0.5, 4), (1.0, 2), (None, 0)]) == 4 / 6
    assert _pooled([(None, 0), (None, 0)]) is None


def test_with_several_learners_the_figures_shown_are_their_pooled_windows(tmp_path, capsys):
    """`pool` sums over the learners at every version's end (here a stand-in for a second
    learner whose window holds 2 failures of 9 chunks): the line and the records show the
    pool, not this learner's own; before the first version's end, nothing."""
    import json

    import numpy as np
    line = Progress(tmp_path / "metrics.jsonl", total_updates=2, chunk_len=4, every_s=0,
                    enabled=True)
    line.pool = lambda mine: mine + np.array([0.0, 0.0, 18.0, 2.0])  # [dist] in a run
    ended = {"done": np.eye(2, 3, dtype=bool), "env_fault": np.zeros((2, 3), bool),
             "success": np.eye(2, 3, dtype=bool), "episode_return": np.full((2, 3), 2.0),
             "episode_length": np.full((2, 3), 5, np.int32)}
    line.on_segments(ended)
    line.on_micro_batch({"loss": 1.0})
    line.on_update(1)
    assert "success 0.50 (last 4 eps) | return 1.00 |" in capsys.readouterr().out
    line.on_micro_batch({"loss": 1.0})
    line.close()
    records = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["success_rate"] for r in records] == [None, 0.5]
    assert records[1]["mean_episode_chunks"] == 7.0 and records[1]["episodes"] == 4
    assert line.success_rate == 1.0  # its own window (summary.json pools those)


def test_a_start_resumed_behind_the_last_one_logged_is_drawn_once(tmp_path):
    """A start that died after its checkpoint at version 2 logged versions 3-4; the start
    resumed from version 2 trains them again. metrics.jsonl: every record names the version
    it trains (1 .. total) and the version its start began from; TensorBoard drops the dead
    start's events past the checkpoint (its purge_step), so each curve has each step once."""
    import json

    from hpcvla.config import load_config
    from hpcvla.metrics.tensorboard import RunBoard, read_scalars

    run = load_config().run

    def start(versions, resumed_from=None, lost=0.0):
        board = RunBoard(tmp_path, run, resumed_at=None if resumed_from is None else
                         resumed_from * 100)
        line = Progress(tmp_path / "metrics.jsonl", total_updates=5, chunk_len=4, every_s=1e9,
                        enabled=True, board=board)
        if resumed_from is not None:
            line.resume(resumed_from, resumed_from * 100)
        for version in versions:
            line.steps = version * 100
            line.on_micro_batch({"loss": version + lost})
            line.on_update(version)
        line.close()
    start([1, 2, 3, 4], lost=0.5)  # died in version 5, after the checkpoint of version 2
    start([3, 4, 5], resumed_from=2)
    records = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["update"], r["from_version"]) for r in records] == \
        [(1, 0), (2, 0), (3, 0), (4, 0), (3, 2), (4, 2), (5, 2)]
    kept = {r["update"]: r["loss"] for r in records}  # the later start's stand
    assert kept == {1: 1.5, 2: 2.5, 3: 3.0, 4: 4.0, 5: 5.0}
    assert read_scalars(tmp_path)["train/loss"] == \
        [(100, 1.5), (200, 2.5), (300, 3.0), (400, 4.0), (500, 5.0)]


def test_records_count_time_from_the_timelines_origin(tmp_path):
    """metrics.jsonl's `time` and the timelines' spans are seconds since one origin (the
    world's t0): the logging writers' start (W&B's takes seconds) is not taken off it."""
    import json

    line = Progress(tmp_path / "metrics.jsonl", total_updates=2, chunk_len=4, every_s=1e9,
                    enabled=True, t0=time.time() - 5.0)
    line.on_micro_batch({"loss": 1.0})
    line.close()
    (record,) = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 5.0 <= record["time"] < 6.0, record


def test_a_process_s_launch_is_its_start_to_the_clock_tick(monkeypatch):
    """Without HPCVLA_LAUNCHED_AT the launch is the process's start: a child started after
    `before` must not say it started earlier than that (psutil's boot time, whole seconds,
    put it up to a second early, and every step of phases_s that much late)."""
    import subprocess
    import sys

    from hpcvla.metrics import phases

    monkeypatch.delenv(phases.LAUNCHED_AT, raising=False)
    before = time.time()
    said = subprocess.run(
        [sys.executable, "-c", "from hpcvla.metrics import phases; print(phases.launched_at())"],
        capture_output=True, text=True, check=True, env={**os.environ}).stdout
    after = time.time()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - tick <= float(said) <= after, (before, said, after)


def test_a_timeline_writes_its_spans_for_run_timeline_s_then_counts_them(tmp_path):
    """Spans ending after run.timeline_s are counted (summary.json's busy fractions), not
    written: a rank's file stops growing in a run of days (~0.3 GB a day an inference rank)."""
    import json

    from hpcvla.metrics.timeline import Timeline
    path = tmp_path / "timeline.rank3.jsonl"
    line = Timeline(path, 3, "inference", t0=100.0, flush_every=2, keep_s=10.0)
    for start in (1.0, 4.0, 9.0, 12.0, 30.0):
        line.record("infer", start, start + 1.0)
    line.close()
    opened, *written = [json.loads(r) for r in path.read_text().splitlines()]
    assert opened == {"rank": 3, "role": "inference", "opened": 100.0}  # the start's origin
    assert [s["start"] for s in written] == [1.0, 4.0, 9.0]
    assert line.counts["infer"] == 5 and line.busy["infer"] == 5.0
    assert line.last["infer"] == (30.0, 31.0)


def test_the_last_version_trained_comes_before_its_checkpoint_is_written():
    """The last version's publish holds the run's last checkpoint: the step read from the
    publish span's end came at or after the checkpoint's (outputs.md had them the other way
    round); training's end is the last publish's start."""
    from hpcvla.metrics import phases
    from hpcvla.metrics.timeline import Timeline
    line = Timeline(None, 0, "learner", t0=phases.launched_at())
    for version in range(3):  # the checkpoint ends first: spans are recorded as they end
        line.record("checkpoint", 10.0 * version + 6.0, 10.0 * version + 9.0)
        line.record("publish", 10.0 * version + 5.0, 10.0 * version + 9.0, nested=3.0)
    steps = phases.of_rank(line)
    assert steps["first_version_trained"] == 5.0 and steps["last_version_trained"] == 25.0
    assert steps["last_checkpoint_written"] == 29.0


def test_a_span_inside_another_counts_under_itself_alone():
    """busy counts a span's own seconds (a checkpoint inside the version's publish, a full
    lane's wait inside a send): a rank's stages add up to at most its time, where they
    counted the inner seconds twice."""
    import time

    from hpcvla.metrics.timeline import Timeline
    line = Timeline(None, 0, "learner")
    begin = time.monotonic()
    with line.span("publish"):
        time.sleep(0.02)
        with line.span("checkpoint"):
            time.sleep(0.05)
            start = line.now()
            line.record("inner", start, start + 0.01)  # recorded, not a `with`: the same
    outer = time.monotonic() - begin
    assert line.busy["inner"] == pytest.approx(0.01)
    assert 0.04 - 0.002 < line.busy["checkpoint"] < 0.06, dict(line.busy)
    assert 0.02 - 0.002 < line.busy["publish"] < 0.035, dict(line.busy)
    assert sum(line.busy.values()) == pytest.approx(outer, abs=0.005)
    with line.span("train"):  # nothing open around it: whole
        time.sleep(0.01)
    assert line.busy["train"] >= 0.01 and not line._open


def test_metrics_records_keep_small_figures_to_significant_digits(tmp_path):
    """A VLA recipe's first warmed-up learning rate (1e-5 / 11) and a tiny KL stay what they
    are in metrics.jsonl, as in TensorBoard (decimal places made them 1e-06 and 0.0)."""
    import json
    line = Progress(tmp_path / "metrics.jsonl", total_updates=2, chunk_len=4, every_s=0,
                    enabled=True)
    line.on_micro_batch({"actor_lr": 1e-5 / 11, "approx_kl": 3.14159e-8, "loss": 0.123456789})
    line.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["actor_lr"] == pytest.approx(1e-5 / 11, rel=1e-6)
    assert record["approx_kl"] == 3.14159e-8 and record["loss"] == 0.1234568


def test_the_rate_shown_is_the_recent_versions_not_the_whole_runs(monkeypatch, capsys):
    """Hours into a run a slowdown must show: the trained steps/s line (and perf/ in
    TensorBoard) spans the versions of the last RATE_WINDOW_S, not the run since its start."""
    import numpy as np
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    line = Progress(None, total_updates=100, chunk_len=4, every_s=0, enabled=True)
    batch = {k: np.zeros((1, 250), bool) for k in ("done", "env_fault", "success")}
    batch.update(episode_return=np.zeros((1, 250)), episode_length=np.zeros((1, 250), int))

    def versions(n: int, seconds: float) -> float:
        for _ in range(n):
            clock[0] += seconds
            line.on_segments(batch)  # 1,000 trained env steps a version
            line.on_update(line.updates + 1)
        return float(capsys.readouterr().out.splitlines()[-1].split(" | ")[1].split()[0])
    assert versions(40, 1.0) == pytest.approx(1000, rel=0.01)
    slow = versions(5, 10.0)  # 10x slower: the whole run's mean would still say ~530
    assert slow == pytest.approx(100, rel=0.2), slow


def test_tensorboard_gets_a_point_a_version_whatever_its_records(tmp_path):
    """With learner.epochs > 1 every record of a version comes after its segments, at one
    trained-steps value: TensorBoard gets one point a version, the mean of its records (and
    the rolling figures at its end); metrics.jsonl keeps every record."""
    import json

    import numpy as np

    from hpcvla.config import load_config
    from hpcvla.metrics.tensorboard import RunBoard, read_scalars
    line = Progress(tmp_path / "metrics.jsonl", total_updates=2, chunk_len=4, every_s=0,
                    enabled=True, board=RunBoard(tmp_path, load_config().run))
    batch = {k: np.zeros((1, 8), bool) for k in ("done", "env_fault", "success")}
    batch.update(episode_return=np.zeros((1, 8)), episode_length=np.zeros((1, 8), int))
    for version, losses in ((1, [1.0, 2.0, 3.0, 4.0]), (2, [5.0, 7.0])):
        line.on_segments(batch)
        for loss in losses:  # a version's last epoch: its micro-batches' records
            line.on_micro_batch({"loss": loss, **({"kl": 0.5} if loss > 3 else {})})
        line.on_update(version)
    line.close()
    board = read_scalars(tmp_path)
    assert board["train/loss"] == [(32, 2.5), (64, 6.0)]
    assert board["train/kl"] == [(32, 0.5), (64, 0.5)]  # over the records that have it
    records = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["loss"] for r in records] == [1.0, 2.0, 3.0, 4.0, 5.0, 7.0]


def test_training_success_is_counted_per_task_and_pooled_over_the_learners():
    """A multi-task suite's episodes (EnvSpec.tasks: LIBERO's with env.suite_task=-1) count
    under the task of the instruction they acted on, each task's last `window` of them; the
    learners' counts are summed where the rolling figures are (each learner's producers run
    some of the tasks); a suite's duplicate instruction is one task."""
    import numpy as np

    from hpcvla.envs.base import EnvSpec
    from hpcvla.metrics.task_success import pooled_rates
    from hpcvla.text import tokenize, vocab_of
    tasks = ("pick up the bowl", "open the drawer", "pick up the bowl", "close it")
    spec = EnvSpec(obs={"instruction": ((4,), "<i4")}, action_dim=2, chunk_len=1,
                   max_episode_chunks=9, vocab=vocab_of(tasks), tasks=tasks)

    def batch(rows: list[str], success: list[bool]) -> dict:  # one step of len(rows) envs
        n = len(rows)
        return {"obs.instruction": np.stack([tokenize(r, spec.vocab, 4) for r in rows])[None],
                "done": np.ones((1, n), bool), "env_fault": np.zeros((1, n), bool),
                "success": np.array([success]), "episode_return": np.zeros((1, n), np.float32),
                "episode_length": np.ones((1, n), np.int32)}

    first, second = (Progress(None, 10, 1, 1e9, enabled=False, window=2, spec=spec)
                     for _ in range(2))
    assert first.tasks.tasks == ("pick up the bowl", "open the drawer", "close it")
    first.on_segments(batch(["pick up the bowl"] * 3, [True, False, True]))  # window 2: F, T
    first.on_segments(batch(["open the drawer"], [True]))
    second.on_segments(batch(["open the drawer", "close it"], [False, False]))
    assert first.tasks.outcomes() == {"pick up the bowl": [1, 2], "open the drawer": [1, 1],
                                      "close it": [0, 0]}
    sent = []
    second.pool = lambda v: sent.append(v) or v
    second.on_update(1)
    first.pool = lambda v: v + sent[0]
    first.on_update(1)
    assert first.tasks.scalars(first._task_counts) == {  # by the suite's task indices
        "task_00": 0.5, "task_01": 0.5, "task_03": 0.0}
    assert pooled_rates([first.tasks.outcomes(), second.tasks.outcomes()]) == {
        "pick up the bowl": {"success_rate": 0.5, "episodes": 2},
        "open the drawer": {"success_rate": 0.5, "episodes": 2},
        "close it": {"success_rate": 0.0, "episodes": 1}}
    # a learner given no observations (SAC's counts its episodes from the scored fields)
    unseen = {k: v for k, v in batch(["close it"], [True]).items() if k != "obs.instruction"}
    first.on_segments(unseen)
    assert first.tasks.outcomes()["close it"] == [0, 0] and first.successes[-1] is True
    one = EnvSpec(obs=spec.obs, action_dim=2, chunk_len=1, max_episode_chunks=9,
                  vocab=spec.vocab, tasks=tasks[:1])
    assert Progress(None, 10, 1, 1e9, enabled=False, spec=one).tasks is None  # one task


def test_an_envs_episode_metrics_are_windowed_pooled_and_summed_up(tmp_path, capsys):
    """A simulator's own episode figures (EnvSpec.episode_metrics: ManiSkill's `grasped`) go
    with its ended episodes, faults left out and a value not known (NaN: an episode GRPO's
    grouped restart cut) too: each learner's window, pooled over the learners in the line,
    metrics.jsonl and TensorBoard (`episode_<name>`), and in summary.json."""
    import json

    import numpy as np

    from hpcvla.envs.base import EnvSpec
    from hpcvla.metrics.episode_metrics import pooled
    spec = EnvSpec(obs={"state": ((3,), "<f4")}, action_dim=2, chunk_len=1,
                   max_episode_chunks=9, vocab=("",), episode_metrics=("grasped",))

    def batch(grasped: list[float], fault: list[bool]) -> dict:  # one step of len(...) envs
        n = len(grasped)
        return {"done": np.ones((1, n), bool), "env_fault": np.array([fault]),
                "success": np.zeros((1, n), bool), "episode_return": np.zeros((1, n)),
                "episode_length": np.ones((1, n), np.int32),
                "metric.grasped": np.array([grasped], np.float32)}

    first = Progress(tmp_path / "metrics.jsonl", 10, 1, 0, enabled=True, spec=spec)
    second = Progress(None, 10, 1, 1e9, enabled=False, spec=spec)
    first.on_segments(batch([1.0, 0.0, np.nan, 1.0], [False, False, False, True]))
    second.on_segments(batch([1.0, 1.0], [False, False]))
    assert first.rolling()["episode_grasped"] == 0.5  # 1, 0: NaN and the fault left out
    sent = []
    second.pool = lambda v: sent.append(v) or v
    second.on_update(1)
    first.pool = lambda v: v + sent[0]
    first.on_micro_batch({"loss": 1.0})
    first.on_update(1)
    assert first.rolling()["episode_grasped"] == 0.75  # 3 of the 4 known
    assert "| grasped 0.75 | staleness" in capsys.readouterr().out
    first.on_micro_batch({"loss": 1.0})
    first.close()
    records = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode_grasped"] for r in records] == [None, 0.75]  # nothing pooled before
    assert pooled([first.metrics.windows(), second.metrics.windows()]) == {
        "episode_grasped": 0.75}
    assert pooled([]) == {}


def test_a_moved_run_directory_keeps_its_wandb_run(tmp_path):
    """The W&B id is made once, from the run directory's name and path, and kept in it: a
    run moved elsewhere (scratch to project storage) and resumed there goes on in the same
    W&B run; another directory of the same name elsewhere gets its own. Real W&B, offline."""
    from hpcvla.metrics.tensorboard import WANDB_ID, wandb_id, wandb_run
    first = tmp_path / "scratch" / "demo-1"
    first.mkdir(parents=True)
    run = wandb_run(first, "demo", "offline", {"a": 1})
    made = run.id
    run.finish()
    assert (first / WANDB_ID).read_text() == f"{made} {first}\n" and made.startswith("demo-1-")
    moved = tmp_path / "project" / "demo-1"
    moved.parent.mkdir()
    first.rename(moved)
    run = wandb_run(moved, "demo", "offline", None)
    assert run.id == made and (moved / WANDB_ID).read_text() == f"{made} {moved}\n"
    run.finish()
    other = tmp_path / "other" / "demo-1"
    other.mkdir(parents=True)
    assert wandb_id(other) != made
    # a copy (`cp -r`, the original still there) is another run: its own id, from then on
    import shutil
    copy = tmp_path / "copies" / "demo-1"
    shutil.copytree(moved, copy)
    copied = wandb_id(copy)
    assert copied != made and wandb_id(copy) == copied and wandb_id(moved) == made
    # a symlink to the run (runs/latest): the run's own name, not the link's
    link = tmp_path / "latest"
    link.symlink_to(moved)
    assert wandb_id(link) == made
