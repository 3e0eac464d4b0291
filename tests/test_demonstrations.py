"""Reading SFT demonstrations (src/hpcvla/demonstrations/): ManiSkill3 files recorded by
mani_skill's own RecordEpisode, LIBERO files written as LIBERO's create_dataset.py writes them
from a real LIBERO env (tests/fixtures/demonstrations/), and this project's own dumps written
by metrics/dump.py from the real `reach` env; each refusal names the file and the key."""

import dataclasses
import fcntl
import json
import shutil

import h5py
import numpy as np
import pytest
import yaml

from hpcvla.demonstrations import DemonstrationError, demonstration_problems, read_demonstrations
from hpcvla.demonstrations.common import axis_angle_to_quat
from hpcvla.demonstrations.libero import instruction_of
from hpcvla.envs.base import EnvSpec
from hpcvla.envs.libero import LiberoEnv, state_of
from hpcvla.envs.libero_suites import Suite
from hpcvla.envs.maniskill import describe
from hpcvla.metrics.dump import open_dump, summarize
from hpcvla.text import tokenize, vocab_of, words
from helpers import FIXTURES, reach_dump

DEMOS = FIXTURES / "demonstrations"
MS = DEMOS / "maniskill"
MS_MAIN = MS / "pushcube.rgb+state.pd_ee_delta_pose.h5"  # push (success), random, push
LIBERO = DEMOS / "libero"
LIBERO_TASK0 = next(LIBERO.glob("pick_up_the_black_bowl_between*_demo.hdf5"))  # 2 demos


def maniskill_spec(image_size=16, chunk_len=4, state=True, action_dim=7, wrist=False):
    """PushCube-v1's EnvSpec as envs/maniskill.py task_spec builds it (state: the task's
    35-d obs_mode=state vector), without a simulator."""
    instruction = describe("PushCube-v1")
    img = ((image_size, image_size, 3), "|u1")
    obs = {"image": img, **({"wrist_image": img} if wrist else {}),
           "instruction": ((len(words(instruction)),), "<i4")}
    if state:
        obs["state"] = ((35,), "<f4")
    return EnvSpec(obs=obs, action_dim=action_dim, chunk_len=chunk_len, max_episode_chunks=8,
                   vocab=vocab_of([instruction]))


def libero_spec(state_format="quaternion", image_size=16, chunk_len=4, wrist=True):
    return LiberoEnv.spec_of(suite="libero_spatial", image_size=image_size, wrist_image=wrist,
                             state_format=state_format, chunk_len=chunk_len)


def refused(paths, spec, *fragments, **kwargs):
    """The problems of `paths`, checked to name every fragment, and read_demonstrations
    refusing with the same lines."""
    problems = demonstration_problems(paths, spec, kwargs.get("per_task"))
    text = "\n".join(f"{w} = {v!r}: {m}" for w, v, m in problems)
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    with pytest.raises(ValueError) as err:
        read_demonstrations(paths, spec, **kwargs)
    assert isinstance(err.value, DemonstrationError)
    for where, _, message in problems:
        assert where in str(err.value) and message in str(err.value)
    return text


# ------------------------------------------------------------------------------ ManiSkill3

def test_maniskill_file_reads_into_the_spec():
    spec = maniskill_spec()
    assert demonstration_problems(MS_MAIN, spec) == []
    demos = read_demonstrations(MS_MAIN, spec)
    with h5py.File(MS_MAIN) as f:
        lengths = [f[f"traj_{i}/actions"].shape[0] for i in range(3)]
        actions0 = f["traj_0/actions"][()]
        state0 = f["traj_0/obs/state"][()]
    n = sum(lengths)  # one sample per step; the obs after the last action is dropped
    assert demos.actions.shape == (n, 4, 7) and demos.actions.dtype == np.float32
    assert demos.obs["image"].shape == (n, 16, 16, 3) and demos.obs["image"].dtype == np.uint8
    assert demos.obs["state"].shape == (n, 35) and demos.obs["state"].dtype == np.float32
    assert demos.obs["instruction"].shape == (n, 9)
    assert (demos.obs["instruction"] == tokenize(describe("PushCube-v1"), spec.vocab, 9)).all()
    assert demos.episode.tolist() == sum(([i] * k for i, k in enumerate(lengths)), [])
    assert demos.task == [describe("PushCube-v1")] * 3 and "RecordEpisode" in demos.source
    np.testing.assert_array_equal(demos.obs["state"][:lengths[0]], state0[:-1])
    np.testing.assert_array_equal(demos.actions[:lengths[0], 0], actions0)
    np.testing.assert_array_equal(demos.actions[5, 2], actions0[7])


def test_maniskill_demos_from_evaluation_seeds_are_named_once(capsys, monkeypatch):
    """ManiSkill's own demo scripts record from reset seeds 0, 1, 2, ...: hpcvla's ManiSkill
    evaluation states. A file of them is read, and said so, once per process."""
    from hpcvla.demonstrations import maniskill
    monkeypatch.setattr(maniskill, "_warned", set())
    spec = maniskill_spec()
    assert demonstration_problems(MS_MAIN, spec) == []
    read_demonstrations(MS_MAIN, spec)
    err = capsys.readouterr().err
    assert err.count("3 of 3 episodes start from reset seeds 0, 1, 2, ManiSkill states "
                     "hpcvla evaluates on") == 1, err


def test_maniskill_state_mode_file_gives_the_same_state():
    """obs_mode=state (obs is the flat vector) and rgb+state (obs/state) are the same vector:
    the same seed and scripted actions recorded both ways."""
    spec = maniskill_spec()
    spec = EnvSpec({k: v for k, v in spec.obs.items() if k != "image"}, 7, 4, 8, spec.vocab)
    flat = read_demonstrations(MS / "pushcube.state.pd_ee_delta_pose.h5", spec)
    both = read_demonstrations(MS_MAIN, spec, per_task=1)
    np.testing.assert_array_equal(flat.obs["state"], both.obs["state"])
    np.testing.assert_array_equal(flat.actions, both.actions)


def test_action_chunks_repeat_the_last_action_past_the_end():
    spec = maniskill_spec(chunk_len=6)
    demos = read_demonstrations(MS_MAIN, spec, per_task=1)
    with h5py.File(MS_MAIN) as f:
        actions = f["traj_0/actions"][()]
    T = len(actions)
    for back in range(1, 7):  # the last rows: `back` real actions, then the last repeated
        row = demos.actions[T - back]
        np.testing.assert_array_equal(row[:back], actions[T - back:])
        np.testing.assert_array_equal(row[back:], np.repeat(actions[-1:], 6 - back, 0))
        assert demos.pad[T - back].tolist() == [False] * back + [True] * (6 - back)
    assert not demos.pad[:T - 5].any()


def test_successful_only_and_per_task():
    spec = maniskill_spec()
    with open(MS_MAIN.with_suffix(".json")) as f:
        success = [e["success"] for e in json.load(f)["episodes"]]
    assert success == [True, False, True]
    ok = read_demonstrations(MS_MAIN, spec, successful_only=True)
    assert len(ok.task) == 2
    every = read_demonstrations(MS_MAIN, spec)
    np.testing.assert_array_equal(ok.actions, every.actions[every.episode != 1])
    first = read_demonstrations(MS_MAIN, spec, per_task=1, successful_only=True)
    assert len(first.task) == 1 and len(first) == (every.episode == 0).sum()
    two = read_demonstrations(MS_MAIN, spec, per_task=2, successful_only=True)
    np.testing.assert_array_equal(two.actions, ok.actions)
    # 3 asked, 2 successful: refused as a shortfall of all episodes is, not read short
    said = demonstration_problems(MS_MAIN, spec, per_task=3, successful_only=True)
    assert len(said) == 1 and "at least per_task=3 successful demonstrations of this task " \
        "(the files hold 2)" in said[0][2], said
    with pytest.raises(DemonstrationError, match="per_task=3 successful demonstrations"):
        read_demonstrations(MS_MAIN, spec, per_task=3, successful_only=True)
    assert demonstration_problems(MS_MAIN, spec, per_task=3) == []


def test_a_longer_horizon_continues_each_chunk_with_the_actions_after_it(tmp_path):
    """`hpcvla sft` of a policy whose horizon is longer than the chunk it acts (π0's, OFT's)
    reads that many actions from each observation, as the references train them: the
    demonstrated actions after the chunk within its episode, padded past its end. Per-step
    files (ManiSkill's) and a dump of one row per chunk (its next rows continue it) alike."""
    spec = maniskill_spec()  # chunks of 4
    chunk, long = (read_demonstrations(MS_MAIN, spec, horizon=h) for h in (None, 9))
    assert long.actions.shape[1:] == (9, 7) and len(long) == len(chunk)
    np.testing.assert_array_equal(long.actions[:, :4], chunk.actions)
    for k in range(len(long) - 5):
        if long.episode[k] == long.episode[k + 5] and not long.pad[k + 5, 0]:
            np.testing.assert_array_equal(long.actions[k, 5:9], chunk.actions[k + 5])
    last = np.flatnonzero(long.episode == long.episode[0])[-1]  # an episode's last sample
    assert long.pad[last].tolist() == [False] + [True] * 8
    _, reach = reach_dump(tmp_path / "rank0.h5")
    rows, windows = (read_demonstrations(tmp_path / "rank0.h5", reach, horizon=h)
                     for h in (None, 2 * reach.chunk_len))
    c = reach.chunk_len
    for k in range(len(rows) - 1):
        if rows.episode[k] == rows.episode[k + 1]:
            np.testing.assert_array_equal(windows.actions[k, c:], rows.actions[k + 1])
            assert not windows.pad[k].any()
        else:  # the episode's last row: nothing after it
            assert windows.pad[k].tolist() == [False] * c + [True] * c


def test_maniskill_control_mode_refused_naming_the_json_key():
    text = refused(MS / "pushcube.state.pd_joint_delta_pos.h5", maniskill_spec(),
                   "pushcube.state.pd_joint_delta_pos.json:env_info.env_kwargs.control_mode",
                   "'pd_joint_delta_pos'", "replay_trajectory", "-c pd_ee_delta_pose")
    assert "traj_0/actions = (4, 8)" in text  # and its 8-d joint actions


def test_maniskill_file_of_the_envs_control_mode_is_read():
    """env.control_mode=pd_joint_delta_pos: ManiSkill's joint-delta file fits, 8-d actions."""
    path = MS / "pushcube.state.pd_joint_delta_pos.h5"
    spec = maniskill_spec(action_dim=8)  # state only, as the file was recorded
    spec = dataclasses.replace(spec, controller="pd_joint_delta_pos",
                               obs={k: v for k, v in spec.obs.items() if k != "image"})
    demos = read_demonstrations(path, spec)
    with h5py.File(path) as f:
        np.testing.assert_array_equal(demos.actions[0], f["traj_0/actions"][:spec.chunk_len])
    refused(MS_MAIN, spec, "env_info.env_kwargs.control_mode = 'pd_ee_delta_pose'",
            "-c pd_joint_delta_pos", "or set env.control_mode=pd_ee_delta_pose")


def test_maniskill_control_mode_of_its_episodes_and_only_modes_the_env_takes(tmp_path):
    """A file whose env_kwargs lack the control mode is read by its episodes' (as ManiSkill's
    replay does; was: refused as None); a mode the env cannot act in (pd_joint_pos: not
    normalized) is not offered as a setting."""
    source = MS / "pushcube.state.pd_joint_delta_pos.h5"
    path = tmp_path / source.name
    shutil.copy(source, path)
    meta = json.loads(source.with_suffix(".json").read_text())
    mode = meta["env_info"]["env_kwargs"].pop("control_mode")
    path.with_suffix(".json").write_text(json.dumps(meta))
    spec = maniskill_spec(action_dim=8)
    spec = dataclasses.replace(spec, controller=mode,
                               obs={k: v for k, v in spec.obs.items() if k != "image"})
    assert all(e.get("control_mode") == mode for e in meta["episodes"])
    assert demonstration_problems(path, spec) == []
    for episode in meta["episodes"]:
        episode["control_mode"] = "pd_joint_pos"
    path.with_suffix(".json").write_text(json.dumps(meta))
    text = refused(path, spec, "control_mode = 'pd_joint_pos'", f"-c {mode}",
                   "give the file it writes beside it")
    assert "set env.control_mode=pd_joint_pos" not in text


def test_maniskill_without_obs_refused_naming_the_key():
    refused(MS / "pushcube.none.pd_ee_delta_pose.h5", maniskill_spec(),
            "pushcube.none.pd_ee_delta_pose.h5:traj_0/obs/state", "obs_mode='none'",
            "pushcube.none.pd_ee_delta_pose.h5:traj_0/obs/sensor_data/base_camera/rgb")


def test_maniskill_missing_wrist_camera_and_action_dim_refused():
    refused(MS_MAIN, maniskill_spec(wrist=True),
            f"{MS_MAIN}:traj_0/obs/sensor_data/hand_camera/rgb", "panda_wristcam")
    refused(MS_MAIN, maniskill_spec(action_dim=6), f"{MS_MAIN}:traj_0/actions = (29, 7)",
            "action_dim 6")


def test_unknown_words_refused_naming_them():
    spec = maniskill_spec()
    other = EnvSpec(spec.obs, 7, 4, 8, vocab_of(["pick up the red cube"]))
    refused(MS_MAIN, other, "pushcube.rgb+state.pd_ee_delta_pose.json:env_info.env_id",
            "unknown: and, push, target, to, white")


# ------------------------------------------------------------------------------ LIBERO

@pytest.mark.parametrize("state_format", ["quaternion", "axis_angle"])
def test_libero_file_reads_into_the_env_fields(state_format):
    spec = libero_spec(state_format)
    assert demonstration_problems(LIBERO, spec) == []
    demos = read_demonstrations(LIBERO, spec)
    with h5py.File(LIBERO_TASK0) as f:
        demo = f["data/demo_0"]
        T = demo["actions"].shape[0]
        agent, wrist = demo["obs/agentview_rgb"][()], demo["obs/eye_in_hand_rgb"][()]
        actions, robot = demo["actions"][()], demo["robot_states"][()]
        assert f["data"].attrs["macros_image_convention"] == "opengl"
    n = T - 1  # obs[k] is the scene AFTER actions[k]: the last has no executed chunk
    assert (demos.episode == 0).sum() == n and len(demos.task) == 3
    assert demos.actions.shape[1:] == (4, 7) and demos.actions.dtype == np.float32
    np.testing.assert_allclose(demos.actions[0], actions[1:5].astype(np.float32))
    for field, images in (("image", agent), ("wrist_image", wrist)):
        got = demos.obs[field][:n]
        assert got.shape == (n, 16, 16, 3) and got.dtype == np.uint8
    # 32 px fixture at the spec's 32 px: exactly the stored image rotated by 180 degrees
    same = read_demonstrations(LIBERO_TASK0, libero_spec(state_format, image_size=32),
                               per_task=1)
    np.testing.assert_array_equal(same.obs["image"], agent[:-1, ::-1, ::-1])
    np.testing.assert_array_equal(same.obs["wrist_image"], wrist[:-1, ::-1, ::-1])
    # the state the env would build from the same robosuite observation (robot_states holds
    # its gripper qpos, eef pos and eef quat, recorded beside ee_pos / ee_ori)
    expected = np.stack([state_of({"robot0_gripper_qpos": r[:2], "robot0_eef_pos": r[2:5],
                                   "robot0_eef_quat": r[5:9]}, state_format)
                         for r in robot[:-1]])
    assert demos.obs["state"].shape == (len(demos), 9 if state_format == "quaternion" else 8)
    np.testing.assert_allclose(demos.obs["state"][:n], expected, atol=1e-6)
    task = Suite("libero_spatial").instructions[0]
    assert demos.task[0] == task
    assert (demos.obs["instruction"][0] == tokenize(task, spec.vocab, 19)).all()


def test_libero_gripper_commands_become_the_policys_convention():
    """LIBERO's files say -1 open / +1 closed; a policy acting with env.gripper_action=
    open_high (OFT's +1 open / 0 closed) learns 1 - clip(g, 0, 1) of them, as OFT's LIBERO
    datasets hold, which the env turns back into LIBERO's command (was: taken as they are,
    every open a close)."""
    raw = read_demonstrations(LIBERO_TASK0, libero_spec("axis_angle"), per_task=1)
    oft = read_demonstrations(LIBERO_TASK0, dataclasses.replace(
        libero_spec("axis_angle"), gripper="open_high"), per_task=1)
    assert set(np.unique(raw.actions[..., -1])) == {-1.0, 1.0}
    np.testing.assert_array_equal(oft.actions[..., :-1], raw.actions[..., :-1])
    np.testing.assert_array_equal(oft.actions[..., -1], 1.0 - np.clip(raw.actions[..., -1], 0, 1))
    executed = -np.sign(2.0 * oft.actions[..., -1] - 1.0)  # what envs/libero.py steps
    np.testing.assert_array_equal(executed, raw.actions[..., -1])


def test_axis_angle_to_quat_undoes_robosuites_quat2axisangle():
    from robosuite.utils.transform_utils import axisangle2quat, quat2axisangle
    rng = np.random.default_rng(0)
    quats = rng.normal(size=(200, 4))
    quats /= np.linalg.norm(quats, axis=1, keepdims=True)  # both signs of w
    vectors = np.stack([quat2axisangle(q.copy()) for q in quats])
    np.testing.assert_allclose(axis_angle_to_quat(vectors), quats, atol=1e-12)
    np.testing.assert_allclose(axis_angle_to_quat(vectors),
                               np.stack([axisangle2quat(v) for v in vectors]), atol=1e-12)
    assert axis_angle_to_quat(np.zeros(3)).tolist() == [0, 0, 0, 1]


def test_libero_instruction_is_the_benchmarks_task_language():
    """Every task of every suite: the instruction from the BDDL file name is the one LIBERO's
    benchmark (and the env) gives the task."""
    for name in ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90"):
        suite = Suite(name)
        assert [instruction_of(path) for path in suite.bddl] == suite.instructions


def test_libero_per_task_counts_by_instruction():
    demos = read_demonstrations(LIBERO, libero_spec(), per_task=1)
    assert len(demos.task) == 2 and len(set(demos.task)) == 2
    refused(LIBERO, libero_spec(), f"{LIBERO.name}/pick_up_the_black_bowl_next_to",
            "at least per_task=2 demonstrations of this task (the files hold 1)", per_task=2)


def test_libero_missing_wrist_camera_refused(tmp_path):
    path = tmp_path / LIBERO_TASK0.name
    shutil.copy(LIBERO_TASK0, path)
    with h5py.File(path, "a") as f:
        for name in f["data"]:
            del f[f"data/{name}/obs/eye_in_hand_rgb"]
    text = refused(path, libero_spec(), f"{path}:/data/demo_0/obs/eye_in_hand_rgb",
                   "'wrist_image'", "(and in 1 more place")
    assert read_demonstrations(path, libero_spec(wrist=False)).obs.keys() == {
        "image", "instruction", "state"}, text


def test_libero_refusals_name_file_and_key():
    refused(LIBERO_TASK0, maniskill_spec(), f"{LIBERO_TASK0}:/data.attrs[bddl_file_name]",
            "unknown: between, black, bowl", "obs/state = 35")
    refused(LIBERO_TASK0, EnvSpec(libero_spec().obs, 6, 4, 8, libero_spec().vocab),
            f"{LIBERO_TASK0}:/data/demo_0/actions = (10, 7)", "action_dim 6")


# ------------------------------------------------------------------------------ own dumps

def test_hpcvla_dump_reads_chunk_rows(tmp_path):
    groups, spec = reach_dump(tmp_path / "rank0.h5")
    assert demonstration_problems(tmp_path / "rank0.h5", spec) == []
    with h5py.File(tmp_path / "rank0.h5", "a") as f:  # a run's dump records the chunks as
        f["data/demo_0/actions"][...] *= 3  # the policy drew them; the env ran them clipped
    demos = read_demonstrations(tmp_path / "rank0.h5", spec)
    with h5py.File(tmp_path / "rank0.h5") as f:
        demo = f["data/demo_0"]
        T = demo["actions"].shape[0]
        assert np.abs(demo["actions"][()]).max() > 1
        np.testing.assert_array_equal(demos.actions[:T], np.clip(demo["actions"][()], -1, 1))
        np.testing.assert_array_equal(demos.obs["image"][:T], demo["obs/image"][()])
        np.testing.assert_array_equal(demos.obs["instruction"][:T],
                                      demo["obs/instruction"][()])
        successes = [bool(f[f"data/{n}"].attrs["success"]) for n in f["data"]]
    assert not demos.pad.any() and len(demos.task) == len(successes)
    assert {k: v.dtype.str for k, v in demos.obs.items()} == {
        k: dt for k, (_, dt) in spec.obs.items()}
    assert not any(successes)  # random actions: no episode reached the target
    (problem,) = demonstration_problems(tmp_path / "rank0.h5", spec, successful_only=True)
    assert "at least one successful demonstration" in problem[2]  # named before any rank
    with pytest.raises(DemonstrationError, match="at least one successful demonstration"):
        read_demonstrations(tmp_path / "rank0.h5", spec, successful_only=True)
    with h5py.File(tmp_path / "rank0.h5", "a") as f:  # the success flag is what selects
        f["data/demo_1"].attrs["success"] = True
        rows = f["data/demo_1/actions"].shape[0]
        actions = f["data/demo_1/actions"][()]
    ok = read_demonstrations(tmp_path / "rank0.h5", spec, successful_only=True)
    assert len(ok.task) == 1  # that episode alone, every row of it
    np.testing.assert_array_equal(ok.actions, np.clip(actions, -1, 1))
    other = EnvSpec(spec.obs, spec.action_dim, spec.chunk_len + 1, 4, spec.vocab)
    refused(tmp_path / "rank0.h5", other, "rank0.h5:/.attrs[chunk_len] = 2", "chunk_len 3")


def _edit_dataset(f, key: str, edit) -> None:
    """Replace the dataset at `key` with `edit(its values)`."""
    value = edit(f[key][()])
    del f[key]
    f[key] = value


def _own_dump(tmp_path):
    reach_dump(tmp_path / "rank0.h5")
    return tmp_path / "rank0.h5", reach_dump(tmp_path / "spec.h5")[1], "/data/demo_0/obs/image"


def _libero_file(tmp_path):
    path = tmp_path / LIBERO_TASK0.name
    shutil.copy(LIBERO_TASK0, path)
    return path, libero_spec(), "/data/demo_0/obs/agentview_rgb"


def _maniskill_file(tmp_path):
    for name in (MS_MAIN, MS_MAIN.with_suffix(".json")):
        shutil.copy(name, tmp_path / name.name)
    return tmp_path / MS_MAIN.name, maniskill_spec(), "traj_0/obs/sensor_data/base_camera/rgb"


@pytest.mark.parametrize("layout", [_own_dump, _libero_file, _maniskill_file])
def test_images_of_another_dtype_and_rows_unpaired_with_actions_are_refused(tmp_path, layout):
    """Images stored as floats in [0, 1] were cast to uint8 on reading (black frames, SFT
    trained on them); an observation dataset a row longer than the layout pairs with its
    actions paired every later row with another step's, or the read died in a rank."""
    path, spec, images = layout(tmp_path)
    assert demonstration_problems(path, spec) == []
    with h5py.File(path, "a") as f:
        _edit_dataset(f, images, lambda x: x.astype(np.float32) / 255)
    refused(path, spec, f"{path}:{images} = 'float32'", "uint8 images (0-255)")
    shutil.rmtree(tmp_path), tmp_path.mkdir()
    path, spec, images = layout(tmp_path)
    with h5py.File(path, "a") as f:
        _edit_dataset(f, images, lambda x: np.concatenate([x, x[-1:]]))
    refused(path, spec, f"{path}:{images} = '", "rows against", "write it again")


@pytest.mark.parametrize("layout", [_own_dump, _libero_file, _maniskill_file])
def test_demonstrations_are_read_without_hdf5_file_locks(tmp_path, monkeypatch, layout):
    """HDF5 forgives a file system without locks only where flock answers ENOSYS: on NFS
    whose lock daemon is out of reach (ENOLCK) or Cray DVS (524) every locked open failed,
    and `hpcvla sft` could read no demonstration. hpcvla takes none (metrics/dump.open_hdf5):
    here another holder's exclusive lock stands, which any locked open runs into."""
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING", raising=False)  # (a user's: locks off anyway)
    path, spec, _ = layout(tmp_path)
    with open(path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(OSError, match="lock"):  # what a locked open meets
            h5py.File(path, "r", locking=True)
        assert demonstration_problems(path, spec) == []
        assert len(read_demonstrations(path, spec).task) > 0
        if layout is _own_dump:  # the dump's own reader too (`hpcvla inspect`)
            open_dump(path).close()


def test_a_file_named_twice_is_refused_not_read_twice(tmp_path):
    path, spec, _ = _own_dump(tmp_path)
    for twice in ([path, tmp_path / "." / path.name], [tmp_path, path]):
        refused(twice, spec, f"{twice[1]} = None: each file or dataset once")


def test_own_dump_actions_of_another_chunk_length_are_refused(tmp_path):
    path, spec, _ = _own_dump(tmp_path)
    with h5py.File(path, "a") as f:
        _edit_dataset(f, "data/demo_0/actions", lambda x: x[:, :1])
    refused(path, spec, f"{path}:/data/demo_0/actions = (", f"(T, {spec.chunk_len}, "
            f"{spec.action_dim}): chunks of env.chunk_len actions")


def test_samples_and_their_bytes_are_known_from_the_headers_and_bounded_by_memory(tmp_path):
    """Every layout tells from its headers how many samples a read gives (LIBERO: T - 1 per
    episode; ManiSkill: T; LeRobot: each episode's length; a dump: its chunk rows), so the
    memory they take is known before any rank starts: more than half a host's memory (one
    copy per host, two while it is read), or more than its free /dev/shm (where the copy
    lives), is refused, naming sft.per_task."""
    from hpcvla.demonstrations import demonstration_rows, sample_bytes
    from test_lerobot_datasets import LEROBOT, libero_spec as lerobot_spec
    _, dump_spec = reach_dump(tmp_path / "rank0.h5")
    cases = [(LIBERO, libero_spec()), (MS_MAIN, maniskill_spec()),
             (LEROBOT / "video_v30", lerobot_spec()), (LEROBOT / "images_v21", lerobot_spec()),
             (tmp_path / "rank0.h5", dump_spec)]
    for path, spec in cases:
        demos = read_demonstrations(path, spec)
        assert demonstration_rows(path, spec) == len(demos), path
        held = sum(a.nbytes for a in demos.arrays().values())
        assert sample_bytes(spec) * len(demos) == held, path
        need = held * 2
        assert demonstration_problems(path, spec, host_memory=need) == []
        ((where, value, fix),) = demonstration_problems(path, spec, host_memory=need - 1)
        assert where.startswith(str(path)) and value.startswith(f"{len(demos)} samples") and \
            "at most half this host's" in fix and "sft.per_task" in fix, (where, value, fix)
        assert demonstration_problems(path, spec, shm=held) == []
        ((_, _, fix),) = demonstration_problems(path, spec, shm=held - 1)
        assert "free beside MPI's own 64 MiB, where the one copy lives" in fix and \
            "sft.per_task" in fix


def test_parts_of_a_read_are_the_whole_read_in_order():
    """n readers of one selection (`part`, as `hpcvla sft`'s learners of a host share it):
    their parts, whole demonstrations of about equal samples, are the whole read in order;
    the tasks and demonstration indices are the whole selection's; none is more than one
    demonstration over an equal share."""
    from test_lerobot_datasets import LEROBOT, libero_spec as lerobot_spec
    for path, spec in ((LIBERO, libero_spec()), (LEROBOT / "video_v21", lerobot_spec())):
        whole = read_demonstrations(path, spec)
        for n in (2, 3, len(whole.task) + 2):
            parts = [read_demonstrations(path, spec, part=(r, n)) for r in range(n)]
            assert all(p.task == whole.task and p.source == whole.source for p in parts)
            for key in whole.obs:
                np.testing.assert_array_equal(np.concatenate([p.obs[key] for p in parts]),
                                              whole.obs[key])
            for key in ("actions", "pad", "episode"):
                np.testing.assert_array_equal(
                    np.concatenate([getattr(p, key) for p in parts]), getattr(whole, key))
            longest = np.bincount(whole.episode).max()  # a part is whole demonstrations
            assert max(map(len, parts)) <= len(whole) / n + longest, (path, n)
            assert all(p.obs[k].dtype == whole.obs[k].dtype for p in parts for k in whole.obs)


def test_a_file_without_episodes_is_refused(tmp_path):
    """A dump whose /data holds no episode: nothing to learn from, named before any rank."""
    _, spec = reach_dump(tmp_path / "rank0.h5")
    with h5py.File(tmp_path / "rank0.h5", "a") as f:
        for name in list(f["data"]):
            del f["data"][name]
    refused(tmp_path / "rank0.h5", spec, "at least one demonstration (the files hold no "
            "episodes)")


def test_a_dump_recorded_in_another_control_mode_is_refused(tmp_path):
    """Two ManiSkill modes can share an action size (pd_ee_delta_pose and its target variant:
    7-d) and mean different things: the file's resolved config says which it was."""
    _, spec = reach_dump(tmp_path / "rank0.h5")
    target = dataclasses.replace(spec, controller="pd_ee_target_delta_pose")
    for env in ({"name": "maniskill", "control_mode": "pd_ee_delta_pose"},
                {"name": "maniskill"}):  # written before the setting: the one mode there was
        with h5py.File(tmp_path / "rank0.h5", "a") as f:
            f["starts/0"].attrs["config"] = yaml.safe_dump({"env": env})
        refused(tmp_path / "rank0.h5", target,
                "rank0.h5:/starts/0.attrs[config].env.control_mode = 'pd_ee_delta_pose'",
                "set env.control_mode=pd_ee_delta_pose or record the demos with "
                "env.control_mode=pd_ee_target_delta_pose")
    assert demonstration_problems(tmp_path / "rank0.h5",
                                  dataclasses.replace(spec, controller="pd_ee_delta_pose")) == []


def test_prior_data_recorded_under_another_reward_is_refused(tmp_path):
    """RLPD's prior data (outcomes) must pay the env's reward: a dump recorded with
    env.reward=dense holds the shaping (up to 1 a step), under dense_delta its change. Refused
    naming the setting; for `hpcvla sft` (actions only) the reward does not matter; a config
    without the setting was recorded with ManiSkill's default, sparse."""
    _, spec = reach_dump(tmp_path / "rank0.h5")
    delta = dataclasses.replace(spec, reward="dense_delta")
    for env, recorded in (({"name": "maniskill", "reward": "dense"}, "dense"),
                          ({"name": "maniskill"}, "sparse")):
        with h5py.File(tmp_path / "rank0.h5", "a") as f:
            f["starts/0"].attrs["config"] = yaml.safe_dump({"env": env})
        with pytest.raises(DemonstrationError) as err:
            read_demonstrations(tmp_path / "rank0.h5", delta, outcomes=True)
        assert f"rank0.h5:/starts/0.attrs[config].env.reward = '{recorded}'" in str(err.value)
        assert "record the demos again with env.reward=dense_delta" in str(err.value)
        assert demonstration_problems(tmp_path / "rank0.h5", delta) == []  # sft: actions
    assert demonstration_problems(tmp_path / "rank0.h5", dataclasses.replace(
        spec, reward="sparse"), outcomes=True) == []


def test_prior_data_whose_episodes_end_elsewhere_is_refused(tmp_path):
    """RLPD's prior data must end its episodes where the env does: recorded with success a
    terminal (env.success_ends_episode=true, and every file from before the setting) for an
    env whose episodes run on to the horizon, a critic would learn two values of success.
    Refused naming the setting, both ways; not for `hpcvla sft` (actions only)."""
    _, spec = reach_dump(tmp_path / "rank0.h5")
    on = dataclasses.replace(spec, reward="dense", success_ends_episode=False)
    for env, recorded in (({"name": "maniskill", "reward": "dense"}, True),
                          ({"name": "maniskill", "reward": "dense",
                            "success_ends_episode": True}, True)):
        with h5py.File(tmp_path / "rank0.h5", "a") as f:
            f["starts/0"].attrs["config"] = yaml.safe_dump({"env": env})
        with pytest.raises(DemonstrationError) as err:
            read_demonstrations(tmp_path / "rank0.h5", on, outcomes=True)
        assert f"rank0.h5:/starts/0.attrs[config].env.success_ends_episode = {recorded}" \
            in str(err.value) and "its episodes end at success; record the demos again " \
            "with env.success_ends_episode=False" in str(err.value), str(err.value)
        assert demonstration_problems(tmp_path / "rank0.h5", on) == []  # sft: actions
    with h5py.File(tmp_path / "rank0.h5", "a") as f:
        f["starts/0"].attrs["config"] = yaml.safe_dump(
            {"env": {"name": "maniskill", "reward": "dense", "success_ends_episode": False}})
    assert demonstration_problems(tmp_path / "rank0.h5", on, outcomes=True) == []
    assert "run on past success" in str(demonstration_problems(tmp_path / "rank0.h5",
                                         dataclasses.replace(on, success_ends_episode=True),
                                         outcomes=True))


def test_a_libero_dump_of_the_other_gripper_convention_is_refused(tmp_path):
    """A dump recorded with one env.gripper_action, read for the other: its gripper values
    mean the opposite (an OFT run's +1 opens, LIBERO's closes), so it is refused naming the
    setting; a config without the setting was recorded with the simulator's closed_high."""
    _, spec = reach_dump(tmp_path / "rank0.h5")
    oft = dataclasses.replace(spec, gripper="open_high")
    with h5py.File(tmp_path / "rank0.h5", "a") as f:
        f["starts/0"].attrs["config"] = yaml.safe_dump({"env": {"name": "libero"}})
    refused(tmp_path / "rank0.h5", oft, "rank0.h5:/starts/0.attrs[config].env.gripper_action = "
            "'closed_high'", "set env.gripper_action=closed_high or record the demos with "
            "env.gripper_action=open_high")
    with h5py.File(tmp_path / "rank0.h5", "a") as f:  # a file before starts/: the root's
        f.attrs["config"] = f["starts/0"].attrs["config"]
        del f["starts"]
    refused(tmp_path / "rank0.h5", oft, "rank0.h5:/.attrs[config].env.gripper_action = "
            "'closed_high'", "set env.gripper_action=closed_high")
    assert demonstration_problems(tmp_path / "rank0.h5",
                                  dataclasses.replace(spec, gripper="closed_high")) == []


def test_unknown_layout_refused(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=np.zeros((2, 4, 4, 3), np.uint8))
    refused(path, maniskill_spec(), f"{path}:/", "problem_info", "traj_<i>", "format=")
    refused(tmp_path / "missing.h5", maniskill_spec(), "missing.h5", "no such file")


def test_openvlas_regenerated_libero_files_are_named_not_misread(tmp_path):
    """OpenVLA-OFT's regenerate_libero_dataset.py writes LIBERO's datasets without the /data
    attributes, and each observation before its action: refused saying so (the generic
    message invited adding LIBERO's attributes, and every sample would be a step late)."""
    path = tmp_path / "pick_up_the_black_bowl_demo.hdf5"
    shutil.copy(LIBERO_TASK0, path)
    with h5py.File(path, "a") as f:
        for name in list(f["data"].attrs):
            del f["data"].attrs[name]
    refused(path, libero_spec(), "regenerate_libero_dataset.py", "observations come before")


@pytest.mark.parametrize("marker,named", [("data/chunk-000/episode_000000.parquet", None),
                                          ("dataset_info.json", "an RLDS/TFDS dataset"),
                                          ("1.0.0/dataset_info.json", "an RLDS/TFDS dataset")])
def test_datasets_of_formats_not_read_are_named(tmp_path, marker, named):
    """RLDS datasets, the ones users of OFT have for LIBERO, are refused saying what they are
    and that they are not read (were: "a readable HDF5 file: OSError"), and a LeRobot
    dataset's parquet file given alone saying that the dataset is read as its folder (LeRobot
    datasets: tests/test_lerobot_datasets.py)."""
    (tmp_path / marker).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / marker).write_text("{}")
    given = tmp_path / marker if named is None else tmp_path  # a parquet file itself
    refused(given, libero_spec(), named or "a parquet file (a LeRobot dataset is given as its "
            "folder, the one holding meta/info.json)", "not read here (docs/imitation.md)")


def test_a_success_mid_chunk_leaves_the_rest_of_its_chunk_out(tmp_path):
    """reach's expert succeeds inside a chunk: the env reports the steps that ran
    (StepResult.chunk_steps), the file the episode's `env_steps`, and a read makes the last
    chunk's actions after the success padding, at the chunk and at a longer horizon."""
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.imitation.recording import record
    from helpers import ROOT
    cfg = load_config(ROOT / "configs/default.yaml")
    said = record(cfg, 8, tmp_path / "demos.h5")
    spec = env_spec(cfg.env)
    c = spec.chunk_len
    rows, windows = (read_demonstrations(tmp_path / "demos.h5", spec, horizon=h)
                     for h in (None, 2 * c))
    with h5py.File(tmp_path / "demos.h5") as f:
        demos = [f[f"data/{n}"] for n in sorted(f["data"], key=lambda n: int(n[5:]))]
        ran = [(d["actions"].shape[0], int(d.attrs["env_steps"])) for d in demos]
    ends = np.flatnonzero(np.diff(rows.episode, append=-1))  # each episode's last row
    assert len(ends) == len(ran) and any(n % c for _, n in ran)  # some end mid-chunk
    summary = summarize(tmp_path / "demos.h5")  # what `hpcvla inspect` says ran
    assert summary["env_steps"] == said["env_steps"] == sum(n for _, n in ran) < said["steps"] * c
    for end, (T, n) in zip(ends, ran):
        k = n - (T - 1) * c  # the last chunk's steps that ran
        assert 1 <= k <= c
        assert rows.pad[end].tolist() == [False] * k + [True] * (c - k)
        assert windows.pad[end].tolist() == [False] * k + [True] * (2 * c - k)
        if T > 1:  # the row before reads the ran part of the last chunk after its own
            assert windows.pad[end - 1].tolist() == [False] * (c + k) + [True] * (c - k)


def test_a_recording_makes_the_folder_of_its_out_file(tmp_path):
    """`hpcvla demos --out new/demos.h5`: the folder is made (its os.open ended in a
    FileNotFoundError traceback)."""
    from hpcvla.config import load_config
    from hpcvla.imitation import recording
    from helpers import ROOT
    said = recording.record(load_config(ROOT / "configs/default.yaml"), 1,
                            tmp_path / "new" / "demos.h5")
    assert said["episodes"] == 1 and (tmp_path / "new" / "demos.h5").is_file()


def test_two_recordings_given_one_out_file_do_not_both_write_it(tmp_path, monkeypatch):
    """`hpcvla demos --out F` checked that F did not exist seconds before it made F (after
    building the env): a second job given the same F in between passed the check too, and
    one appended to the other's file as if resuming it. The name is claimed at the check now:
    the second is refused while the first builds its env, and a recording that fails before
    its dump exists leaves no claim behind."""
    from hpcvla.config import load_config
    from hpcvla.imitation import recording
    from helpers import ROOT
    cfg = load_config(ROOT / "configs/default.yaml")
    out, built = tmp_path / "demos.h5", recording._env
    refused = []

    def env_while_another_job_starts(config):
        with pytest.raises(recording.RecordingError, match="--out .*demos.h5: exists"):
            recording.record(cfg, 2, out)  # another job, given the same --out, meanwhile
        refused.append(True)
        return built(config)
    monkeypatch.setattr(recording, "_env", env_while_another_job_starts)
    said = recording.record(cfg, 3, out)
    assert refused and said["episodes"] == 3 and summarize(out)["episodes"] == 3
    with h5py.File(out) as f:
        assert list(f["starts"]) == ["0"]  # one writer's file, not a resumed one

    def no_env(config):
        raise recording.RecordingError("no such env here")
    monkeypatch.setattr(recording, "_env", no_env)
    with pytest.raises(recording.RecordingError, match="no such env here"):
        recording.record(cfg, 2, tmp_path / "other.h5")
    assert not (tmp_path / "other.h5").exists()
    # a recording killed outright before its dump began leaves its claim: said as one
    from hpcvla.envs import env_spec
    (tmp_path / "killed.h5").touch()
    with pytest.raises(DemonstrationError, match=r"killed.h5.*an empty file \(an `hpcvla demos "
                                                 r"--out` killed before its first episode"):
        read_demonstrations(tmp_path / "killed.h5", env_spec(cfg.env))
