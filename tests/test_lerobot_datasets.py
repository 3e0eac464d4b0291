"""LeRobot datasets as SFT demonstrations (src/hpcvla/demonstrations/lerobot.py), against
what LeRobot's own LeRobotDataset returns for the same datasets: the fixtures
tests/fixtures/demonstrations/lerobot/ were written and read back by LeRobot 0.3.3 (format
v2.1) and 0.6.1 (v3.0), images as PNG in the parquet files or as AV1 video
(make_lerobot_fixtures.py there; reference.npz is LeRobot's reading)."""

import dataclasses
import json
import pickle
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpcvla.demonstrations import DemonstrationError, demonstration_problems, lerobot, \
    read_demonstrations, read_selection, select_demonstrations
from hpcvla.envs.libero import LiberoEnv
from hpcvla.text import tokenize
from helpers import FIXTURES

LEROBOT = FIXTURES / "demonstrations" / "lerobot"
DATASETS = ("images_v21", "video_v21", "images_v30", "video_v30")
CHUNK = 4


def libero_spec(state_format="axis_angle", **kwargs):
    """LIBERO-Goal's spec (its vocabulary holds the fixtures' two tasks) at the fixtures'
    64 px, both cameras, LeRobot's LIBERO state (8-d axis_angle)."""
    spec = LiberoEnv.spec_of(suite="libero_goal", image_size=64, wrist_image=True,
                             state_format=state_format, chunk_len=CHUNK)
    return dataclasses.replace(spec, **kwargs)


def keys(name):
    """The fixture's feature names for image, wrist_image, state, actions."""
    if name.startswith("images"):  # openpi's physical-intelligence/libero names
        return "image", "wrist_image", "state", "actions"
    return "observation.images.image", "observation.images.wrist_image", "observation.state", \
        "action"


@pytest.mark.parametrize("name", DATASETS)
def test_a_lerobot_dataset_reads_as_lerobot_reads_it(name):
    """Every frame's images (PNG, or AV1 decoded), state and task as LeRobotDataset[i] gives
    them; each frame's chunk starts with its own action (LeRobot's frame: the observation and
    the action taken from it) and repeats the episode's last one past its end, masked."""
    spec = libero_spec()
    assert demonstration_problems(LEROBOT / name, spec) == []
    demos = read_demonstrations(LEROBOT / name, spec)
    ref = np.load(LEROBOT / name / "reference.npz")
    image, wrist, state, action = keys(name)
    assert len(demos) == len(ref["index"]) == 21  # every frame a sample
    np.testing.assert_array_equal(demos.obs["image"], ref[image])
    np.testing.assert_array_equal(demos.obs["wrist_image"], ref[wrist])
    np.testing.assert_array_equal(demos.obs["state"], ref[state])
    assert demos.task == ["put the bowl on the plate", "open the top drawer of the cabinet",
                          "put the bowl on the plate"]
    assert list(demos.episode) == list(ref["episode_index"])
    for i, episode in enumerate(ref["episode_index"]):
        rows = np.flatnonzero(ref["episode_index"] == episode)
        ahead = np.minimum(i + np.arange(CHUNK), rows[-1])
        np.testing.assert_array_equal(demos.actions[i], ref[action][ahead])
        assert list(demos.pad[i]) == list(i + np.arange(CHUNK) > rows[-1])
        assert (demos.obs["instruction"][i] == tokenize(str(ref["task"][i]), spec.vocab,
                                                        9)).all()


def test_video_frames_are_the_added_frames_as_the_codec_keeps_them():
    """The decoded frames are the ones LeRobot added, up to AV1's loss (the fixture's: at most
    38 levels, 2.8 on average), in their order: a frame off by one is far further off."""
    demos = read_demonstrations(LEROBOT / "video_v30", libero_spec())
    added = np.load(LEROBOT / "video_v30" / "reference.npz")["observation.images.image__added"]
    error = np.abs(demos.obs["image"].astype(int) - added)
    assert error.mean() < 4
    shifted = np.abs(demos.obs["image"][1:].astype(int) - added[:-1])
    assert shifted.mean() > 5 * error.mean()


def test_the_gripper_becomes_ofts_convention_for_open_high():
    """LeRobot's LIBERO datasets hold LIBERO's -1 open / +1 closed: for env.gripper_action=
    open_high (OFT's +1 open / 0 closed) 1 - clip(g, 0, 1), the other dims as they are."""
    raw = read_demonstrations(LEROBOT / "images_v30", libero_spec())
    oft = read_demonstrations(LEROBOT / "images_v30", libero_spec(gripper="open_high"))
    assert set(np.unique(raw.actions[..., -1])) == {-1.0, 1.0}
    np.testing.assert_array_equal(oft.actions[..., :-1], raw.actions[..., :-1])
    np.testing.assert_array_equal(oft.actions[..., -1], 1 - np.clip(raw.actions[..., -1], 0, 1))


def test_the_scanned_dataset_is_the_one_loaded(monkeypatch):
    """The scan's metadata and gripper convention (every data file's actions read) serve the
    load: one LeRobot dataset opened per read, not one to check and one to load."""
    opened = []
    init = lerobot.Dataset.__init__
    monkeypatch.setattr(lerobot.Dataset, "__init__",
                        lambda self, *args, **kwargs: opened.append(init(self, *args, **kwargs)))
    read_demonstrations(LEROBOT / "images_v30", libero_spec(gripper="open_high"))
    assert len(opened) == 1


def test_a_selection_handed_to_another_reader_is_not_scanned_again(monkeypatch):
    """`hpcvla sft`: a host's first learner scans the headers and hands its selection
    (pickled) to the others, which read their parts from it: no dataset's metadata opened
    again, no data file's action column read again for the gripper convention; the same
    samples."""
    spec, path = libero_spec(gripper="open_high"), LEROBOT / "video_v30"
    selection = select_demonstrations(path, spec)
    whole = read_selection(selection, spec)
    handed = pickle.loads(pickle.dumps(selection))
    opened, columns = [], []
    init, read_table = lerobot.Dataset.__init__, pq.read_table
    monkeypatch.setattr(lerobot.Dataset, "__init__",
                        lambda self, *args, **kwargs: opened.append(init(self, *args, **kwargs)))
    monkeypatch.setattr(pq, "read_table", lambda *args, **kwargs: columns.append(
        kwargs.get("columns")) or read_table(*args, **kwargs))
    again = read_selection(handed, spec)
    assert not opened and columns and [keys("video_v30")[3]] not in columns, columns
    np.testing.assert_array_equal(again.actions, whole.actions)
    for field in whole.obs:
        np.testing.assert_array_equal(again.obs[field], whole.obs[field])
    assert again.task == whole.task and again.source == whole.source


def _copy(tmp_path, name="images_v21"):
    shutil.copytree(LEROBOT / name, tmp_path / name)
    return tmp_path / name


def test_a_dataset_without_negative_gripper_commands_is_refused_for_libero_convention(tmp_path):
    """Gripper commands none of which is below 0 (OFT's convention, say) would be misread by an
    env of LIBERO's: refused naming env.gripper_action."""
    dataset = _copy(tmp_path)
    for path in dataset.glob("data/*/*.parquet"):
        table = pq.read_table(path)
        actions = np.asarray(table["actions"].to_pylist(), np.float32)
        actions[:, -1] = (actions[:, -1] + 1) / 2
        column = table.schema.get_field_index("actions")
        pq.write_table(table.set_column(column, "actions", pa.array(
            list(actions), type=table.schema.field("actions").type)), path)
    problems = demonstration_problems(dataset, libero_spec())
    assert [(w.split(":", 1)[1], m) for w, _, m in problems] == [
        ("actions[:, -1]", "gripper commands of the env's convention (-1 open, +1 closed), as "
         "LeRobot's LIBERO datasets hold them: this dataset holds none below 0 (OFT's +1 open "
         "/ 0 closed?): env.gripper_action=open_high")]
    assert read_demonstrations(dataset, libero_spec(gripper="open_high")).actions[..., -1].min() \
        == 0


def test_what_does_not_fit_the_env_is_refused_naming_the_feature_and_the_fix():
    spec = libero_spec("quaternion")  # 9-d state
    spec = dataclasses.replace(spec, action_dim=6)  # (a field it lacks: the test below)
    problems = demonstration_problems(LEROBOT / "video_v21", spec)
    text = "\n".join(f"{w} = {v!r}: {m}" for w, v, m in problems)
    assert "video_v21:meta/info.json:features.observation.state.shape = [8]: (9,), the " \
        "env's state (LeRobot's LIBERO datasets hold 8 dims: env.state_format=axis_angle)" \
        in text, text
    assert "features.action.shape = [7]: (6,): action_dim of the spec" in text, text
    with pytest.raises(DemonstrationError):
        read_demonstrations(LEROBOT / "video_v21", spec)


def test_a_missing_camera_a_missing_video_and_an_old_format_are_refused(tmp_path):
    dataset = _copy(tmp_path, "video_v21")
    info = json.loads((dataset / "meta/info.json").read_text())
    info["features"]["observation.images.left"] = info["features"].pop(
        "observation.images.wrist_image")
    (dataset / "meta/info.json").write_text(json.dumps(info))
    (dataset / "videos/chunk-000/observation.images.image/episode_000001.mp4").unlink()
    text = "\n".join(f"{w} = {v!r}: {m}" for w, v, m in demonstration_problems(
        dataset, libero_spec()))
    assert "a feature for the spec's 'wrist_image' (one of observation.images.wrist_image, " \
        "observation.images.image2, wrist_image), or sft.features naming it" in text, text
    assert ":episode 1 = " in text and "episode_000001.mp4" in text and \
        "the video of observation.images.image" in text, text
    info["codebase_version"] = "v1.6"
    (dataset / "meta/info.json").write_text(json.dumps(info))
    assert "one of v2.0, v2.1, v3.0 (LeRobot's dataset formats read here)" in \
        demonstration_problems(dataset, libero_spec())[0][2]


def test_per_task_counts_episodes_by_their_task_and_a_list_mixes_datasets():
    spec = libero_spec()
    one = read_demonstrations(LEROBOT / "images_v30", spec, per_task=1)
    assert one.task == ["put the bowl on the plate", "open the top drawer of the cabinet"]
    assert len(one) == 7 + 5
    both = read_demonstrations([LEROBOT / "images_v21", LEROBOT / "video_v30"], spec)
    assert len(both) == 42 and len(both.task) == 6
    assert "images_v21 (LeRobot dataset, 3 demonstrations)" in both.source


def test_sft_features_name_the_feature_of_a_field(tmp_path):
    """A dataset of other feature names (a user's: here the wrist camera renamed `left_cam`)
    reads with sft.features naming it, the same frames; a named feature it lacks, a field no
    dataset gives, or a feature of the wrong kind is refused naming the setting."""
    dataset = _copy(tmp_path, "images_v30")
    info = json.loads((dataset / "meta/info.json").read_text())
    info["features"]["left_cam"] = info["features"].pop("wrist_image")
    (dataset / "meta/info.json").write_text(json.dumps(info))
    for path in dataset.glob("data/*/*.parquet"):
        table = pq.read_table(path)
        pq.write_table(table.rename_columns(["left_cam" if c == "wrist_image" else c
                                             for c in table.column_names]), path)
    spec = libero_spec()
    assert demonstration_problems(dataset, spec)  # wrist_image: no such feature
    demos = read_demonstrations(dataset, spec, features={"wrist_image": "left_cam"})
    ref = np.load(LEROBOT / "images_v30" / "reference.npz")
    np.testing.assert_array_equal(demos.obs["wrist_image"], ref["wrist_image"])
    np.testing.assert_array_equal(demos.obs["image"], ref["image"])
    text = "\n".join(f"{w} = {v!r}: {m}" for w, v, m in demonstration_problems(
        dataset, spec, features={"wrist_image": "right_cam", "depth": "x", "state": "image"}))
    assert "the feature right_cam that sft.features names for wrist_image" in text, text
    assert "sft.features = 'depth': one of image, wrist_image, state, actions" in text, text
    assert "features.image.dtype = 'image': a number vector for the spec's 'state'" in text, text

