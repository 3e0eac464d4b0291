"""The OpenVLA-OFT reference fixture (tests/fixtures/oft/checkpoint) on LIBERO with
configs/libero_oft.yaml (RLinf's LIBERO setup: one camera, no proprio, 8-step chunks,
token-level log-probs at temperature 1.6): the first action for the env's observation is
RLinf's; and with OFT's own recipe (its L1 action head), `hpcvla train` starts from the
checkpoint (the actions recorded at version 0 have its log-probs), trains, and `hpcvla eval`
runs the trained policy."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpcvla.config import load_config
from hpcvla.envs import env_spec
from hpcvla.factory import build_policy
from helpers import hpcvla, libero_fixture_observation, run_train


FIXTURES = Path(__file__).parent / "fixtures"


def test_libero_first_action_is_rlinfs():
    """For LIBERO's observation (libero_spatial task 0, fixed state 0, as the env renders it:
    tests/fixtures/pi0/export_libero_obs.py) the deterministic chunk, unnormalized, is RLinf's
    greedy one for the same observation, through configs/libero_oft.yaml's policy."""
    cfg = load_config("configs/libero_oft.yaml", ["policy.dtype=float32"])
    obs, exported = libero_fixture_observation(cfg)
    assert sorted(obs) == ["image", "instruction"]  # RLinf's inputs: one camera and the task
    assert (obs["image"] != exported["image"]).mean() < 0.02  # OpenGL drivers: a few pixels
    policy = build_policy(cfg, env_spec(cfg.env))
    actions = policy.act({"image": torch.from_numpy(exported["image"]),
                          "instruction": torch.from_numpy(obs["instruction"])},
                         deterministic=True).actions
    expected = load_file(str(FIXTURES / "oft" / "io.safetensors"))["rlinf_libero.greedy.actions"]
    torch.testing.assert_close(actions.double(), expected[:, :cfg.env.chunk_len], rtol=0, atol=1e-5)


@pytest.mark.mpi
@pytest.mark.slow
def test_libero_training_starts_from_the_oft_checkpoint(tmp_path):
    """`hpcvla train` on LIBERO from the OFT fixture folder with OFT's own LIBERO recipe: its
    L1 action head (tests/test_oft_l1_head.py), both cameras, the proprio token, OFT's
    sequence; RL samples a Gaussian around the head. The first action is the checkpoint's.
    ~60 s: LIBERO's suites built in every simulator's env processes. (RLinf's recipe, the
    token head: its first action is RLinf's above; the token family trains through the
    pipeline in tests/test_vla_policies.py and on ManiSkill in tests/test_sims.py.)"""
    import h5py

    folder = tmp_path / "checkpoint"
    shutil.copytree(FIXTURES / "oft" / "checkpoint", folder)
    shutil.copy(FIXTURES / "oft" / "action_head--100_checkpoint.pt", folder)
    extra = [f"policy.pretrained={folder}", "env.wrist_image=true", "env.state=true",
             "env.state_format=axis_angle", "policy.sequence=official"]
    out, summary, run_dir = run_train(
        tmp_path / "runs", "pipeline.total_updates=2", "env.max_episode_chunks=2",
        "rollout.segment_len=2", "run.dump_trajectories=true", "pipeline.max_staleness=0",
        "pipeline.mode=sync-disaggregated", *extra, config="configs/libero_oft.yaml")
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
    assert policy.head == "l1"
    assert actions.shape == (1, 8, 7) and "state" in obs
    with torch.no_grad():
        logprob = float(policy.evaluate(obs, actions)[0].sum())
    assert abs(logprob - recorded) < 1e-3 * max(1.0, abs(recorded)), (logprob, recorded)
    from hpcvla.evaluate import checkpoint_weights
    from hpcvla.policies.folders import rl_only_names
    # it trains: tensors beyond the RL heads moved, and only trainable ones
    start, trained = policy.state_dict(), checkpoint_weights(run_dir)[0]
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    moved = {k for k in trained if not torch.equal(trained[k], start[k])}
    assert moved - set(rl_only_names(policy)) and moved <= trainable, sorted(moved)[:5]
    out = hpcvla("eval", run_dir, "--json", "--episodes", "2", "--envs", "2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["episodes"] == 2
