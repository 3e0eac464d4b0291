"""Held-out evaluation during training (eval.every): on a rank set aside while the streamer
trains, and between versions in sync-colocated, into metrics.jsonl, TensorBoard (with a
video) and the progress line; the last version's figure is `hpcvla eval`'s of the last
checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, hpcvla, progress_version, run_train

EVERY, VIDEO_EVERY, VERSIONS, EPISODES, ENVS = 3, 6, 7, 16, 4
# where the held-out states are evaluated: a rank set aside (the streamer), or every rank
# between versions (colocated)
LAYOUTS = [(5, ("placement.per_node={simulator: 2, inference: 1, learner: 2}",
                "placement.evaluators=1")),
           (2, ("placement.mode=colocated", "pipeline.mode=sync-colocated"))]


@pytest.mark.mpi
@pytest.mark.slow  # a training run and `hpcvla eval` after it, ~15 s each case
@pytest.mark.parametrize("ranks,layout", LAYOUTS, ids=["evaluator-rank", "colocated"])
def test_training_evaluates_the_held_out_states_every_few_versions(tmp_path, ranks, layout):
    from hpcvla.metrics.tensorboard import read_scalars
    from hpcvla.metrics.video import read_video
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, summary, run_dir = run_train(
        tmp_path, *layout, f"eval.every={EVERY}", f"eval.video_every={VIDEO_EVERY}",
        f"eval.episodes={EPISODES}", f"eval.envs={ENVS}", f"pipeline.total_updates={VERSIONS}",
        "run.tensorboard=true", ranks=ranks)
    records = [json.loads(line)["held_out"] for line in
               (run_dir / "metrics.jsonl").read_text().splitlines() if '"held_out"' in line]
    versions = [r["version"] for r in records]
    if ranks == 2:  # between versions: exactly the multiples and the last
        assert versions == [0, 3, 6, 7]
    else:  # the evaluator takes the newest version when it is free: the start and the end
        assert versions[0] == 0 and versions[-1] == VERSIONS and versions == sorted(set(versions))
        (evaluator,) = [r for r in summary["per_rank"] if r["role"] == "evaluator"]
        assert evaluator["held_out_versions"] == versions and evaluator["busy_s"]["evaluate"] > 0
    assert all(r["episodes"] == EPISODES and r["actions"] == "deterministic" for r in records)
    steps = [r["trained_env_steps"] for r in records]
    (root,) = [r for r in summary["per_rank"] if "trained_env_steps" in r]
    assert steps[0] == 0 and steps == sorted(steps) and steps[-1] == root["trained_env_steps"]
    assert "held-out evaluation of version 7" in out.stdout

    # the evaluation of the last version is `hpcvla eval`'s of the checkpoint it ended with
    ev = hpcvla("eval", run_dir, "--deterministic", "--episodes", EPISODES, "--envs", ENVS,
                "--json")
    assert ev.returncode == 0, ev.stderr[-2000:]
    final = json.loads(ev.stdout.strip().splitlines()[-1])
    assert final["version"] == VERSIONS
    assert final["success_rate"] == records[-1]["success_rate"]
    assert final["mean_return"] == pytest.approx(records[-1]["mean_return"], rel=1e-4)

    # TensorBoard: the held-out curve at the versions' trained env steps, the videos beside it
    curve = read_scalars(run_dir)["heldout/success_rate"]
    assert [(s, round(v, 6)) for s, v in curve] == \
        [(s, round(r["success_rate"], 6)) for s, r in zip(steps, records)]
    board = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    board.Reload()
    gifs = board.Images("heldout/video")
    filmed = sorted(run_dir.glob("videos/v*-heldout/*.mp4"))
    if ranks == 2:  # the first evaluation and version 6
        assert [e.step for e in gifs] == [0, steps[versions.index(6)]]
    assert len(gifs) == len(filmed) >= 1
    assert all(e.encoded_image_string[:6] == b"GIF89a" for e in gifs)
    assert filmed[0].parent.name == "v000000-heldout"
    frames = read_video(filmed[0])
    assert frames.shape[0] >= 2 and (frames.shape[2], frames.shape[1]) == (gifs[0].width,
                                                                          gifs[0].height)


@pytest.mark.mpi
@pytest.mark.slow  # one training run, stopped in its second version's evaluation (~10-20 s)
@pytest.mark.parametrize("ranks,layout", LAYOUTS, ids=["evaluator-rank", "colocated"])
def test_a_stop_signal_ends_the_evaluation_in_progress_not_after_it(tmp_path, ranks, layout):
    """A stop signal while the held-out states are evaluated (1,000 episodes, one at a time on
    each evaluating rank, 5 ms a step: ~10 s here; colocated 500, whose version 0's is whole
    before version 1 trains) ends that evaluation at its next batch (colocated: every rank at
    the same round): the world exits within seconds of the signal (the job scripts' lead time
    is for the checkpoint), not after the evaluation; no report of the cut evaluation is
    logged."""
    episodes = 500 if "placement.mode=colocated" in layout else 1000
    cmd = [sys.executable, "-m", "hpcvla", "train", "configs/default.yaml", "--ranks",
           str(ranks), f"run.root={tmp_path}", *layout, "eval.every=1",
           f"eval.episodes={episodes}",
           "eval.envs=1", "env.latency_median_ms=5", "pipeline.total_updates=1000",
           "pipeline.progress_every_s=0.2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        head = []
        for line in proc.stdout:
            head.append(line)
            if (progress_version(line) or 0) >= 1:  # colocated: version 1's evaluation next
                time.sleep(1.0)  # into it
                proc.send_signal(signal.SIGTERM)
                break
        out = "".join(head) + proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = summary["phases_s"]
    assert summary["preempted"] and steps["finished"] - steps["stop_signal"] < 5, steps
    logged = [json.loads(line)["held_out"] for line in
              (run_dir / "metrics.jsonl").read_text().splitlines() if '"held_out"' in line]
    assert all(r["episodes"] == episodes for r in logged)  # whole evaluations only
    evaluators = [r for r in summary["per_rank"] if r["role"] == "evaluator"]
    if evaluators:  # the cut one neither sent nor logged
        assert [r["version"] for r in logged] == evaluators[0]["held_out_versions"]
    else:  # the start's evaluation whole, version 1's (~10 s) cut a second into it
        assert [r["version"] for r in logged] == [0], logged

