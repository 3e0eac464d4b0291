"""Learning smoke tests: each policy family and algorithm, trained briefly by the real
pipeline (streamer, 4 ranks, DeepSpeed), beats its own untrained policy on the same 128
initial states of `reach`. No timing asserts; the budgets are in env steps (updates x 32
segments x segment_len chunks x 4 steps)."""

import json

import pytest

from hpcvla.config import load_config
from hpcvla.evaluate import checkpoint_weights, evaluate
from hpcvla.metrics.tensorboard import read_scalars
from test_mpi_world import hpcvla
from test_pipeline import run_train

def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


MARGIN = 0.25  # measured gaps: PPO 0.66 at 60 updates, GRPO 0.81; flow's take-off varies with
# the seed and the async timing (80 updates: 0.61, 0.83, 0.04, 0.76 over seeds 1-4 and 0.01 in one
# CI run; 120: 0.77, 0.82, 0.74 over seeds 3, 0, 7); tokens learns later and less evenly (0.26 at
# 60 and 0.23 at 120 updates in one CI run, 0.97 at 160)


@pytest.mark.parametrize("config,updates", [
    ("configs/default.yaml", 40),      # CNN actor-critic, PPO
    ("configs/reach_grpo.yaml", 50),   # CNN, GRPO (critic-free, grouped restarts)
    ("configs/reach_flow.yaml", 120),  # π0-style flow-matching expert, PPO
    ("configs/reach_tokens.yaml", 200),  # OpenVLA-OFT-style parallel action tokens, PPO
])
def test_training_beats_the_untrained_policy(tmp_path, config, updates):
    every = ["learner.checkpoint_every=20", "learner.checkpoint_keep=5"] \
        if config == "configs/default.yaml" else []  # for `eval --all` below
    _, summary, run_dir = run_train(tmp_path, f"pipeline.total_updates={updates}", *every,
                                    config=config)
    cfg = load_config(run_dir / "config.yaml")
    weights, state = checkpoint_weights(run_dir)
    assert state["version"] == updates
    untrained = evaluate(cfg, None)
    trained = evaluate(cfg, weights)
    assert trained["episodes"] == untrained["episodes"] == 128
    assert trained["success_rate"] >= untrained["success_rate"] + MARGIN, (untrained, trained)
    assert trained["mean_return"] > untrained["mean_return"]
    if config == "configs/default.yaml":  # the CLI says the same (evaluation is seeded)
        out = hpcvla("eval", run_dir, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["success_rate"] == trained["success_rate"]
        out = hpcvla("eval", tmp_path)
        assert out.returncode == 2 and "not a run directory" in out.stderr
        # the learning curve over every kept checkpoint, from the untrained policy on
        out = hpcvla("eval", run_dir, "--all", "--untrained", "--json")
        assert out.returncode == 0, out.stderr
        curve = [json.loads(line) for line in out.stdout.splitlines()]
        assert [c["version"] for c in curve] == [0, 20, 40]
        assert [c["trained_env_steps"] for c in curve] == [0, 20 * 1024, 40 * 1024]
        assert _jsonl(run_dir / "eval.jsonl") == curve  # kept with the run, for reports
        assert curve[0]["success_rate"] == untrained["success_rate"]
        assert curve[-1]["success_rate"] == trained["success_rate"]
        # TensorBoard's own reader sees the run: live training scalars, busy fractions, eval
        board = read_scalars(run_dir)
        for tag in ("train/pg_loss", "train/approx_kl", "train/clip_fraction",
                    "train/explained_variance", "rollout/success_rate", "rollout/mean_return",
                    "perf/trained_env_steps_per_s", "perf/staleness"):
            assert board.get(tag), (tag, sorted(board))
        assert board["train/pg_loss"][-1][0] == 40 * 1024  # x axis: trained env steps
        assert any(tag.startswith("busy/simulator/") for tag in board), sorted(board)
        assert [(s, round(v, 6)) for s, v in board["eval/success_rate"]] == \
            [(c["trained_env_steps"], round(c["success_rate"], 6)) for c in curve]
