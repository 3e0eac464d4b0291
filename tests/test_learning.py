"""Learning smoke tests: each algorithm, trained briefly by the real pipeline (streamer, 4
ranks, DeepSpeed), beats its own untrained policy on the same 128 initial states of `reach`:
success rises by more than chance allows (z >= 3.5) and the mean return rises. No timing
asserts; the budgets are in env steps (updates x 32 segments x segment_len chunks x 4 steps).
The VLA heads' learning is a benchmark (`hpcvla bench learning --arms families`, 2-3 minutes
a run); the suite keeps PPO steps on a fixed batch of each (tests/test_vla_policies.py)."""

import json
from pathlib import Path

import pytest

from hpcvla.config import load_config
from hpcvla.evaluate import checkpoint_weights, evaluate
from hpcvla.metrics.tensorboard import read_scalars
from helpers import MIN_Z, hpcvla, improvement_z, run_train, wandb_offline_history


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_improvement_z_tells_learning_from_chance():
    assert improvement_z(0.0625, 0.28125, 128) > MIN_Z > improvement_z(0.0625, 0.2, 128)
    assert improvement_z(0.06, 0.07, 128) < 1 and improvement_z(0.5, 0.4, 128) < 0


# The budgets. The default (1 epoch, 32 px): rolling success 0.65-0.73 at 100 updates over
# seeds 0-3. GRPO (8 epochs) at 32 px: held-out success 0.04 untrained, 0.64 / 0.73 / 0.62 /
# 0.67 after 30 updates over seeds 0-3 (z 9.9-11.4).
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.parametrize("config,updates,extra", [
    ("configs/default.yaml", 100, []),     # CNN actor-critic, PPO
    ("configs/reach_grpo.yaml", 30, ["env.image_size=32"]),  # CNN, GRPO (critic-free,
                                                               # grouped restarts)
], ids=["default", "grpo"])
def test_training_beats_the_untrained_policy(tmp_path, config, updates, extra):
    """30-45 s each: the smallest budget at which each algorithm learns on every seed
    measured (the comment above), plus two evaluations of 128 episodes."""
    every = ["learner.checkpoint_every=50", "learner.checkpoint_keep=5", "run.wandb=offline"] \
        if config == "configs/default.yaml" else []  # for `eval --all` and W&B below
    _, summary, run_dir = run_train(tmp_path, f"pipeline.total_updates={updates}", *every,
                                    *extra, config=config)
    cfg = load_config(run_dir / "config.yaml")
    weights, state = checkpoint_weights(run_dir)
    assert state["version"] == updates
    untrained = evaluate(cfg, None)
    trained = evaluate(cfg, weights)
    assert trained["episodes"] == untrained["episodes"] == 128
    z = improvement_z(untrained["success_rate"], trained["success_rate"], 128)
    assert z >= MIN_Z, (z, untrained, trained)
    assert trained["mean_return"] > untrained["mean_return"]
    if config == "configs/default.yaml":  # the CLI says the same (evaluation is seeded: the
        # newest checkpoint's sampled success is `--all`'s last below)
        out = hpcvla("eval", run_dir, "--json", "--deterministic")  # the Gaussian's mean
        assert out.returncode == 0, out.stderr
        greedy = json.loads(out.stdout)
        assert greedy["actions"] == "deterministic" and trained["actions"] == "sampled"
        assert greedy["success_rate"] == \
            evaluate(cfg, weights, deterministic=True)["success_rate"]
        out = hpcvla("eval", tmp_path)
        assert out.returncode == 2 and "not a run directory" in out.stderr
        # the learning curve over every kept checkpoint, from the untrained policy on
        out = hpcvla("eval", run_dir, "--all", "--untrained", "--json")
        assert out.returncode == 0, out.stderr
        curve = [json.loads(line) for line in out.stdout.splitlines()]
        assert [c["version"] for c in curve] == [0, 50, 100]
        assert [c["trained_env_steps"] for c in curve] == [0, 50 * 1024, 100 * 1024]
        kept = _jsonl(run_dir / "eval.jsonl")  # kept with the run, for reports, and with
        assert [{k: v for k, v in r.items() if k != "software"} for r in kept] == curve
        assert {r["software"]["hpcvla"]["source"] for r in kept} == {  # what evaluated it
            str(Path(evaluate.__globals__["__file__"]).resolve().parent)}  # hpcvla/
        assert curve[0]["success_rate"] == untrained["success_rate"]
        assert curve[-1]["success_rate"] == trained["success_rate"]
        # TensorBoard's own reader sees the run: live training scalars, busy fractions, eval
        board = read_scalars(run_dir)
        for tag in ("train/pg_loss", "train/actor_lr", "train/grad_norm", "train/grad_clipped",
                    "train/explained_variance", "rollout/success_rate", "rollout/mean_return",
                    "rollout/mean_episode_chunks",
                    "perf/trained_env_steps_per_s", "perf/staleness", "perf/queued_segments",
                    "perf/ring_slots_used", "perf/ring_full_lanes"):
            assert board.get(tag), (tag, sorted(board))
        # one PPO pass a version: its ratios are 1, so no clip fraction or KL is reported
        assert "train/clip_fraction" not in board and "train/approx_kl" not in board
        assert all(v == pytest.approx(cfg.algorithm.lr) for _, v in board["train/actor_lr"])
        # episodes end at success or at the horizon: as the policy learns, sooner (from the
        # first full window of episodes on: the first to end are the short ones)
        lengths = [(r["episodes"], r["mean_episode_chunks"]) for r in _jsonl(
            run_dir / "metrics.jsonl") if r.get("mean_episode_chunks") is not None]
        assert all(1 <= v <= cfg.env.max_episode_chunks for _, v in lengths), lengths
        full = next(v for n, v in lengths if n == lengths[-1][0])
        assert lengths[-1][1] < full and summary["mean_episode_chunks"] == \
            pytest.approx(lengths[-1][1], rel=1e-5), (full, lengths[-1], summary)
        # the streamer's producers run ahead of the learner (max_staleness 1): versions train
        # segments an older version made. (Whether some of the next batch's also wait at a
        # version's end, perf/queued_segments > 0, is the machine's timing: a learner that
        # keeps up finds none.)
        assert max(v for _, v in board["perf/staleness"]) > 0
        # a point a version (its records' mean): the optimizer steps' norms before clipping,
        # and the share of them max_grad_norm clipped
        assert [s for s, _ in board["train/grad_norm"]] == [v * 1024 for v in
                                                             range(1, updates + 1)]
        assert all(0 <= v <= 1 for _, v in board["train/grad_clipped"])
        steps = [r for r in _jsonl(run_dir / "metrics.jsonl") if "grad_norm" in r]
        assert len(steps) == updates * cfg.learner.epochs  # a record per optimizer step has it
        assert [r["grad_clipped"] for r in steps] == \
            [float(r["grad_norm"] > cfg.algorithm.max_grad_norm) for r in steps]
        assert board["train/pg_loss"][-1][0] == 100 * 1024  # x axis: trained env steps
        assert any(tag.startswith("busy/simulator/") for tag in board), sorted(board)
        assert [(s, round(v, 6)) for s, v in board["eval/success_rate"]] == \
            [(c["trained_env_steps"], round(c["success_rate"], 6)) for c in curve]
        # W&B offline (run.wandb): the same series, against trained_env_steps, and the config
        rows, wandb_config = wandb_offline_history(run_dir)
        assert wandb_config["run"]["wandb"] == "offline" and \
            wandb_config["pipeline"]["total_updates"] == updates
        logged = {}
        for row in rows:
            for tag, value in row.items():
                if "/" in tag:
                    logged.setdefault(tag, []).append((row["trained_env_steps"], value))
        assert sorted(logged) == sorted(board)
        for tag, series in board.items():  # TensorBoard holds float32
            assert [s for s, _ in logged[tag]] == [s for s, _ in series], tag
            assert [v for _, v in logged[tag]] == pytest.approx([v for _, v in series],
                                                                rel=1e-6, abs=1e-7), tag
