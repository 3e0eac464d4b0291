"""The scripted ManiSkill experts (envs/experts.py) in real ManiSkill envs, and `hpcvla demos`
(imitation/recording.py): its file is a trajectory dump that `hpcvla inspect` reads, recorded
from training initial states only, a task without an expert is refused naming the setting,
and with `--policy` (DAgger) a run's policy drives while the expert labels."""

import json
import re

import h5py
import numpy as np
import pytest

from helpers import hpcvla

from hpcvla.envs.base import EVAL_STATE_IDS
from hpcvla.envs.experts import make_expert
from hpcvla.envs.maniskill import ManiSkillEnv
from hpcvla.metrics.dump import attr_text

CONFIG = "configs/maniskill_pickcube.yaml"
SMALL = ("env.task=PushCube-v1", "env.image_size=16")


@pytest.mark.slow  # building a ManiSkill env and rendering: ~20 s on 2 busy cores
def test_push_cube_expert_succeeds_from_training_states():
    env = ManiSkillEnv(1, task="PushCube-v1", image_size=16, state=False)
    expert = make_expert("maniskill", "PushCube-v1", env.spec.chunk_len)
    successes = 0
    try:
        for init_state_id in range(EVAL_STATE_IDS, EVAL_STATE_IDS + 8):
            env.reset(init_state_ids=np.array([init_state_id]))
            for _ in range(env.spec.max_episode_chunks):
                result = env.step(expert.act(env))
                if result.terminated[0] or result.truncated[0]:
                    break
            successes += bool(result.success[0])
    finally:
        env.close()
    assert successes >= 7, f"the PushCube expert succeeded in {successes} of 8 episodes"


def test_maniskill_episodes_run_to_the_horizon_for_its_conventions():
    """`run_to_horizon` (ManiSkill's ignore_terminations, as `hpcvla eval` runs it): the same
    expert episodes as when success ends them, but they go on to the horizon; `success` is
    success_once, `success_at_end` whether the cube is still on the goal at the last step:
    both arms hold still after their success, and env 1's cube is put back where it started
    (through the privileged env, as a knock would)."""
    ids = np.array([EVAL_STATE_IDS + 3, EVAL_STATE_IDS + 5])
    env = ManiSkillEnv(2, task="PushCube-v1", camera=False, max_episode_chunks=8)
    expert = make_expert("maniskill", "PushCube-v1", env.spec.chunk_len)
    try:
        env.reset(init_state_ids=ids)
        ended = np.zeros(2, int)
        for chunk in range(1, 9):
            result = env.step(expert.act(env))
            ended[(ended == 0) & result.terminated] = chunk
        assert (ended > 0).all() and (result.success_at_end is not None)
        env.run_to_horizon = True
        env.reset(init_state_ids=ids)
        u = env.privileged_envs()[1]
        start = u.obj.pose
        for chunk in range(1, 9):
            actions = expert.act(env)
            actions[chunk > ended] = 0.0  # both arms hold still after their success
            if chunk == ended[1] + 1:
                u.obj.set_pose(start)  # off the goal
            result = env.step(actions)
            assert not result.terminated.any()
            if chunk < 8:
                assert not result.truncated.any()
        assert result.truncated.all() and (result.episode_length == 8).all()
        assert result.success.all()  # success_once: as when the success ended the episode
        assert result.success_at_end.tolist() == [True, False]
    finally:
        env.close()


def test_a_step_limit_cuts_the_chunk_it_falls_in():
    """`step_limit` (eval.protocol=libero: LIBERO's scripts count primitive steps, and OFT's
    8-step chunks make 27.5 of libero_spatial's 220): an episode runs exactly the limit's
    actions, the chunk it falls in cut there, and is truncated; the next counts anew."""
    env = ManiSkillEnv(1, task="PushCube-v1", camera=False, max_episode_chunks=8)
    chunk, executed = env.spec.chunk_len, []
    slot = env._slots[0]
    step = slot.step
    slot.step = lambda action: (executed.append(float(action[0])), step(action))[1]
    env.step_limit = 2 * chunk + 3
    try:
        for n in range(1, 5):
            actions = np.zeros((1, chunk, env.spec.action_dim), np.float32)
            actions[..., 0] = np.arange(chunk) / 100 + n / 10  # which chunk, which step
            result = env.step(actions)
            assert bool(result.truncated[0]) == (n == 3), n
        assert len(executed) == 2 * chunk + 3 + chunk
        assert executed[2 * chunk:2 * chunk + 3] == pytest.approx([0.3, 0.31, 0.32])
        assert executed[-chunk:] == pytest.approx(0.4 + np.arange(chunk) / 100)
    finally:
        env.close()


@pytest.mark.mpi
@pytest.mark.slow
def test_demos_writes_a_dump_that_inspect_reads(tmp_path):
    out = tmp_path / "demos.h5"
    done = hpcvla("demos", CONFIG, *SMALL, "--episodes", 2, "--noise", 0.05, "--out", out)
    assert done.returncode == 0, done.stderr
    assert "hpcvla demos: 2 episodes of PushCube-v1" in done.stdout
    shown = hpcvla("inspect", out, "--json")
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)[0]
    assert summary["episodes"] == 2 and summary["complete"]
    assert summary["policy_versions"] == [-1, -1]  # the expert, not a policy
    keys = summary["keys"]
    assert {k for k in keys if k.startswith("obs/")} == {
        "obs/image", "obs/state", "obs/instruction"}
    assert keys["obs/image"]["shape"] == ["T", 16, 16, 3]
    assert keys["actions"]["shape"] == ["T", 5, 7]
    with h5py.File(out, "r") as f:
        demos = [f["data"][name] for name in sorted(f["data"])]
        for demo in demos:
            assert demo.attrs["seed"] >= EVAL_STATE_IDS  # a training initial state
            assert demo.attrs["success"] == bool(demo["terminated"][-1])
            assert attr_text(demo.attrs["instruction"]) == \
                "push the cube to the red and white target"
            actions = demo["actions"][()]
            assert np.abs(actions).max() <= 1.0 and actions.std() > 0
        assert demos[0].attrs["seed"] != demos[1].attrs["seed"]


def test_the_experts_refuse_a_control_mode_they_do_not_plan_in():
    for mode in ("pd_joint_delta_pos", "pd_ee_target_delta_pose"):
        with pytest.raises(ValueError, match=f"env.control_mode={mode}: the scripted "
                                             "PushCube-v1 expert acts in pd_ee_delta_pose"):
            make_expert("maniskill", "PushCube-v1", 5, control_mode=mode)
    make_expert("maniskill", "PushCube-v1", 5, control_mode="pd_ee_delta_pose")


@pytest.mark.mpi
def test_demos_refuses_a_task_without_an_expert(tmp_path):
    out = tmp_path / "demos.h5"
    done = hpcvla("demos", CONFIG, "env.task=StackCube-v1", "--episodes", 1, "--out", out)
    assert done.returncode == 2
    assert ("env.task=StackCube-v1: no scripted expert; tasks with one: PickCube-v1, "
            "PushCube-v1") in done.stderr
    assert not out.exists()


@pytest.mark.mpi
def test_demos_driven_by_a_policy_label_its_states_with_the_experts_chunks(tmp_path):
    """DAgger on reach: a run's policy acts (deterministic here, so it replays), the oracle
    labels. Replayed from each demo's initial state, the recorded observations are the ones
    the policy's own chunks lead to, and every recorded chunk is the oracle's there."""
    from hpcvla.config import load_config
    from hpcvla.envs.reach import oracle_actions
    from hpcvla.imitation.recording import PolicyDriver, _env
    expert_file, driven = tmp_path / "expert.h5", tmp_path / "driven.h5"
    assert hpcvla("demos", "configs/default.yaml", "--episodes", 4,
                  "--out", expert_file).returncode == 0
    done = hpcvla("sft", "configs/default.yaml", f"sft.demos={expert_file}", "sft.steps=2",
                  f"run.root={tmp_path / 'runs'}")
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    done = hpcvla("demos", "configs/default.yaml", "--policy", run_dir, "--deterministic",
                  "--episodes", 2, "--out", driven)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"policy {run_dir} v2 (the expert labelled every step) success" in done.stdout
    env, _ = _env(load_config("configs/default.yaml"))
    driver = PolicyDriver(run_dir, env.spec, deterministic=True)
    differs = False
    with h5py.File(driven, "r") as f:
        for demo in (f["data"][name] for name in sorted(f["data"])):
            assert attr_text(demo.attrs["driver"]) == f"{run_dir} v2"
            obs = env.reset(init_state_ids=np.array([demo.attrs["seed"]]))
            for t in range(len(demo["actions"])):
                for key in env.spec.obs:
                    assert np.array_equal(obs[key][0], demo["obs"][key][t]), (key, t)
                label = oracle_actions(env)[0]
                assert np.allclose(demo["actions"][t], label), t
                ran = driver(obs)
                differs |= not np.allclose(ran[0], label, atol=1e-3)
                obs = env.step(ran).obs
    env.close()
    assert differs  # two SFT steps: the policy is not the oracle
    refused = hpcvla("demos", "configs/default.yaml", "--policy", run_dir, "--noise", 0.1,
                     "--episodes", 1, "--out", tmp_path / "noisy.h5")
    assert refused.returncode == 2 and "--policy: the expert labels" in refused.stderr


@pytest.mark.mpi  # the CLI in a process of its own
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_demos_stopped_by_a_signal_leaves_a_whole_file(tmp_path, stop):
    """Ctrl-C or a job's SIGTERM while recording: progress lines until then, the episode
    under way finished, the file holds every episode written (checksums read back), the
    summary says so and the exit status is 128 + the signal's number."""
    import signal
    import subprocess
    import sys

    from helpers import ROOT
    from hpcvla.metrics.dump import summarize, verify
    out = tmp_path / "demos.h5"
    job = subprocess.Popen([sys.executable, "-m", "hpcvla", "demos", "configs/default.yaml",
                            "pipeline.progress_every_s=0.1", "--episodes", "1000000",
                            "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    for line in job.stdout:  # recording: stop it as a user or Slurm would
        if line.startswith("[hpcvla demos] ") and " 0/" not in line:
            job.send_signal(getattr(signal, stop))
            break
    output = line + job.communicate(timeout=60)[0]
    number = getattr(signal, stop).value
    assert job.returncode == 128 + number, output[-2000:]
    written = int(re.search(rf"stopped by signal {number} after (\d+) of 1000000 episodes: "
                            "the file holds them, complete", output).group(1))
    assert written >= 1 and f"hpcvla demos: {written} episodes of" in output
    assert "Traceback" not in output
    verify(out)  # every dataset's checksum
    summary = summarize(out)
    assert summary["episodes"] == written and summary["complete"]
    assert summary["env"] == "reach"  # the env, whose task is itself


def test_demos_stopped_before_the_first_episode_leave_no_file(tmp_path, monkeypatch):
    """A stop before any episode: no file to stand in the next try's way (`--out` must not
    exist), and the summary says so."""
    import signal

    from hpcvla.config import load_config
    from hpcvla.imitation.recording import record, summary_line
    from hpcvla.process import preempt
    monkeypatch.setattr(preempt, "_first", [(0.0, signal.SIGTERM)])
    monkeypatch.setattr(preempt, "requested", lambda: True)
    summary = record(load_config("configs/default.yaml"), 4, tmp_path / "demos.h5")
    assert summary["episodes"] == 0 and not (tmp_path / "demos.h5").exists()
    assert summary_line(summary).endswith(f"stopped by signal {signal.SIGTERM.value} after 0 "
                                          "of 4 episodes: no file written")


def test_successful_only_keeps_the_successes_and_gives_up_when_they_are_too_rare(tmp_path):
    """`hpcvla demos --successful-only` (recording.record): with the `reach` expert's actions
    drowned in noise (most episodes fail), the file holds the episodes asked, all successful,
    from more attempts (each labelled with its attempt's number); in episodes too short to
    succeed it gives up after ATTEMPTS_PER_EPISODE x the episodes asked, naming the flag, and
    leaves no file."""
    from hpcvla.config import load_config
    from hpcvla.imitation.recording import ATTEMPTS_PER_EPISODE, RecordingError, record
    out = tmp_path / "demos.h5"
    result = record(load_config("configs/default.yaml"), 4, out, noise=10.0,
                    successful_only=True)
    assert result["episodes"] == 4 and result["attempts"] > 4, result
    with h5py.File(out, "r") as f:
        demos = [f["data"][name] for name in sorted(f["data"])]
        assert len(demos) == 4 and all(demo.attrs["success"] for demo in demos)
        attempts = sorted(int(demo.attrs["episode"]) for demo in demos)
    assert attempts[-1] >= 4 and len(set(attempts)) == 4, attempts  # failed ones in between
    short = tmp_path / "short.h5"
    with pytest.raises(RecordingError, match=f"--successful-only: 0 successful episodes in "
                                             f"{2 * ATTEMPTS_PER_EPISODE} attempts"):
        record(load_config("configs/default.yaml", ["env.max_episode_chunks=1"]), 2, short,
               successful_only=True)
    assert not short.exists()


def test_pick_cube_episodes_report_whether_the_cube_was_grasped():
    """PickCube's `is_grasped` flag is an episode metric (EnvSpec.episode_metrics: `grasped`,
    1.0 where the cube was held at some step of the episode): the expert's episodes grasp it,
    a still arm's do not; PushCube has no such flag and declares none."""
    env = ManiSkillEnv(2, task="PickCube-v1", camera=False, max_episode_chunks=12)
    expert = make_expert("maniskill", "PickCube-v1", env.spec.chunk_len)
    try:
        assert env.spec.episode_metrics == ("grasped",)
        env.reset(init_state_ids=np.array([EVAL_STATE_IDS + 1, EVAL_STATE_IDS + 2]))
        grasped = np.full(2, np.nan)
        for _ in range(12):
            actions = expert.act(env)
            actions[1] = 0.0  # env 1's arm holds still: it never reaches the cube
            result = env.step(actions)
            done = result.terminated | result.truncated
            grasped[done & np.isnan(grasped)] = result.metrics["grasped"][done & np.isnan(
                grasped)]
            assert (result.metrics["grasped"][~done] == 0).all()  # none until an episode ends
        assert grasped.tolist() == [1.0, 0.0] and result.metrics["grasped"].dtype == np.float32
    finally:
        env.close()
    push = ManiSkillEnv(1, task="PushCube-v1", camera=False)
    try:
        assert push.spec.episode_metrics == () and push.step(np.zeros(
            (1, push.spec.chunk_len, push.spec.action_dim))).metrics is None
    finally:
        push.close()
    # each task's own flag, which the GPU backend takes too (episode_flags): one per metric
    from hpcvla.envs.maniskill import episode_flags
    for task, flags in (("PickCube-v1", ["is_grasped"]), ("StackCube-v1", ["is_cubeA_grasped"]),
                        ("PushCube-v1", [])):
        env = ManiSkillEnv(1, task=task, camera=False)
        try:
            assert episode_flags(env._slots[0].u.evaluate()) == flags, task
        finally:
            env.close()


def test_an_evaluation_reports_the_envs_episode_metrics():
    """`hpcvla eval` and the held-out evaluation report the env's episode metrics beside
    success: their mean over the episodes kept (env faults and unknown values left out), and
    each episode's."""
    from hpcvla.config import load_config
    from hpcvla.evaluate import describe
    from hpcvla.roles.heldout import Episode, HeldOut
    cfg = load_config(CONFIG, ["env.image_size=32", "env.max_episode_chunks=2"])
    held = HeldOut(cfg, 2, 2, 0, "cpu")
    try:
        result = held.report(held.run(deterministic=True)[0], True)
        assert [e["episode_grasped"] for e in result["per_episode"]] == [0.0, 0.0]
        assert result["episode_grasped"] == 0.0  # an untrained policy grasps nothing in 10 steps
        mixed = held.report([Episode(0, True, 1.0, False, True, 10, {"grasped": 1.0}),
                             Episode(1, False, 0.0, False, False, 10, {"grasped": np.nan}),
                             Episode(0, False, 0.0, True, False, 5, {"grasped": 0.0})], True)
    finally:
        held.close()
    assert mixed["episode_grasped"] == 1.0  # the unknown and the env fault left out
    assert [e["episode_grasped"] for e in mixed["per_episode"]] == [1.0, None, None]
    assert held.report([Episode(0, True, 1.0, False, True, 10, {"grasped": 1.0}),  # twins
                        Episode(0, True, 1.0, False, True, 10, {"grasped": 0.0})],
                       True)["episode_grasped"] == 0.5
    shown = describe({**mixed, "version": 0, "ranks": 1, "hosts": ["h"], "device": "cpu"})
    assert "  the env's episode metrics: grasped 1.000" in shown, shown
