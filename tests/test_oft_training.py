"""`hpcvla train` from the OpenVLA-OFT reference fixture (tests/fixtures/oft/checkpoint) on
LIBERO with configs/libero_oft.yaml (RLinf's LIBERO setup: one camera, no proprio, 8-step
chunks, token-level log-probs at temperature 1.6): the actions recorded at version 0 are the
pretrained policy's (their log-probs are its log-probs), it trains, and `hpcvla eval` runs the
trained policy."""

import json

import torch

from hpcvla.config import load_config
from hpcvla.envs import env_spec
from hpcvla.roles.pipeline import build_policy
from test_mpi_world import hpcvla
from test_pipeline import run_train


def test_libero_training_starts_from_the_oft_checkpoint(tmp_path):
    import h5py

    out, summary, run_dir = run_train(
        tmp_path, "pipeline.total_updates=2", "env.max_episode_chunks=2",
        "rollout.segment_len=2", "run.dump_trajectories=true", "pipeline.max_staleness=0",
        "pipeline.mode=sync-disaggregated", config="configs/libero_oft.yaml")
    assert "[hpcvla] update 2/2" in out.stdout and summary["lost_records"] == 0
    cfg = load_config(run_dir / "config.yaml")
    policy = build_policy(cfg, env_spec(cfg.env)).eval()
    assert policy.family == "oft" and policy.processor is not None
    with h5py.File(sorted((run_dir / "trajectories").glob("rank*.h5"))[0]) as f:
        demo = f["data"][sorted(f["data"])[0]]
        assert demo.attrs["policy_version"] == 0
        obs = {k: torch.from_numpy(demo["obs"][k][:1]) for k in demo["obs"]}
        actions = torch.from_numpy(demo["actions"][:1])
        recorded = float(demo["logprobs"][0])
    assert actions.shape == (1, 8, 7) and "state" not in obs  # RLinf's LIBERO OFT inputs
    with torch.no_grad():
        logprob = float(policy.evaluate(obs, actions)[0].sum())
    assert abs(logprob - recorded) < 1e-3 * max(1.0, abs(recorded)), (logprob, recorded)
    out = hpcvla("eval", run_dir, "--json", "--episodes", "2", "--envs", "2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["episodes"] == 2
