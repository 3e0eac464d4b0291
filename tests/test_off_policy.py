"""The off-policy learner (algorithm.name=sac, roles/off_policy.py) in real MPI worlds,
colocated and disaggregated (the ring as its replay stream): it trains, checkpoints its replay
position and resumes from it; what it cannot run, or a buffer that cannot fit, is refused
before any rank starts. The losses are tested on tensors in tests/test_sac.py."""

import json
import shutil

import pytest
import torch

from hpcvla.algorithms.transitions import demonstration_transitions
from hpcvla.config import load_config
from hpcvla.config.loader import ConfigError
from hpcvla.demonstrations import read_demonstrations
from hpcvla.envs import env_spec
from hpcvla.evaluate import checkpoint_weights
from hpcvla.factory import build_policy
from helpers import ROOT, hpcvla, run_train

# small and quick: 32 px images, 16-transition batches, a gradient step every 8 transitions;
# a version brings a rank 256 transitions (fewer kept): training starts at its second
SMALL = ["env.image_size=32", "policy.hidden=32", "algorithm.batch_size=16",
         "algorithm.utd=0.125", "algorithm.learning_starts=300", "algorithm.replay_capacity=300"]

LN = "algorithm.critic_layer_norm=true"  # RLPD's critics: an RLPD run can start from its weights


@pytest.mark.mpi
@pytest.mark.slow
def test_sac_trains_checkpoints_its_replay_position_and_resumes(tmp_path):
    """2 colocated ranks, 3 versions then 2 more after a resume: every transition a rank
    collected enters its buffer once (the position counts them across the resume, the
    capacity bounds what is held), gradient steps start once the buffer holds
    learning_starts, the critics' statistics reach metrics.jsonl (and a record of every
    micro-batch before them: the acting policy's success while the buffers fill). Then RLPD
    with the first run's trajectory dump as its prior data, from the first run's weights:
    its temperature the config's, only its critics trained in the warm-up. ~40-50 s: three
    worlds."""
    _, first, run_dir = run_train(tmp_path / "sac", "pipeline.total_updates=3", *SMALL, LN,
                                  "run.dump_trajectories=true",
                                  config="configs/colocated_sac.yaml", ranks=2)
    learner = load_config(run_dir / "config.yaml").learner  # a rank's transitions per version:
    per_version = learner.micro_batch * learner.micro_batches * 8  # env segments x 8 steps
    ranks = first["per_rank"]
    for r in ranks:  # the horizon cuts are dropped (their next observation is a reset one)
        assert r["replay_added"] + r["transitions_dropped"] == 3 * per_version, r
        assert r["replay_size"] == min(r["replay_added"], 300)
        assert r["gradient_steps"] == 2 * per_version // 8  # versions 2 and 3: 300 held
    assert _replay_transitions(run_dir) == sum(r["replay_added"] for r in ranks)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().split("\n")
               if line]
    assert {"critic_loss", "actor_loss", "alpha", "q_mean", "action_rms"} <= set(records[-1])
    # while the buffers fill (version 1) each micro-batch still has its record, unscored
    assert records[0]["gradient_steps"] == 0 and "critic_loss" not in records[0]
    assert 0 < records[-1]["action_rms"] < 1  # tanh-squashed actions
    out = hpcvla("train", "configs/colocated_sac.yaml", "--ranks", 2, f"run.resume={run_dir}",
                 "pipeline.total_updates=5", *SMALL, LN, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    second = json.loads((run_dir / "summary.json").read_text())
    for r in second["per_rank"]:
        assert r["first_version"] == 3
        assert r["replay_added"] + r["transitions_dropped"] == 2 * per_version, r
        assert r["replay_size"] == min(r["replay_added"], 300)  # refilled from empty
        assert r["gradient_steps"] == per_version // 8  # version 5 only: 300 held again
    assert _replay_transitions(run_dir) == sum(r["replay_added"] for r in ranks) + \
        sum(r["replay_added"] for r in second["per_rank"])  # the count continued, once each
    # RLPD from the run's own trajectory dump as prior data (half of every batch), started
    # from its weights with a new temperature, its critics warming up the whole run
    dump = sorted((run_dir / "trajectories").glob("rank*.h5"))[0]
    _, rlpd, rlpd_dir = run_train(tmp_path / "rlpd", "pipeline.total_updates=2", *SMALL,
                                  "algorithm.name=rlpd", f"algorithm.demos={dump}",
                                  f"policy.checkpoint={run_dir}", "algorithm.critic_warmup=1000",
                                  "algorithm.init_temperature=0.05",
                                  config="configs/colocated_sac.yaml", ranks=2)
    for r in rlpd["per_rank"]:
        assert 0 < r["prior_transitions"] < 3 * per_version and r["gradient_steps"] > 0, r
    # the 2 learners of the host read a share each into its one copy: both sample all of it
    spec = env_spec(load_config(run_dir / "config.yaml").env)
    demos = read_demonstrations(dump, spec, outcomes=True)
    whole, _ = demonstration_transitions(demos.obs, demos.actions, demos.outcomes, demos.episode)
    assert [r["prior_transitions"] for r in rlpd["per_rank"]] == [len(whole["reward"])] * 2
    start, end = checkpoint_weights(run_dir)[0], checkpoint_weights(rlpd_dir)[0]
    moved = {name for name in start if not torch.equal(start[name], end[name])}
    assert moved - {"sac_log_alpha"} and all(  # the critics alone trained
        name.startswith("value_q") for name in moved - {"sac_log_alpha"}), moved
    assert float(end["sac_log_alpha"].exp()) == pytest.approx(0.05)  # not the checkpoint's
    # and the warm-up spent none of the actor's optimizer state (Adam's step count)
    newest = sorted((rlpd_dir / "checkpoints").glob("v*"))[-1]
    saved = json.loads((newest / "state.json").read_text())["optimizer"]
    for entry in saved:
        steps = entry["steps"]
        actor = {n: s for n, s in steps.items() if not n.startswith("value_")}
        assert actor and actor == dict.fromkeys(actor, 0.0), steps
        assert all(s > 0 for n, s in steps.items() if n.startswith("value_q.")), steps


@pytest.mark.mpi
@pytest.mark.slow
def test_sac_trains_from_the_ring_in_the_streamer_and_resumes_as_rlpd(tmp_path):
    """The default job's 4 ranks (inference, 2 simulators, learner) under SAC: the inference
    rank sends each segment group with the observation after it, the learner adds every
    transition it takes from the ring to its buffer once (the groups' ledger: none missing,
    none twice) and trains on each micro-batch as it arrives; its buffer position is
    checkpointed and a resume continues it, here as RLPD with the first start's dump as prior
    data (read by the learner before its transport starts: roles/prologue.py). ~30 s: two
    worlds."""
    sac = [*SMALL, "algorithm.name=sac", "algorithm.learning_starts=16",
           "algorithm.critic_layer_norm=true"]  # RLPD's critics: its resume takes them
    _, first, run_dir = run_train(tmp_path / "runs", "pipeline.total_updates=2", *sac,
                                  "run.dump_trajectories=true")
    prior = tmp_path / "prior"  # a copy: the resumed start appends to the run's own dump
    shutil.copytree(run_dir / "trajectories", prior)
    cfg = load_config(run_dir / "config.yaml")
    per_micro = cfg.learner.micro_batch * cfg.rollout.segment_len  # transitions
    (learner,) = [r for r in first["per_rank"] if r["role"] == "learner"]
    assert learner["replay_added"] + learner["transitions_dropped"] == \
        learner["trained_env_steps"] // cfg.env.chunk_len == 2 * 2 * per_micro, learner
    assert all(g["missing"] == 0 for g in learner["trained_groups"].values())
    assert learner["gradient_steps"] == 2 * 2 * per_micro // 8  # every micro-batch: 16 held
    assert _replay_transitions(run_dir) == learner["replay_added"]
    out = hpcvla("train", "configs/default.yaml", "--ranks", 4, f"run.resume={run_dir}",
                 "pipeline.total_updates=3", *sac, "algorithm.name=rlpd",
                 f"algorithm.demos={next(prior.glob('*.h5'))}", timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (resumed,) = [r for r in json.loads((run_dir / "summary.json").read_text())["per_rank"]
                  if r["role"] == "learner"]
    assert resumed["first_version"] == 2 and resumed["gradient_steps"] == 2 * per_micro // 8
    assert resumed["prior_transitions"] > 0, resumed
    assert _replay_transitions(run_dir) == learner["replay_added"] + resumed["replay_added"]


@pytest.mark.mpi
@pytest.mark.slow
def test_dsrl_steers_a_frozen_flow_policy_and_only_its_actor_crosses_the_network(tmp_path):
    """SAC on the flow family (DSRL) in the streamer, the flow policy in bf16 as on GPUs: the
    inference rank records the noise its actor chose with every step, the learner trains on
    it, and after the first version the weight plane sends the trainable parameters alone (the
    noise actor, its critics, the temperature: float32), not the frozen flow policy; with
    DSRL's recipe's settings: the actor reads the state alone, the entropy target is 0. ~20 s:
    one world."""
    args = ["algorithm.name=sac", "env.image_size=32", "algorithm.batch_size=16",
            "algorithm.utd=0.125", "algorithm.learning_starts=16", "policy.dtype=bfloat16",
            "algorithm.noise_obs=state", "algorithm.target_entropy=0"]
    _, summary, run_dir = run_train(tmp_path, "pipeline.total_updates=2", *args,
                                    config="configs/reach_flow.yaml")
    (learner,) = [r for r in summary["per_rank"] if r["role"] == "learner"]
    assert learner["gradient_steps"] > 0 and learner["replay_added"] > 0, learner
    assert learner["target_entropy"] == 0.0
    ran = load_config(run_dir / "config.yaml", record=True)  # a re-pointed recipe's record
    policy = build_policy(ran, env_spec(ran.env))
    assert policy.noise_encoder.has_state and not policy.noise_encoder.has_image
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert learner["weight_bytes"]["per_version"] == 4 * trainable
    assert learner["weight_bytes"]["first_version"] > learner["weight_bytes"]["per_version"]


DSRL_ENGINE = """
import json
import numpy as np, torch
from mpi4py import MPI
from hpcvla.algorithms.off_policy import soft_actor_critic_loss, update_targets
from hpcvla.algorithms.transitions import transition_specs
from hpcvla.config import load_config
from hpcvla.engines.zero import deepspeed_engine
from hpcvla.envs import env_spec
from hpcvla.factory import build_policy
cfg = load_config("configs/reach_flow.yaml", ["algorithm.name=sac", "policy.dtype=bfloat16",
                  "algorithm.noise_obs=state", "learner.micro_batches=1", "env.image_size=32"])
spec = env_spec(cfg.env)
engine = deepspeed_engine(cfg, build_policy(cfg, spec, "cpu"), MPI.COMM_SELF)
policy, rng = engine.module, np.random.default_rng(0)
start = [p.detach().clone() for p in policy.value_q_target.parameters()]
for _ in range(10):
    batch = {k: torch.as_tensor(rng.integers(0, 2, (16, *shape)).astype(dtype))
             for k, (shape, dtype) in transition_specs(spec.obs, spec.chunk_len,
                                                       spec.action_dim).items()}
    loss, _ = soft_actor_critic_loss(cfg.algorithm, policy, batch, -1.0)
    engine.backward(loss)
    engine.step()
    update_targets(policy, cfg.algorithm.tau)
dtypes = {(str(p.dtype), p.requires_grad) for p in policy.parameters()}
moved = np.mean([(p != s).float().mean().item()
                 for p, s in zip(policy.value_q_target.parameters(), start)])
print(json.dumps([engine.bfloat16_enabled(), sorted(dtypes), float(moved)]), flush=True)
torch.distributed.destroy_process_group()  # gloo's threads end before the process does
"""


@pytest.mark.slow  # a DeepSpeed engine in a fresh process: ~5 s
def test_dsrl_under_deepspeed_keeps_its_sac_heads_in_float32_beside_a_bf16_flow_policy():
    """DeepSpeed's bf16 section casts every parameter of the module, frozen ones included:
    DSRL's float32 heads would train in bf16, and most of a target critic's Polyak steps
    (tau 0.005) round away. The engine's bf16 section follows the trained parameters: off
    here, the frozen flow policy stays bf16, the heads float32, and a target critic follows
    its online critic (in bf16 ten steps moved 3 % of its entries, here > 90 %)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", DSRL_ENGINE], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    bf16, dtypes, moved = json.loads(out.stdout.splitlines()[-1])
    assert not bf16 and dtypes == [["torch.bfloat16", False], ["torch.float32", False],
                                   ["torch.float32", True]], out.stdout[-2000:]
    assert moved > 0.9, out.stdout[-2000:]  # in bf16, 0.03: most steps rounded away


def _replay_transitions(run_dir):
    """The newest checkpoint's count of transitions that entered the buffers."""
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    return json.loads((newest / "state.json").read_text())["counters"]["replay_transitions"]


def test_what_sac_cannot_run_is_refused_before_launch(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/colocated_sac.yaml",
                    ["policy.name=tokens", "algorithm.utd=0", "learner.zero_stage=3",
                     "algorithm.learning_starts=500", "algorithm.replay_capacity=400"])
    for field in ("policy.name = 'tokens'", "algorithm.utd = 0.0", "learner.zero_stage = 3",
                  "algorithm.learning_starts = 500"):
        assert field in str(err.value), (field, str(err.value))
    for overrides in (["algorithm.name=rlpd"], ["algorithm.demos=x.h5"],
                      ["algorithm.name=ppo", "algorithm.demos=x.h5"]):
        with pytest.raises(ConfigError, match="algorithm.demos"):
            load_config(ROOT / "configs/colocated_sac.yaml", overrides)


@pytest.mark.mpi
def test_prior_data_without_rewards_is_refused_before_any_rank_starts(tmp_path):
    """RLPD's demonstrations must record each chunk's reward and episode end: ManiSkill's
    and LIBERO's files (read for `hpcvla sft`) are refused by name, before launch."""
    demo = ROOT / "tests/fixtures/demonstrations/maniskill/pushcube.state.pd_ee_delta_pose.h5"
    out = hpcvla("train", "configs/maniskill_pushcube.yaml", "--ranks", 2,
                 f"run.root={tmp_path}", "algorithm.name=rlpd", f"algorithm.demos={demo}",
                 "placement.mode=colocated", "pipeline.mode=sync-colocated",
                 "env.camera=false")  # (no camera rendered to learn the spec: a layout check)
    assert out.returncode != 0
    assert "algorithm.demos" in out.stderr and "read for `hpcvla sft` only" in out.stderr, \
        out.stderr[-2000:]
    assert not list(tmp_path.iterdir())


@pytest.mark.mpi
def test_a_replay_buffer_larger_than_the_host_is_refused_before_any_rank_starts(tmp_path):
    out = hpcvla("train", "configs/colocated_sac.yaml", "--ranks", 2, f"run.root={tmp_path}",
                 "algorithm.replay_capacity=1000000000")
    assert out.returncode != 0
    assert "algorithm.replay_capacity = 1000000000" in out.stderr and \
        "KiB per transition of its capacity" in out.stderr, out.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # no run folder: nothing started
