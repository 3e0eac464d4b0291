"""LIBERO's state formats: env.state_format=quaternion (9-d, the default) and axis_angle (8-d,
as openpi's LIBERO example and OpenVLA-OFT feed pi0/pi0.5/OFT checkpoints)."""

import numpy as np
import pytest

from hpcvla.config import ConfigError, load_config
from hpcvla.envs import env_kwargs, env_spec, make_env
from helpers import ROOT

SETTINGS = dict(suite="libero_spatial", task=0, image_size=16, chunk_len=1,
                max_episode_chunks=2)


def test_state_format_setting_reaches_libero_only():
    cfg = load_config(ROOT / "configs/libero_spatial.yaml", [])
    assert cfg.env.state_format == "quaternion" and env_spec(cfg.env).obs["state"][0] == (9,)
    cfg = load_config(ROOT / "configs/libero_spatial.yaml", ["env.state_format=axis_angle"])
    assert env_kwargs(cfg.env)["state_format"] == "axis_angle"
    assert env_spec(cfg.env).obs["state"][0] == (8,)
    reach = load_config(ROOT / "configs/libero_spatial.yaml",
                        ["env.name=reach", "env.state_format=axis_angle"])
    assert "state_format" not in env_kwargs(reach.env)  # like env.suite: libero only
    with pytest.raises(ConfigError, match="env.state_format"):
        load_config(ROOT / "configs/libero_spatial.yaml", ["env.state_format=euler"])


@pytest.mark.slow
def test_axis_angle_state_is_robosuites_conversion_of_the_quaternion():
    # robosuite imports MuJoCo: only after hpcvla.envs.libero chose its GL backend (EGL)
    from robosuite.utils.transform_utils import quat2axisangle
    quaternion = make_env("libero", 1, seed=0, **SETTINGS)
    axis_angle = make_env("libero", 1, seed=0, state_format="axis_angle", **SETTINGS)
    try:
        assert quaternion.spec.obs["state"][0] == (9,)
        assert axis_angle.spec.obs["state"][0] == (8,)
        ids = np.array([7])  # the same fixed initial state in both
        nine = quaternion.reset(init_state_ids=ids)["state"][0]
        eight = axis_angle.reset(init_state_ids=ids)["state"][0]
    finally:
        quaternion.close()
        axis_angle.close()
    assert nine.shape == (9,) and eight.shape == (8,) and eight.dtype == np.float32
    pos, quat, gripper = nine[:3], nine[3:7].astype(np.float64), nine[7:]
    expected = np.concatenate([pos, quat2axisangle(quat.copy()), gripper])
    np.testing.assert_allclose(eight, expected, atol=1e-5)
    # robosuite's axis-angle: the quaternion's axis scaled by its angle 2 acos(w), which
    # for the downward-pointing gripper is close to pi (often slightly above: robosuite and
    # openpi keep MuJoCo's sign of w, so the norm lies in [0, 2 pi], not [0, pi])
    rotvec = eight[3:6].astype(np.float64)
    angle = np.linalg.norm(rotvec)
    np.testing.assert_allclose(angle, 2 * np.arccos(np.clip(quat[3], -1, 1)), atol=1e-4)
    np.testing.assert_allclose(rotvec / angle, quat[:3] / np.linalg.norm(quat[:3]), atol=1e-4)
    assert 0 <= angle <= 2 * np.pi and abs(angle - np.pi) < 0.3


def test_every_instruction_survives_the_env_vocabulary():
    """A published checkpoint's prompt is rebuilt from the env's instruction ids
    (policies/processor.py): every LIBERO instruction must come back word for word."""
    from hpcvla.envs.libero import SUITES, Suite
    from hpcvla.text import detokenize, tokenize
    for suite in SUITES:  # LIBERO-PRO's perturbed ones too
        tasks = Suite(suite)
        instructions, vocab = tasks.instructions, tasks.vocab
        for text in instructions:
            ids = tokenize(text, vocab, 64)
            assert detokenize(ids, vocab) == text.strip(), (suite, text)
