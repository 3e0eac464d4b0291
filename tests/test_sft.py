"""Supervised fine-tuning (`hpcvla sft`): each family's imitation loss learns demonstrated
chunks, the sampler trains every chunk once per epoch and resumes exactly, and the saved
policy folder is what `policy.pretrained` loads."""

from __future__ import annotations

import json
import os
import re
import shutil
from unittest import mock
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcvla.checkpoint import catalog
from hpcvla.config import load_config
from hpcvla.factory import build_policy
from hpcvla.policies import Policy, make_policy, save_pretrained
from hpcvla.imitation.sft import batch_indices
from helpers import ROOT, hpcvla

VOCAB, ACTION_DIM, CHUNK = 12, 3, 4
MPI_SCRIPT = ROOT / "tests" / "mpi" / "sft_memory_plan.py"
SPEC = {"image": ((32, 32, 3), "|u1"), "instruction": ((5,), "<i4"), "state": ((7,), "<f4")}


def _demonstrations(batch=16, seed=0):
    """Observations and the chunk a deterministic demonstrator takes in each: a function of
    the state the policy can learn (so the loss has somewhere to go)."""
    rng = np.random.default_rng(seed)
    state = rng.standard_normal((batch, 7)).astype(np.float32)
    obs = {"image": rng.integers(0, 256, (batch, 32, 32, 3), dtype=np.uint8),
           "instruction": rng.integers(1, VOCAB, (batch, 5)).astype(np.int32), "state": state}
    actions = np.tanh(state[:, None, :ACTION_DIM] * np.arange(1, CHUNK + 1)[None, :, None] / 4)
    return Policy.obs_to_tensors(obs, "cpu"), torch.as_tensor(actions, dtype=torch.float32)


def _all_real(actions):
    return torch.ones(actions.shape[:2], dtype=torch.bool)


@pytest.mark.parametrize("family", ["default", "flow", "tokens"])
def test_imitation_loss_falls_on_demonstrations(family):
    torch.manual_seed(0)
    policy = make_policy(family, SPEC, ACTION_DIM, CHUNK, VOCAB)
    obs, actions = _demonstrations()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        torch.manual_seed(1)  # flow matching's noise and time: the same draws every step
        loss = policy(obs, actions, _all_real(actions))  # what the engine's forward calls
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.5 * abs(losses[0]), losses[::8]
    # the critic learns nothing from imitation
    assert all(p.grad is None or not p.grad.any()
               for n, p in policy.named_parameters() if n.startswith("value_"))


@pytest.mark.parametrize("family", ["default", "flow", "tokens"])
def test_padding_past_the_episode_end_is_no_part_of_the_loss(family):
    """A chunk that runs past its episode's end repeats a padding value: what is there must
    not move the loss. `flow`'s expert attends across the whole chunk both ways (as π0
    trains, LeRobot's action_is_pad masks only the loss), so there a chunk with no real step
    is what adds nothing; the others score each step apart from the later ones."""
    torch.manual_seed(0)
    policy = make_policy(family, SPEC, ACTION_DIM, CHUNK, VOCAB)
    obs, actions = _demonstrations(batch=6)
    real = _all_real(actions)
    real[0, 0 if family == "flow" else 2:] = False  # the first chunk's padding
    other = actions.clone()
    other[0, 0 if family == "flow" else 2:] = -0.9  # another padding value
    losses = []
    for acts in (actions, other):
        torch.manual_seed(1)  # flow matching's noise and time
        losses.append(policy.imitation_loss(obs, acts, real).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    torch.manual_seed(1)
    with_all = policy.imitation_loss(obs, other, _all_real(actions)).item()
    assert with_all != pytest.approx(losses[1], rel=1e-6)  # the mask is what left it out


def test_behaviour_cloning_moves_the_mean_to_the_demonstrations():
    torch.manual_seed(0)
    policy = make_policy("default", SPEC, ACTION_DIM, CHUNK, VOCAB)
    obs, actions = _demonstrations(batch=8)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    before = float((policy.act(obs, deterministic=True).actions - actions).abs().mean())
    for _ in range(200):
        loss = policy.imitation_loss(obs, actions, _all_real(actions))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = float((policy.act(obs, deterministic=True).actions - actions).abs().mean())
    assert after < 0.2 * before, (before, after)


def test_every_chunk_once_per_epoch_on_one_learner_and_resume_is_exact():
    samples, batch, learners = 23, 4, 3
    steps = 12  # 12 x 12 = 144 positions: six epochs and a part
    taken = np.stack([np.concatenate([batch_indices(samples, batch, s * batch * learners, r, 7)
                                      for r in range(learners)]) for s in range(steps)])
    flat = taken.reshape(-1)
    for epoch in range(flat.size // samples):
        assert sorted(flat[epoch * samples:(epoch + 1) * samples]) == list(range(samples))
    assert not np.array_equal(flat[:samples], flat[samples:2 * samples])  # reshuffled
    # one stream of positions however it is cut (batch size, learners, step): a run resumed
    # after any chunk, on any learner count, takes exactly what the first would have
    assert np.array_equal(batch_indices(samples, batch * learners * steps, 0, 0, 7), flat)
    assert np.array_equal(batch_indices(samples, 2, 116, 0, 7), taken[9, 8:10])  # 116, 117
    assert np.array_equal(batch_indices(samples, 2, 114, 1, 7), taken[9, 8:10])  # learner 1


@pytest.mark.parametrize("schedule, warmup, final_lr", [
    ("cosine", 0, 0.0), ("cosine", 10, 1e-5), ("constant", 0, 0.0), ("constant", 7, 0.0)])
def test_the_learning_rate_schedule_is_torchs_warm_up_then_cosine(schedule, warmup, final_lr):
    """lr_at against torch's own schedulers stepping an optimizer: LinearLR's warm-up from
    lr / (warmup + 1), then CosineAnnealingLR down to final_lr at the last step (or the
    peak held)."""
    from types import SimpleNamespace
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

    from hpcvla.imitation.sft import lr_at
    steps, lr = 60, 1e-3
    sft = SimpleNamespace(steps=steps, lr=lr, warmup_steps=warmup, schedule=schedule,
                          final_lr=final_lr)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    after = CosineAnnealingLR(optimizer, T_max=steps - 1 - warmup, eta_min=final_lr) \
        if schedule == "cosine" else ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warmup:
        ramp = LinearLR(optimizer, start_factor=1 / (warmup + 1), total_iters=warmup)
        torchs = SequentialLR(optimizer, [ramp, after], milestones=[warmup])
    else:
        torchs = after
    for step in range(steps):
        assert lr_at(sft, step) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-6,
                                                 abs=1e-12), step
        optimizer.step()
        torchs.step()
    assert lr_at(sft, steps - 1) == pytest.approx(final_lr if schedule == "cosine" else lr)


def test_a_saved_default_policy_loads_as_pretrained(tmp_path):
    cfg = load_config("configs/default.yaml")
    from hpcvla.envs import env_spec
    spec = env_spec(cfg.env)
    trained = build_policy(cfg, spec)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_pretrained(trained, tmp_path / "policy")
    cfg.policy.pretrained = str(tmp_path / "policy")
    loaded = build_policy(cfg, spec)
    for (name, a), b in zip(trained.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


LIBERO_DEMOS = "tests/fixtures/demonstrations/libero"  # LIBERO's create_dataset.py layout


def _sft(tmp_path, config, *overrides, steps=6):
    """`hpcvla sft` on one rank into tmp_path; its run directory and summary.json."""
    out = hpcvla("sft", config, f"sft.demos={LIBERO_DEMOS}", f"sft.steps={steps}",
                 "sft.batch_size=8", f"run.root={tmp_path}", *overrides, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    return run_dir, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("config, overrides", [
    ("configs/libero_spatial.yaml", ["policy.name=flow"]),  # π0-style: flow matching
    ("configs/libero_oft.yaml", []),  # a published OFT folder: its action tokens
], ids=["flow", "oft"])
def test_sft_on_a_libero_file_learns_and_its_checkpoint_loads(tmp_path, config, overrides):
    """It learns: the loss over the demonstrations themselves, with one seed's draws at every
    validation (flow matching's times and noises), falls from the first step to the last
    (a copy as sft.val_demos: the trained files themselves are refused as held out)."""
    same = shutil.copytree(ROOT / LIBERO_DEMOS, tmp_path / "same")
    run_dir, summary = _sft(tmp_path / "runs", config, *overrides, f"sft.val_demos={same}",
                            "sft.val_every=1")
    losses, validated = summary["losses"], summary["val_losses"]
    assert len(losses) == summary["steps"] == 6 and summary["demonstrations"] == 3
    assert [step for step, _ in validated] == [1, 2, 3, 4, 5, 6]
    assert validated[-1][1] < validated[0][1], validated
    # what every training rank builds with policy.checkpoint: the SFT weights, exactly
    cfg = load_config(config, [*overrides, f"policy.checkpoint={run_dir}"])
    from hpcvla import preflight
    from hpcvla.envs import env_spec
    from hpcvla.evaluate import checkpoint_weights
    preflight.check_config(cfg)
    policy = build_policy(cfg, env_spec(cfg.env))
    weights, state = checkpoint_weights(run_dir)
    assert state["version"] == 6
    for name, value in policy.state_dict().items():
        assert torch.equal(value, weights[name]), name
    if overrides:  # flow matching leaves the std: RL explores with its own init_log_std
        explore = build_policy(load_config(config, [*overrides, "policy.init_log_std=-1.5",
                                                    f"policy.checkpoint={run_dir}"]),
                               env_spec(cfg.env)).state_dict()
        assert float(weights["log_std"].max()) != -1.5
        assert torch.equal(explore.pop("log_std"), torch.full_like(weights["log_std"], -1.5))
        assert all(torch.equal(value, weights[name]) for name, value in explore.items())
    if overrides:  # DSRL from it: the flow weights exactly, its noise actor and critics fresh
        steered = build_policy(load_config(config, [*overrides, "algorithm.name=sac",
                                                    f"policy.checkpoint={run_dir}"]),
                               env_spec(cfg.env)).state_dict()
        assert all(torch.equal(steered[name], value) for name, value in weights.items())
        assert {n.split(".")[0] for n in set(steered) - set(weights)} == {
            "noise_encoder", "noise_trunk", "noise_mean", "noise_log_std", "value_q",
            "value_q_target", "sac_log_alpha"}
        # and `hpcvla eval` runs it in the real LIBERO env (one short episode)
        out = hpcvla("eval", run_dir, "--episodes", 1, "--envs", 1,
                     "env.max_episode_chunks=1", "--json")
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.splitlines()[-1])["split"] == "evaluation"


@pytest.mark.mpi
def test_the_held_out_loss_is_every_held_out_steps_on_two_zero3_learners(tmp_path):
    """sft.val_demos: after every sft.val_every steps and the last, the loss of each held-out
    real step, shared between the learners (ZeRO-3: their forwards are collective), equals
    the loss of all of them at once under the run's final weights."""
    train, held = tmp_path / "train.h5", tmp_path / "held.h5"
    for out, episodes, seed in ((train, 6, 0), (held, 3, 1)):
        done = hpcvla("demos", "configs/default.yaml", "--episodes", episodes, "--out", out,
                      f"run.seed={seed}")
        assert done.returncode == 0, done.stderr[-2000:]
    out = hpcvla("sft", "configs/default.yaml", f"sft.demos={train}", f"sft.val_demos={held}",
                 "sft.val_every=2", "sft.steps=4", "sft.batch_size=4", "learner.zero_stage=3",
                 f"run.root={tmp_path / 'runs'}", "--ranks", 2, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [step for step, _ in summary["val_losses"]] == [2, 4]
    assert f"held-out {summary['val_losses'][-1][1]:.4f}" in out.stdout
    # the start and stop, in the order reached, the slowest learner's; each one's peak memory
    assert list(summary["phases_s"]) == [
        "imports", "communicators", "demonstrations_read", "policy_built", "engine_ready",
        "first_step", "last_checkpoint_written", "finished"]
    assert 0 < summary["phases_s"]["imports"] <= summary["phases_s"]["finished"] < 300
    assert [r["rank"] for r in summary["per_rank"]] == [0, 1] and all(
        r["peak_memory"]["host_rss"] > 2 ** 20 and list(r["phases_s"])[-1] == "finished"
        for r in summary["per_rank"])
    assert "[hpcvla sft] start and stop, s since launch (slowest rank): imports " in out.stdout
    assert "[hpcvla sft] peak memory, GiB (measured by each rank):" in out.stdout
    from hpcvla.demonstrations import read_demonstrations
    from hpcvla.envs import env_spec
    from hpcvla.evaluate import checkpoint_weights
    cfg = load_config(run_dir / "config.yaml")
    spec = env_spec(cfg.env)
    policy = build_policy(cfg, spec)
    policy.load_arrays(checkpoint_weights(run_dir)[0])
    demos = read_demonstrations([str(held)], spec)
    with torch.no_grad():
        expected = policy.imitation_loss({k: torch.from_numpy(v) for k, v in demos.obs.items()},
                                         torch.from_numpy(demos.actions),
                                         torch.from_numpy(~demos.pad))
    assert summary["val_losses"][-1][1] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.mpi
def test_micro_batches_on_one_learner_train_what_two_learners_do(tmp_path):
    """sft.micro_batches (gradient accumulation, what a restart on fewer learners raises): one
    learner in 2 passes of 4 chunks a step trains the chunks 2 learners of 4 do, to the same
    weights, and its checkpoint records the step's 8 chunks. (Its command names no config, as
    `hpcvla train` may: the built-in default, configs/default.yaml's.)"""
    from hpcvla.evaluate import checkpoint_weights
    demos = tmp_path / "demos.h5"
    assert hpcvla("demos", "configs/default.yaml", "--episodes", 4, "--out",
                  demos).returncode == 0
    weights = []
    for ranks, passes in ((2, 1), (1, 2)):
        root = tmp_path / f"runs{ranks}"
        config = ["configs/default.yaml"] if ranks == 2 else []  # none: the built-in default
        # one thread each: the sums' order is then the passes' against the allreduce's alone
        # (a learner's share of 2 cores is 2 threads alone, 1 beside another: 1e-6 apart)
        out = hpcvla("sft", *config, f"sft.demos={demos}", "sft.steps=3",
                     "sft.batch_size=4", f"sft.micro_batches={passes}", f"run.root={root}",
                     "--ranks", ranks, timeout=300, env={"OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        (run_dir,) = root.iterdir()
        state = catalog.read_state(catalog.latest(run_dir))
        assert state["counters"][catalog.SFT_COUNTER] == 24
        assert state["counters"]["step_chunks"] == 8
        weights.append(checkpoint_weights(run_dir)[0])
    assert weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():
        np.testing.assert_allclose(weights[1][name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_sft_refuses_bad_demonstrations_before_any_rank(tmp_path, capsys):
    """In this process (libero_spatial's spec is its settings': no simulator is built)."""
    from hpcvla.cli import main

    def refused(*overrides) -> str:
        assert main(["sft", "configs/libero_spatial.yaml", f"run.root={tmp_path}",
                     *overrides]) == 2
        return capsys.readouterr().err
    assert "sft.demos" in refused()
    # the learners' settings sft sets from its own: typed, they would change nothing
    err = refused(f"sft.demos={LIBERO_DEMOS}", "algorithm.lr=1e-4", "learner.micro_batch=8")
    assert "algorithm.lr = '1e-4': expected none: hpcvla sft sets it from sft.lr; set that" \
        in err and "learner.micro_batch = '8': expected none: hpcvla sft sets it from " \
        "sft.batch_size" in err
    # train's own settings: `pipeline.total_updates=5` ran all of sft.steps without a word
    err = refused(f"sft.demos={LIBERO_DEMOS}", "pipeline.total_updates=5",
                  "learner.checkpoint_every_s=60", "rollout.segment_len=4")
    assert "pipeline.total_updates = '5': expected none: hpcvla sft does not read it (hpcvla " \
        "train does); set sft.steps" in err and "learner.checkpoint_every_s = '60': expected " \
        "none: hpcvla sft does not read it (hpcvla train does); set sft.checkpoint_every" \
        in err and "rollout.segment_len = '4'" in err, err
    err = refused(f"sft.demos={LIBERO_DEMOS}", "placement.per_node={learner: 3}",
                  "env.shards=4", "emulate.learner_ms_per_micro_batch=5")  # an sft world:
    assert all(f"{name} = " in err and "drop it" in err  # its learners step no env
               for name in ("placement.per_node", "env.shards",
                            "emulate.learner_ms_per_micro_batch")), err
    assert main(["config", "--job", "sft", "configs/colocated.yaml",  # once: not also as
                 "placement.per_node={learner: 3}"]) == 2  # what colocated does not read
    assert capsys.readouterr().err.count("placement.per_node = ") == 1
    for command in (["doctor", "--job", "sft"], ["config", "--job", "sft"]):  # as sft's
        assert main([*command, "configs/libero_spatial.yaml", "algorithm.critic_lr=1e-4"]) == 2
        assert "algorithm.critic_lr = '1e-4': expected none" in capsys.readouterr().err
    bad = "tests/fixtures/demonstrations/maniskill/pushcube.state.pd_ee_delta_pose.h5"
    assert "pushcube.state.pd_ee_delta_pose.h5" in refused(f"sft.demos={bad}")
    assert "sft.val_demos" in refused(f"sft.demos={LIBERO_DEMOS}", f"sft.val_demos={bad}")
    # a held-out set that is trained on (here by another spelling of the same file)
    again = Path(LIBERO_DEMOS).parent / ".." / Path(LIBERO_DEMOS).parent.name / \
        Path(LIBERO_DEMOS).name
    err = refused(f"sft.demos={LIBERO_DEMOS}", f"sft.val_demos={again}")
    assert "sft.val_demos" in err and "are trained on" in err, err[-2000:]
    assert not list(tmp_path.iterdir())  # no run directory: nothing started


def test_sft_is_not_held_to_the_rules_of_trains_own_settings():
    """A GRPO config's rule asks rollout.segment_len to be env.max_episode_chunks, and sft
    refuses a typed rollout.segment_len (train's alone): a shorter episode for its SFT start
    (bench learning's, from the RL arms' overrides) was refused both ways."""
    from hpcvla.config import ConfigError, load_config
    shorter = ["env.max_episode_chunks=3"]
    assert load_config(ROOT / "configs/reach_grpo.yaml", shorter, job="sft")
    with pytest.raises(ConfigError, match="rollout.segment_len = 20: expected "
                       "env.max_episode_chunks"):
        load_config(ROOT / "configs/reach_grpo.yaml", shorter, job="train")


def test_train_refuses_the_sft_settings_typed_for_it(tmp_path, capsys):
    """`hpcvla train ... sft.steps=50` trained as if it were not there: train reads no sft.*
    setting; typed, one is refused (its doctor's and config's too, as the job script runs
    them); a config file's sft section stays, for one file serving both commands."""
    from hpcvla.cli import main
    for command in (["train"], ["doctor"], ["config", "--job", "train"], ["plan", "--world", "4"]):
        assert main([*command, "configs/default.yaml", f"run.root={tmp_path}",
                     "sft.steps=50"]) == 2, command
        assert "sft.steps = '50': expected none: hpcvla train does not read the sft section " \
            "(hpcvla sft does); drop it" in capsys.readouterr().err, command
    # with the config's own problems: every problem in one error
    assert main(["train", "configs/default.yaml", "sft.steps=50", "learner.epochs=0"]) == 2
    err = capsys.readouterr().err
    assert "sft.steps = '50'" in err and "learner.epochs = 0" in err, err
    config = tmp_path / "both.yaml"
    config.write_text("sft:\n  steps: 50\n")
    assert main(["config", str(config)]) == 0 and "steps: 50" in capsys.readouterr().out
    assert not [p for p in tmp_path.iterdir() if p != config]  # nothing started


@pytest.mark.mpi
def test_sft_on_a_lerobot_dataset_folder(tmp_path):
    """A LeRobot dataset (LeRobot 0.6.1's format v3.0, AV1 video: the fixture) given as its
    folder trains two learners (sft.features naming two of its features); the same with an
    env whose state it does not hold, or sft.features naming a feature it lacks, is refused
    before any rank, naming the feature and the setting."""
    dataset = "tests/fixtures/demonstrations/lerobot/video_v30"
    libero_goal = ["env.suite=libero_goal", "env.image_size=64", f"sft.demos={dataset}"]
    out = hpcvla("sft", "configs/libero_spatial.yaml", *libero_goal, "env.state_format="
                 "quaternion", f"run.root={tmp_path}")
    assert out.returncode == 2 and "features.observation.state.shape" in out.stderr and \
        "env.state_format=axis_angle" in out.stderr, out.stderr[-2000:]
    out = hpcvla("sft", "configs/libero_spatial.yaml", *libero_goal, "env.state_format="
                 "axis_angle", "sft.features=image=observation.images.front",
                 f"run.root={tmp_path}")
    assert out.returncode == 2 and "the feature observation.images.front that sft.features " \
        "names for image" in out.stderr, out.stderr[-2000:]
    assert not list(tmp_path.iterdir())
    out = hpcvla("sft", "configs/libero_spatial.yaml", *libero_goal, "env.state_format="
                 "axis_angle", "sft.steps=2", "sft.batch_size=8", f"run.root={tmp_path}",
                 "sft.features=image=observation.images.image,actions=action", "--ranks", 2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["demonstrations"] == 3 and summary["steps"] == 2
    # the two learners read their shares of the videos into the one copy they train from
    assert "21 chunks from 3 demonstrations" in out.stdout and "one copy per node" in out.stdout


@pytest.mark.mpi
@pytest.mark.learning
@pytest.mark.slow
def test_sft_lifts_success_above_the_untrained_policy_and_rl_starts_from_it(tmp_path):
    """reach: the oracle's noisy demonstrations (training states), SFT, then `hpcvla eval`'s
    held-out states: success must rise as tests/test_learning.py requires of RL."""
    demos = tmp_path / "demos.h5"
    out = hpcvla("demos", "configs/default.yaml", "--episodes", 64, "--noise", 0.2,
                 "--out", demos)
    assert out.returncode == 0, out.stderr[-2000:]
    out = hpcvla("sft", "configs/default.yaml", f"sft.demos={demos}", "sft.steps=300",
                 f"run.root={tmp_path / 'sft'}", timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (sft_run,) = (tmp_path / "sft").iterdir()
    from hpcvla.evaluate import checkpoint_weights, evaluate
    from helpers import MIN_Z, improvement_z, run_train
    cfg = load_config(sft_run / "config.yaml")
    untrained, imitated = evaluate(cfg, None), evaluate(cfg, checkpoint_weights(sft_run)[0])
    assert untrained["split"] == imitated["split"] == "evaluation"
    z = improvement_z(untrained["success_rate"], imitated["success_rate"], 128)
    assert z >= MIN_Z, (z, untrained, imitated)
    # RL starts from it: the run's untrained policy is the SFT one
    _, summary, rl_run = run_train(tmp_path / "rl", f"policy.checkpoint={sft_run}",
                                   "pipeline.total_updates=1")
    start = evaluate(load_config(rl_run / "config.yaml"), None)
    assert start["success_rate"] == imitated["success_rate"]


@pytest.mark.mpi
@pytest.mark.slow
def test_a_stop_signal_checkpoints_and_resume_goes_on(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from helpers import ROOT
    demos = tmp_path / "demos.h5"
    assert hpcvla("demos", "configs/default.yaml", "--episodes", 8, "--out", demos).returncode == 0
    args = ["configs/default.yaml", f"sft.demos={demos}", "sft.batch_size=8",
            "sft.checkpoint_every=1", "pipeline.progress_every_s=0.1",
            "sft.schedule=cosine", "sft.warmup_steps=2", "sft.final_lr=1e-5",
            f"run.root={tmp_path / 'runs'}"]
    job = subprocess.Popen([sys.executable, "-m", "hpcvla", "sft", *args, "sft.steps=100000"],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in job.stdout:  # training: signal it as Slurm would
        if "[hpcvla sft] step" in line:
            job.send_signal(signal.SIGTERM)
            break
    deadline = time.monotonic() + 120
    output = job.communicate(timeout=max(1, deadline - time.monotonic()))[0]
    assert job.returncode == 0, output[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["preempted"] and 0 < summary["steps"] < 100000
    stopped = summary["steps"]
    # the optimizer stepped at the schedule's rates: the warm-up from sft.lr / 3
    from hpcvla.imitation.sft import lr_at
    planned = load_config(args[0], args[1:] + ["sft.steps=100000"]).sft
    assert summary["lrs"] == [lr_at(planned, step) for step in range(stopped)]
    assert summary["lrs"][0] == pytest.approx(planned.lr / 3)
    # a checkpoint every step, written in the background while the next steps trained: the
    # two kept are complete (checksums verified) and the newest is the stop's
    kept = catalog.complete(run_dir)
    assert [catalog.verify(path)["version"] for path in kept] == \
        list(range(max(1, stopped - 1), stopped + 1))
    # resumed on two learners: their steps start at the chunk the one learner stopped at
    out = hpcvla("sft", *args, f"run.resume={run_dir}", f"sft.steps={stopped + 3}", "--ranks", 2)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    state = catalog.read_state(catalog.latest(run_dir))
    assert state["counters"][catalog.SFT_COUNTER] == stopped * 8 + 3 * 8 * 2
    assert "[hpcvla sft] resumed with settings changed since the run last ran: sft.steps: " \
        f"100000 -> {stopped + 3}\n" in out.stdout, out.stdout[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == stopped + 3 and len(summary["losses"]) == 3
    assert not summary["preempted"]
    ended = [start.pop("ended") for start in summary["starts"]]  # when, UTC
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", e) for e in ended), ended
    assert ended == sorted(ended)
    assert summary["starts"] == [  # summary.json is the last start's; each start's headline
        {"from_step": 0, "steps": stopped, "learners": 1, "preempted": True},
        {"from_step": stopped, "steps": stopped + 3, "learners": 2, "preempted": False}]
    # resumed, the schedule goes on at the exact step, to its end at sft.final_lr
    planned = load_config(args[0], args[1:] + [f"sft.steps={stopped + 3}"]).sft
    assert summary["lrs"] == [lr_at(planned, step) for step in range(stopped, stopped + 3)]
    assert summary["lrs"][-1] == pytest.approx(1e-5)


@pytest.mark.mpi
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_learners_that_overfill_their_gpus_end_the_world_with_one_message(mpi):
    """A world of 2 sft learners on GPUs (their devices as bound on a GPU node): each gets
    rank 0's memory plan, a GPU each; where the plan overfills placement.gpu_memory_gb, every
    rank refuses alike: exit 2, the figure and the settings said once, no rank's failure."""
    def ranks(out) -> list[dict]:  # rank 0's line: every rank's exit status and plan
        (line,) = [line for line in out.stdout.splitlines() if line.startswith("[")]
        return json.loads(line)

    out = hpcvla("launch", "-n", 2, "--mpi", mpi, "--timeout", 120, "--", MPI_SCRIPT, 80)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    plans = [r["plan"] for r in ranks(out)]
    assert len(plans) == 2 and plans[0]["gpu"] == plans[1]["gpu"], plans
    assert plans[0]["device"] == {"0": "cuda:0", "1": "cuda:1"}
    assert plans[0]["gpu"]["0"] == plans[0]["gpu"]["1"] and plans[0]["gpu"]["0"]["activations"]
    out = hpcvla("launch", "-n", 2, "--mpi", mpi, "--timeout", 120, "--", MPI_SCRIPT, 1.2)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.count("invalid memory plan of the sft learners:") == 1, out.stderr
    assert "sft.batch_size = 64: expected a layout that fits: rank(s) 0 on node 0 cuda:0 " \
        "need 1.5 GiB > placement.gpu_memory_gb = 1.2" in out.stderr, out.stderr
    assert "failed" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert ranks(out) == [{"code": 2, "plan": None}] * 2


def test_a_resumed_sfts_first_record_follows_a_line_a_killed_rank_cut(tmp_path):
    """SFT's metrics.jsonl opens as every run log does (files.open_log): a line a killed rank
    cut short is ended first, so the resumed start's first record stands alone (it was glued
    to the cut line, and readers dropped both)."""
    from hpcvla.imitation.sft_log import RunLog
    from hpcvla.files import read_log
    (tmp_path / "metrics.jsonl").write_text('{"time": 1.0, "step": 1}\n{"time": 2.0, "st')
    log = RunLog(load_config(None, [f"run.root={tmp_path}"]), tmp_path, resumed_at=1)
    log.metrics.write(json.dumps({"time": 0.5, "step": 2}) + "\n")
    log.metrics.close()
    assert [r["step"] for r in read_log(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_world_sft_starts_times_its_ranks_from_the_command(tmp_path, monkeypatch):
    """`hpcvla sft --ranks N` starts its world as train's and eval's `--ranks` do
    (job/launch.run_local_world): its ranks time their start from the command's
    (HPCVLA_LAUNCHED_AT; sft's timed each rank's from its own process start) and are not the
    allocation's tasks inside a job (HPCVLA_LOCAL_WORLD)."""
    from hpcvla import cli
    from hpcvla.job import launch
    from hpcvla.metrics import phases
    from hpcvla.topology.comms import LOCAL_WORLD
    from helpers import reach_demos
    demos = reach_demos(tmp_path / "demos.h5", 2)
    started = {}

    def run_world(n, program, mpiexec="auto", timeout=None, mpi="auto"):
        started.update(n=n, program=program, env=dict(os.environ))
        return 0
    monkeypatch.setattr(launch, "run_world", run_world)
    for command, ranks, demos_of in (("sft", 2, [f"sft.demos={demos}"]), ("train", 4, [])):
        with mock.patch.dict(os.environ):  # what the command sets, for its ranks alone
            for name in (phases.LAUNCHED_AT, LOCAL_WORLD):
                os.environ.pop(name, None)
            assert cli.main([command, "configs/default.yaml", "--ranks", str(ranks),
                             *demos_of, f"run.root={tmp_path}"]) == 0
        assert started["program"][0] == command and started["n"] == ranks
        # the command's process start (this test process's), not each rank's own
        assert float(started["env"][phases.LAUNCHED_AT]) == \
            pytest.approx(phases._process_start(), abs=1e-3)
        assert started["env"][LOCAL_WORLD] == "1"
