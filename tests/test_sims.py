"""ManiSkill3 and LIBERO behind the VectorEnv interface, stepped for real: spec conformance,
instructions, actions, success, truncation, auto-reset, initial-state ids, one failing env,
clear errors for what cannot run here, and a short `hpcvla train` on each simulator."""

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from hpcvla.config import ConfigError, load_config
from hpcvla.envs import check_env, make_env
from hpcvla.envs.base import EVAL_STATE_IDS
from hpcvla.envs.isolated import IsolatedEnv
from hpcvla.envs.serial import require
from hpcvla.text import words
from helpers import ROOT, hpcvla

pytestmark = pytest.mark.slow  # ManiSkill and LIBERO take 10-30 s to start

N, CHUNK, HORIZON = 3, 4, 3  # envs, primitive steps per chunk, chunks per episode
SETTINGS = {
    "maniskill": dict(task="PickCube-v1", reward="sparse"),
    "libero": dict(suite="libero_spatial", task=0),
}
GRIPPER_OPEN = -1.0


def build(name, num_envs=N, **extra):
    return make_env(name, num_envs, seed=0, image_size=32, wrist_image=True, chunk_len=CHUNK,
                    max_episode_chunks=HORIZON, **SETTINGS[name], **extra)


@pytest.fixture(scope="module", params=["maniskill", "libero"])
def env(request):
    env = build(request.param)
    yield env
    env.close()


def still(env, moves=None):
    """A chunk holding every arm still (gripper open); `moves` {env: action} overrides."""
    actions = np.zeros((env.num_envs, CHUNK, 7), dtype=np.float32)
    actions[..., 6] = GRIPPER_OPEN
    for i, action in (moves or {}).items():
        actions[i] = action
    return actions


def place_at_goal(env, i):
    """Put env i's object where its task counts as solved (PickCube: the cube at the goal;
    LIBERO-Spatial task 0: the black bowl on the plate), in the real simulator."""
    slot = env._slots[i]
    if hasattr(slot, "u"):  # ManiSkill
        slot.u.cube.set_pose(slot.u.goal_site.pose)
        return
    sim = slot.env.sim
    plate = sim.data.body_xpos[sim.model.body_name2id("plate_1_main")]
    sim.data.set_joint_qpos("akita_black_bowl_1_joint0",
                            np.concatenate([plate + [0, 0, 0.02], [1, 0, 0, 0]]))
    sim.forward()


def test_observations_match_spec_with_instruction(env):
    obs = env.reset()
    assert set(obs) == {"image", "wrist_image", "state", "instruction"} == set(env.spec.obs)
    for name, (shape, dtype) in env.spec.obs.items():
        assert obs[name].shape == (N, *shape) and obs[name].dtype == np.dtype(dtype), name
    assert env.spec.obs["image"][0] == (32, 32, 3) and env.spec.action_dim == 7
    assert obs["image"].std() > 5 and obs["wrist_image"].std() > 5  # real renders, not blank
    for tokens, text in zip(obs["instruction"], env.instructions()):
        real = tokens[tokens != 0]
        assert [env.spec.vocab[t] for t in real] == words(text) and len(real) > 3
        assert (tokens[len(real):] == 0).all()  # padding only at the end


def test_actions_move_the_robot(env):
    env.reset(init_state_ids=np.array([4, 4, 4]))
    push = np.zeros((CHUNK, 7), dtype=np.float32)
    push[:, 0], push[:, 6] = 1.0, GRIPPER_OPEN  # full speed along +x, gripper open
    result = env.step(still(env, {0: push}))
    state, image = result.obs["state"], result.obs["image"]
    assert np.abs(state[0] - state[1]).max() > 0.01  # the pushed arm moved
    assert np.array_equal(state[1], state[2])  # identical still arms stay identical
    assert np.abs(image[0].astype(int) - image[1]).sum() > 0


def test_success_terminates_with_reward_and_auto_resets(env):
    env.reset(init_state_ids=np.array([1, 2, 3]))
    place_at_goal(env, 1)
    result = env.step(still(env))
    assert result.success.tolist() == [False, True, False]
    assert result.terminated.tolist() == [False, True, False] and not result.truncated.any()
    assert result.reward[1] == 1.0 and result.episode_return[1] == 1.0  # sparse: 1 at success
    assert result.episode_length.tolist() == [0, 1, 0]
    assert env._chunks.tolist() == [1, 0, 1]  # env 1 already started its next episode
    ran = result.chunk_steps.tolist()  # env 1's chunk ended at its success (LIBERO's bowl
    assert ran[0] == ran[2] == CHUNK and 1 <= ran[1] < CHUNK  # settles on the plate first)


def test_truncation_at_horizon_then_auto_reset(env):
    env.reset()
    env.keep_final_obs = True  # as for PPO's algorithm.bootstrap_truncated
    for chunk in range(1, HORIZON + 1):
        before, result = result.obs if chunk > 1 else None, env.step(still(env))
        assert result.truncated.all() == (chunk == HORIZON) and not result.terminated.any()
        assert (result.final_obs is None) == (chunk < HORIZON)
    assert result.episode_length.tolist() == [HORIZON] * N
    # the observation the horizon ended each episode at (PPO bootstraps from it): the scene
    # the still arms left, much as the chunk before saw it, not the next episode's start
    def change(x, y):
        return np.abs(x["image"].astype(int) - y["image"]).mean(axis=(1, 2, 3))
    assert (change(result.final_obs, before) < change(result.obs, result.final_obs)).all()
    env.keep_final_obs = False
    assert not result.success.any() and env._chunks.tolist() == [0] * N
    result = env.step(still(env))  # the new episodes run on
    assert not result.truncated.any() and env._chunks.tolist() == [1] * N


def test_held_resets_leave_the_ended_episodes_where_they_ended(env):
    """GRPO's step before its grouped restart (VectorEnv.hold_resets): the horizon ends
    every episode, and no env resets (the restart that follows resets them all)."""
    env.reset()
    env.hold_resets(True)
    try:
        for _ in range(HORIZON):
            before, result = env._batch(), env.step(still(env))
        assert result.truncated.all() and env._chunks.tolist() == [0] * N
        change = np.abs(result.obs["image"].astype(int) - before["image"]).mean()
        assert change < 1.0  # the still scene, not new episodes' starts (test above: 1.6-6.4)
    finally:
        env.hold_resets(False)


def test_same_init_state_id_same_initial_observation(env):
    first = env.reset(init_state_ids=np.array([7, 7, 8]))
    for key in ("image", "wrist_image", "state"):
        assert np.array_equal(first[key][0], first[key][1]), key
    assert not np.array_equal(first["image"][0], first["image"][2])
    env.step(still(env))
    again = env.reset(init_state_ids=np.array([8, 7, 7]))
    for key in ("image", "wrist_image", "state"):
        assert np.array_equal(again[key][0], first[key][2]), key
        assert np.array_equal(again[key][2], first[key][0]), key
    seeded = [env.reset(seeds=np.array([3, 4, 5]))["state"] for _ in range(2)]
    assert np.array_equal(*seeded)  # seeds make the random episode starts repeatable


def test_evaluation_states_are_each_initial_state_once(env):
    ids, tasks = env.evaluation_states(128)
    if hasattr(env, "suite"):  # LIBERO, task 0: its 50 fixed states
        assert len(ids) == len(set(ids.tolist())) == 50, ids
        assert set(tasks) == {f"task 0: {env.suite.instructions[0]}"}
    else:  # ManiSkill: every id its own initial state
        assert ids.tolist() == list(range(128)) and len(set(tasks)) == 1


def object_xy(env) -> list:
    """Every LIBERO env's object positions on the table (x, y of each free joint)."""
    model = env._slots[0].env.sim.model
    xy = [a + k for j, a in enumerate(model.jnt_qposadr) if model.jnt_type[j] == 0
          for k in (0, 1)]
    return xy, [slot.env.sim.data.qpos[xy].copy() for slot in env._slots]


def test_training_never_starts_from_an_evaluation_state(env):
    env.reset()  # random starts, as training's auto-resets
    if hasattr(env, "suite"):  # LIBERO: the task's sampler placements, none a fixed state
        xy, free = object_xy(env)
        fixed = env.suite.init_states(0)[:, 1 + np.array(xy)]  # flat state: time, qpos, qvel
        group_id = np.full(N, EVAL_STATE_IDS + 5)  # a GRPO group's training id
        env.reset(init_state_ids=group_id)
        _, group = object_xy(env)
        env.step(still(env))
        env.reset(init_state_ids=group_id)
        _, again = object_xy(env)
        assert min(np.abs(a - b).max() for a, b in itertools.combinations(free, 2)) > 1e-3
        assert all(np.array_equal(g, group[0]) for g in (*group, *again))  # same id, same state
        for placement in (*free, group[0]):
            assert np.abs(fixed - placement).max(axis=1).min() > 1e-3
    else:  # ManiSkill: reset seeds from the training split; an id is the seed itself
        assert all(slot.u._episode_seed[0] >= EVAL_STATE_IDS for slot in env._slots)
        env.reset(init_state_ids=np.array([1, 2, EVAL_STATE_IDS + 1]))
        assert [int(slot.u._episode_seed[0]) for slot in env._slots] == [1, 2, EVAL_STATE_IDS + 1]


@pytest.mark.parametrize("name", ["maniskill", "libero"])
def test_failing_env_is_reported_by_id_and_the_others_go_on(name, capfd):
    env = build(name, num_envs=2, first_env=10)
    try:
        env.reset()
        env._slots[1].env.close()  # the simulator under env 11 is gone: its next step raises
        result = env.step(still(env))
        assert result.truncated.tolist() == [False, True] and not result.success.any()
        assert [env_id for env_id, _ in env.failures] == [11] and not env.retired
        assert "env 11 failed in step" in capfd.readouterr().err
        result = env.step(still(env))  # env 10 went on; env 11 was rebuilt and steps again
        assert not result.truncated.any() and env._chunks.tolist() == [2, 1]
    finally:
        env.close()


def test_an_env_whose_reset_failed_ends_its_episode_as_a_fault_before_running_it(capfd):
    """A slot whose reset raises is rebuilt on a random start, not the state asked for (an
    evaluation state, a GRPO group's): its next step reports an env fault without running
    it, so nothing scores or trains that episode as the one asked for; the others go on."""
    env = build("maniskill", num_envs=2, first_env=10)
    try:
        env.reset()
        env._slots[1].env.close()  # the simulator under env 11 is gone: its reset raises
        env.reset(init_state_ids=np.array([3, 4]))
        assert [env_id for env_id, _ in env.failures] == [11] and not env.retired
        assert "env 11 failed in reset" in capfd.readouterr().err
        result = env.step(still(env))
        assert result.env_fault.tolist() == [False, True]
        assert result.truncated.tolist() == [False, True] and env._chunks.tolist() == [1, 0]
        assert not env.step(still(env)).env_fault.any()  # the rebuilt env steps on
    finally:
        env.close()


@pytest.mark.parametrize("name", ["maniskill", "libero"])
def test_killed_simulator_process_is_restarted(name, capfd):
    """env.isolation=process with the real simulator: a worker killed outright (a segfault,
    the OOM killer) is replaced, its envs' episodes end truncated, the shard steps on."""
    kwargs = dict(image_size=32, wrist_image=False, chunk_len=CHUNK, max_episode_chunks=HORIZON,
                  first_env=4, **SETTINGS[name])
    env = IsolatedEnv(name, 2, 0, kwargs, timeout_s=300, max_restarts=1, first_env=4,
                      owner="rank 3 (simulator)")
    try:
        env.reset()
        assert not env.step(still(env)).truncated.any()
        env._proc.kill()
        result = env.step(still(env))
        assert result.truncated.all() and env.restarts == 1
        assert f"rank 3 (simulator), {name} envs 4-5: step: the worker died (killed by " \
               "SIGKILL)" in capfd.readouterr().err
        result = env.step(still(env))
        assert not result.truncated.any() and result.obs["image"].shape == (2, 32, 32, 3)
    finally:
        env.close()


def test_a_maniskill_env_without_its_camera_observes_the_state_alone():
    """env.camera=false: nothing rendered; the state and instruction as with the camera."""
    with_camera = make_env("maniskill", 1, seed=0, task="PushCube-v1")
    state_only = make_env("maniskill", 1, seed=0, task="PushCube-v1", camera=False)
    try:
        assert set(with_camera.spec.obs) - set(state_only.spec.obs) == {"image"}
        first, second = with_camera.reset(), state_only.reset()
        assert set(second) == set(state_only.spec.obs)
        np.testing.assert_array_equal(first["state"], second["state"])
    finally:
        with_camera.close()
        state_only.close()


@pytest.mark.parametrize("task", ["PickCube-v1", "PushCube-v1"])
def test_the_visual_state_is_maniskills_rgb_mode_state(task):
    """env.state_mode=visual: the state ManiSkill's own `rgb` obs mode gives beside its
    pictures (FlattenRGBDObservationWrapper's: agent then extra, no object poses; PickCube's
    goal position, which its cameras hide), from the same reset seed and actions, checked
    against ManiSkill itself; `privileged` (the default) holds more (the object's pose)."""
    import gymnasium as gym
    import torch
    from mani_skill.utils.common import flatten_state_dict
    from mani_skill.utils.wrappers import FlattenRGBDObservationWrapper

    reference = FlattenRGBDObservationWrapper(gym.make(
        task, obs_mode="rgb", control_mode="pd_ee_delta_pose", num_envs=1, sim_backend="cpu",
        render_backend="cpu", sensor_configs=dict(width=32, height=32)), rgb=True, depth=False,
        state=True)
    visual = make_env("maniskill", 1, seed=0, task=task, image_size=32, chunk_len=1,
                      state_mode="visual")
    privileged = make_env("maniskill", 1, seed=0, task=task, image_size=32, chunk_len=1)
    try:
        actions = np.random.default_rng(0).uniform(-1, 1, (3, 1, 1, 7)).astype(np.float32)
        ours = [visual.reset(init_state_ids=np.array([3]))["state"][0]]
        theirs = [reference.reset(seed=3)[0]["state"][0].numpy()]
        for action in actions:
            ours.append(visual.step(action).obs["state"][0])
            theirs.append(reference.step(torch.as_tensor(action[:, 0]))[0]["state"][0].numpy())
        np.testing.assert_allclose(np.stack(ours), np.stack(theirs), atol=1e-5)
        extra = reference.unwrapped._get_obs_extra(reference.unwrapped.get_info())
        assert ("goal_pos" in extra) == (task == "PickCube-v1")  # PushCube's shows on camera
        assert privileged.spec.obs["state"][0][0] > visual.spec.obs["state"][0][0] == \
            flatten_state_dict(reference.unwrapped._get_obs_state_dict(
                reference.unwrapped.get_info()), use_torch=True).shape[-1]
    finally:
        reference.close()
        visual.close()
        privileged.close()


def test_dense_delta_pays_success_over_hovering_short_of_it():
    """env.reward on PickCube (its config's 5-step chunks, 16 chunks), one initial state: the
    scripted expert to success against its actions up to a chunk short of success, then the
    arm still until the horizon. `dense`: the hover returns more than the success (episodes
    end at success, unbootstrapped). `dense_delta`: an episode returns the shaping's last
    value, 1 at success, less short of it; the episode after the auto-reset again 1. `dense`
    with env.success_ends_episode=false: the success, held to the horizon, returns more than
    the hover (ManiSkill's SAC baseline's objective), its episode a success (success_once)."""
    from hpcvla.envs.experts import make_expert

    def episode(reward, actions, count=1, **extra):
        """(return, success, chunks) of `count` episodes, acting actions(chunk, env)."""
        env = make_env("maniskill", 1, seed=0, task="PickCube-v1", reward=reward, chunk_len=5,
                       max_episode_chunks=16, camera=False, **extra)
        ends, chunk = [], 0
        try:
            env.reset(init_state_ids=np.array([2**20 + 7]))
            while len(ends) < count:
                out = env.step(actions(chunk, env))
                chunk += 1
                if out.terminated[0] or out.truncated[0]:
                    ends.append((float(out.episode_return[0]), bool(out.success[0]), chunk))
                    chunk = 0
        finally:
            env.close()
        return ends

    expert, taken = make_expert("maniskill", "PickCube-v1", 5), []
    (success, ok, length), again = episode(
        "dense_delta", lambda chunk, env: taken.append(expert.act(env)) or taken[-1], count=2)
    assert ok and again[1] and success == pytest.approx(1.0) == again[0]

    def hover_from(stop):  # the expert's first `stop` chunks, then the arm still
        still = taken[stop].copy()
        still[..., :6] = 0.0
        return lambda chunk, env: taken[chunk] if chunk < stop else still
    for stop in range(length - 1, 0, -1):  # the latest that stops short of success
        (hover, hover_ok, hover_length), = episode("dense_delta", hover_from(stop))
        if not hover_ok:
            break
    assert not hover_ok and hover_length == 16 and 0 < hover < success
    (dense_success, _, _), = episode("dense", lambda chunk, env: taken[chunk])
    (dense_hover, _, _), = episode("dense", hover_from(stop))
    assert dense_hover > 2 * dense_success, (dense_hover, dense_success)
    hold = taken[length - 1].copy()  # the grasp kept, the arm still
    hold[..., :6] = 0.0
    (held, held_ok, held_length), = episode(
        "dense", lambda chunk, env: taken[chunk] if chunk < length else hold,
        success_ends_episode=False)
    (hover, hover_ok, hover_length), = episode("dense", hover_from(stop),
                                              success_ends_episode=False)
    assert held_ok and not hover_ok and held_length == hover_length == 16
    assert held > hover == pytest.approx(dense_hover), (held, hover, dense_hover)


def test_eval_of_a_maniskill_task_reports_its_own_conventions_too():
    """`hpcvla eval` of a ManiSkill task: success_once (= the success rate: the same steps up
    to the first success) and success_at_end, its episodes run to the horizon."""
    from hpcvla.evaluate import evaluate
    from hpcvla.roles.heldout import Episode, HeldOut
    cfg = load_config(ROOT / "configs/maniskill_pushcube.yaml",
                      ["env.camera=false", "env.max_episode_chunks=3", "rollout.segment_len=3"])
    held = HeldOut(cfg, 4, 4, 0, "cpu")
    try:
        result = held.report(held.run(deterministic=False)[0], False)
        assert result["success_once"] == result["success_rate"] and result["episodes"] == 4
        assert all(e["steps"] == 3 * 5 for e in result["per_episode"])  # to the horizon
        # the two conventions apart (the untrained policy succeeds nowhere): a success held
        # to the end, one knocked off the goal, a failure, an env fault (left out)
        mixed = held.report([Episode(0, True, 1.0, False, True, 15),
                             Episode(1, True, 1.0, False, False, 15),
                             Episode(2, False, 0.0, False, False, 15),
                             Episode(3, False, 0.0, True, False, 4)], False)
    finally:
        held.close()
    assert (mixed["success_once"], mixed["success_at_end"]) == (2 / 3, 1 / 3)
    assert mixed["success_rate"] == 2 / 3 and (mixed["episodes"], mixed["env_faults"]) == (3, 1)
    assert mixed["success_rate_faults_failed"] == 2 / 4  # the references' count
    reach = evaluate(load_config(ROOT / "configs/default.yaml"), None, episodes=2, envs=2)
    assert "success_at_end" not in reach  # reach has one convention: success ends it


@pytest.mark.parametrize("mode,dim,moves", [
    ("pd_joint_delta_pos", 8, "qpos"), ("pd_joint_target_delta_pos", 8, "qpos"),
    ("pd_joint_vel", 8, "qpos"), ("pd_joint_delta_pos_vel", 15, "qpos"),
    ("pd_ee_delta_pos", 4, "tcp"), ("pd_ee_target_delta_pos", 4, "tcp"),
    ("pd_ee_target_delta_pose", 7, "tcp")])
def test_each_maniskill_control_mode_steps_in_its_own_action_space(mode, dim, moves):
    """env.control_mode: the spec's action size and controller are ManiSkill's for the mode,
    and a positive first action moves what the mode controls (the first joint's angle, or
    the TCP along x) the way ManiSkill's controller does."""
    env = make_env("maniskill", 1, seed=0, task="PushCube-v1", camera=False, chunk_len=2,
                   control_mode=mode)
    try:
        assert env.spec.action_dim == dim and env.spec.controller == mode
        u = env.privileged_envs()[0]
        before = (u.agent.robot.get_qpos()[0, 0] if moves == "qpos"
                  else u.agent.tcp.pose.p[0, 0]).item()
        actions = np.zeros((1, 2, dim), np.float32)
        actions[..., 0] = 1.0
        result = env.step(actions)
        after = (u.agent.robot.get_qpos()[0, 0] if moves == "qpos"
                 else u.agent.tcp.pose.p[0, 0]).item()
        assert after - before > 0.005, (mode, before, after)
        assert result.obs["state"].shape == (1, env.spec.state_dim)
    finally:
        env.close()


def test_a_control_mode_the_project_cannot_drive_is_refused_by_name():
    with pytest.raises(ValueError, match=r"env.control_mode='pd_joint_pos': one of .*"
                                         r"pd_joint_delta_pos"):  # absolute: not [-1, 1]
        make_env("maniskill", 1, seed=0, task="PushCube-v1", control_mode="pd_joint_pos")
    with pytest.raises(ConfigError, match="env.control_mode = 'pd_ee_pose'.*normalized"):
        check_env(load_config(ROOT / "configs/maniskill_pushcube.yaml",
                              ["env.control_mode=pd_ee_pose"]))
    with pytest.raises(ConfigError, match="only maniskill has a choice of controllers"):
        load_config(ROOT / "configs/default.yaml", ["env.control_mode=pd_joint_delta_pos"])


def test_what_cannot_run_here_fails_clearly():
    with pytest.raises(RuntimeError, match="download_asset PickClutterYCB-v1"):
        make_env("maniskill", 1, seed=0, task="PickClutterYCB-v1")  # needs YCB: no prompt
    with pytest.raises(ValueError, match="unknown ManiSkill task 'NoSuchTask-v1'.*PickCube"):
        make_env("maniskill", 1, seed=0, task="NoSuchTask-v1")
    cfg = load_config(ROOT / "configs/libero_spatial.yaml", ["env.reward=dense",
                                                             "env.suite_task=10"])
    with pytest.raises(ConfigError) as err:
        check_env(cfg)
    assert "env.reward = 'dense'" in str(err.value) and "env.suite_task = 10" in str(err.value)
    with pytest.raises(ImportError, match="`not-installed-sim`.*make install"):
        require("not_installed_sim_module", "not-installed-sim", "sim")


@pytest.mark.mpi
@pytest.mark.parametrize("config, settings", [
    ("maniskill_pickcube_tokens.yaml", ["env.max_episode_chunks=2"]),  # episodes end in it
    # the suite's 10 tasks over the envs (one scene in libero_spatial): success per task, of
    # episodes that end inside the data trained (2 chunks)
    ("libero10_flow.yaml", ["env.suite=libero_spatial", "env.suite_task=-1",
                            "env.max_episode_chunks=2"])])
def test_train_runs_on_each_simulator(tmp_path, config, settings):
    """Two versions of `hpcvla train` on each real simulator with a VLA family, its envs in
    worker processes as the recipe has them. 50-60 s: building the ManiSkill scenes or the
    LIBERO tasks in every simulator's env process is most of it; one shard each (sharding:
    tests/test_pipeline.py). (Evaluation over a suite's tasks: tests/test_eval_job.py.)"""
    out = hpcvla("train", ROOT / "configs" / config, "--ranks", 4, f"run.root={tmp_path}",
                 "pipeline.total_updates=2", "env.envs_per_simulator=2", "env.shards=1",
                 "env.image_size=32", "env.max_episode_chunks=3", "learner.micro_batch=2",
                 "learner.micro_batches=1", "learner.epochs=1", "rollout.segment_len=2",
                 *settings, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[hpcvla] update 2/2" in out.stdout
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    sims = [r for r in summary["per_rank"] if r["role"] == "simulator"]
    assert len(sims) == 2 and all(r["env_steps"] > 0 for r in sims)
    assert sum(summary["staleness_hist"].values()) == 2 * 2  # updates x learner batch
    tasks = summary.get("per_task_success", {})
    libero = "libero" in config
    assert len(tasks) == (10 if libero else 0), tasks
    (learner,) = [r for r in summary["per_rank"] if r["role"] == "learner"]
    if not libero:  # PickCube's episode metric, through the slots and rings to the report
        assert learner["ended_episodes"] > 0 and 0.0 <= summary["episode_grasped"] <= 1.0
        assert "| grasped " in out.stdout, out.stdout[-2000:]
    else:  # every ended episode counted under the task of its instruction
        assert sum(t["episodes"] for t in tasks.values()) == learner["ended_episodes"] > 0
        assert sorted(t["episodes"] for t in tasks.values()) == [0] * 6 + [1] * 4  # 4 envs
        assert "[hpcvla] success per task" in out.stdout


@pytest.mark.slow  # a ManiSkill env built in a worker process: ~15 s
def test_the_spec_probe_of_gpu_simulation_builds_no_physx_scene_here():
    """SAPIEN refuses GPU simulation in a process that made a CPU PhysX scene; rank 0 probes
    the spec and may then simulate on the GPU: the probe's CPU env lives in a worker."""
    code = ("import sys; from hpcvla.config import load_config; from hpcvla.envs import env_spec;"
            "cfg = load_config(None, ['env.name=maniskill', 'env.task=PushCube-v1', "
            "'env.sim_backend=gpu', 'env.image_size=32']); spec = env_spec(cfg.env); "
            "print(spec.action_dim, 'sapien' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["7", "False"], out.stdout
