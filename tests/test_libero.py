"""LIBERO's state formats: env.state_format=quaternion (9-d, the default) and axis_angle (8-d,
as openpi's LIBERO example and OpenVLA-OFT feed pi0/pi0.5/OFT checkpoints); its scenes, shared
by the envs of a process (envs/scenes.py)."""

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
    with pytest.raises(ConfigError, match=r"env.state_format = 'axis_angle': expected none: "
                                          r"env.name=reach does not read it \(libero does\)"):
        load_config(ROOT / "configs/libero_spatial.yaml",  # like env.suite: libero only
                    ["env.name=reach", "env.state_format=axis_angle"])
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


@pytest.mark.slow
def test_envs_of_one_scene_share_it_and_render_as_their_own_renderer_would():
    """libero_spatial's tasks are one scene: three envs of three tasks compile it once and
    share one renderer, each simulates its own copy of the model, and each env's images are
    exactly what a renderer made from its own model draws of it: also once env 1's stove is
    on, its flame (a site's colour in its model alone) in its images, in no other's."""
    users = _scene_users()  # envs other tests of this process left open count too
    env = make_env("libero", 3, seed=0, wrist_image=True,
                   **{**SETTINGS, "task": -1, "max_episode_chunks": 4, "image_size": 64})
    try:
        slots = env._slots
        assert [slot.task for slot in slots] == [0, 1, 2]
        (scene,) = {_scene_of(slot) for slot in slots}
        assert _scene_users().get(scene) == users.get(scene, 0) + 3
        assert len({id(slot.env.sim.model._model) for slot in slots}) == 3
        assert len({id(slot.renderer) for slot in slots}) == 1
        env.reset(init_state_ids=np.array([0, 1, 2]))
        obs = env.step(np.random.default_rng(0).uniform(-1, 1, (3, 1, 7))).obs
        _render_as_their_own_renderer_would(env, obs)
        sim = slots[1].env.sim
        sim.data.set_joint_qpos("flat_stove_1_button", 1.0)  # its knob turned: on
        sim.forward()
        lit = env.step(np.zeros((3, 1, 7))).obs
        flame = sim.model.site_name2id("flat_stove_1_burner")
        assert [slot.env.sim.model.site_rgba[flame][3] > 0 for slot in slots] == \
            [False, True, False]
        _render_as_their_own_renderer_would(env, lit)
    finally:
        env.close()
    assert _scene_users() == users  # the last env of a scene frees its model and renderer


def _scene_users() -> dict[str, int]:
    from hpcvla.envs import scenes
    return {key: scene["users"] for key, scene in scenes._scenes.items()}


def _scene_of(slot) -> str:
    from hpcvla.envs import scenes
    return getattr(slot.env.sim, scenes._SCENE_OF)


def _render_as_their_own_renderer_would(env, obs) -> None:
    import mujoco

    from hpcvla.envs.libero import CAMERAS
    for i, slot in enumerate(env._slots):
        size = obs["image"].shape[1]
        own = mujoco.Renderer(slot.env.sim.model._model, size, size)
        for camera, key in zip(CAMERAS, ("image", "wrist_image")):
            own.update_scene(slot.env.sim.data._data, camera=camera,
                             scene_option=slot.scene_option)
            assert np.array_equal(own.render()[:, ::-1], obs[key][i]), (i, key)
        own.close()  # its own context is the current one


@pytest.mark.slow
def test_a_scene_freed_when_its_last_env_leaves_spoils_no_other_scenes_images():
    """libero_object's tasks are a scene each: env 1 leaves task 1 for task 0 (the fixed
    states of task 0), its scene's renderer is closed, and both envs still render exactly
    (closing a MuJoCo renderer while another's context is current deletes that one's
    framebuffer: noise ever after)."""
    users = _scene_users()
    env = make_env("libero", 2, seed=0, wrist_image=True, **{
        **SETTINGS, "suite": "libero_object", "task": -1, "max_episode_chunks": 4})
    try:
        assert [slot.task for slot in env._slots] == [0, 1]
        task_0, task_1 = (_scene_of(slot) for slot in env._slots)
        assert task_0 != task_1 and users.get(task_1, 0) == 0
        env.reset(init_state_ids=np.array([0, 1]))
        assert [slot.task for slot in env._slots] == [0, 0] and task_1 not in _scene_users()
        obs = env.step(np.random.default_rng(0).uniform(-1, 1, (2, 1, 7))).obs
        _render_as_their_own_renderer_would(env, obs)
    finally:
        env.close()


@pytest.mark.slow
def test_a_lone_env_moves_between_tasks_of_one_scene_and_runs_the_task_asked():
    """libero_spatial's tasks share a scene: a process's only env leaving task 0 for task 1's
    fixed state 0 (eval.protocol=libero with --envs 1) loads task 1 in that scene. It was
    released before the new env counted as its user, deleted, and the reset failed: the slot
    was rebuilt on task 0 from a training placement, scored as task 1's state."""
    env = make_env("libero", 1, seed=0, **{**SETTINGS, "task": -1})
    try:
        env.reset(init_state_ids=np.array([0]))
        scene = _scene_of(env._slots[0])
        users = _scene_users()[scene]  # 1 in a process of its own
        env.reset(init_state_ids=np.array([50]))  # task 1, its fixed state 0
        assert not env.failures and env._slots[0].task == 1
        assert _scene_of(env._slots[0]) == scene and _scene_users()[scene] == users
        assert env.instructions() == [env._slots[0].suite.instructions[1]]
        assert not env.step(np.zeros((1, 1, 7), np.float32)).env_fault.any()
    finally:
        env.close()


def test_what_the_libero_protocol_cannot_run_is_refused_and_its_states_set_the_batch():
    """eval.protocol=libero: a task the suite lacks, a task named twice (its states would
    count twice) and more states than LIBERO fixes are refused before any rank starts,
    naming the setting; the envs an evaluation steps at once are the protocol's states
    (--episodes does not change them), no more than --envs."""
    from hpcvla.envs import check_env
    from hpcvla.roles.heldout import envs_at_once

    def refused(*overrides):
        with pytest.raises(ConfigError) as err:
            check_env(load_config(ROOT / "configs/libero_spatial.yaml",
                                  ["eval.protocol=libero", *overrides]))
        return str(err.value)
    assert "eval.tasks = '3,12': expected distinct task indices below 10" in \
        refused("eval.tasks=3,12")
    assert "a task named twice" in refused("eval.tasks=0,0")
    assert "eval.states_per_task = 60: expected at most 50" in \
        refused("eval.states_per_task=60")
    cfg = load_config(ROOT / "configs/libero_spatial.yaml",
                      ["eval.protocol=libero", "eval.tasks=0", "eval.states_per_task=2"])
    check_env(cfg)
    assert envs_at_once(cfg, 32, 128) == envs_at_once(cfg, 32, 1) == 2
    every = load_config(ROOT / "configs/libero_spatial.yaml", ["eval.protocol=libero"])
    assert envs_at_once(every, 32, 1) == 32 and envs_at_once(every, 600, 1) == 500


def test_every_suite_has_its_scene_count():
    """The memory model counts a rank's scenes from envs/scenes.py's table: every suite
    env.suite takes is in it, at most one scene per task."""
    from hpcvla.envs.libero_suites import STEP_LIMITS, SUITES, suite_tasks
    from hpcvla.envs.scenes import SCENES
    assert set(SCENES) == set(SUITES) == set(STEP_LIMITS)
    assert all(1 <= n <= suite_tasks(suite) for suite, n in SCENES.items())


def test_every_instruction_survives_the_env_vocabulary():
    """A published checkpoint's prompt is rebuilt from the env's instruction ids
    (policies/processor.py): every LIBERO instruction must come back word for word. (And
    each suite has the tasks pre-flight and eval.protocol=libero bound its indices by.)"""
    from hpcvla.envs.libero_suites import SUITES, Suite, suite_tasks
    from hpcvla.text import detokenize, tokenize
    for suite in SUITES:  # LIBERO-PRO's perturbed ones too
        tasks = Suite(suite)
        assert tasks.n_tasks == suite_tasks(suite), suite
        instructions, vocab = tasks.instructions, tasks.vocab
        for text in instructions:
            ids = tokenize(text, vocab, 64)
            assert detokenize(ids, vocab) == text.strip(), (suite, text)


def test_oft_on_libero_needs_oft_s_gripper_convention_and_nothing_else_may_use_it():
    """OpenVLA-OFT's LIBERO datasets say +1 open / 0 closed; LIBERO's controller, -1 open /
    +1 closed: OFT on libero needs env.gripper_action=open_high, and only it."""
    from hpcvla.preflight import check_config
    with pytest.raises(ConfigError, match="env.gripper_action = 'closed_high': expected "
                       "open_high for policy.name=oft on env.name=libero"):
        check_config(load_config(ROOT / "configs/libero_oft.yaml",
                                 ["env.gripper_action=closed_high"]))
    with pytest.raises(ConfigError, match="env.gripper_action = 'open_high'"):
        check_config(load_config(ROOT / "configs/libero_spatial.yaml",
                                 ["env.gripper_action=open_high"]))
    assert load_config(ROOT / "configs/libero_oft.yaml").env.gripper_action == "open_high"


@pytest.mark.slow
def test_a_state_starts_alike_whatever_its_slot_ran_and_oft_s_open_opens():
    """A soft reset kept the gripper's integrated command: a state's first observation
    depended on the episode its slot ran before (finger positions 2e-4 apart). And with
    open_high, OFT's 'open' (1.0) opens the fingers and its 'closed' (0.0) closes them, as
    OFT's and RLinf's evaluations turn them into LIBERO's -1 and +1. ~15 s: LIBERO envs."""
    chunk = dict(SETTINGS, chunk_len=10, max_episode_chunks=100)
    signed = make_env("libero", 1, seed=0, **chunk)
    oft = make_env("libero", 1, seed=0, gripper_action="open_high", **chunk)
    try:
        fresh = signed.reset(init_state_ids=np.array([3]))["state"][0]
        signed.reset(init_state_ids=np.array([5]))
        closing = np.zeros((1, 10, 7), np.float32)
        closing[..., 6] = 1.0  # LIBERO: close
        for _ in range(3):
            signed.step(closing)
        again = signed.reset(init_state_ids=np.array([3]))["state"][0]
        np.testing.assert_array_equal(fresh, again)

        def fingers(env, gripper):
            env.reset(init_state_ids=np.array([3]))
            action = np.zeros((1, 10, 7), np.float32)
            action[..., 6] = gripper
            env.step(action)
            return env.step(action).obs["state"][0][7:]  # finger positions (quaternion state)
        opened, closed = fingers(oft, 1.0), fingers(oft, 0.0)
        assert opened[0] - opened[1] > closed[0] - closed[1] + 0.01, (opened, closed)
        np.testing.assert_allclose(fingers(signed, -1.0), opened, atol=1e-6)  # LIBERO's open
    finally:
        signed.close()
        oft.close()


@pytest.mark.slow
def test_training_starts_from_the_benchmark_states_only_where_asked():
    """env.train_states=benchmark (RLinf's training starts): a random start and a grouped
    restart's id each begin at one of the task's fixed initial states, the same id at the
    same one; `sampled` (the default) never at one of them; other simulators refuse it."""
    from hpcvla.envs.base import EVAL_STATE_IDS
    from hpcvla.envs.libero_suites import Suite

    fixed = Suite("libero_spatial").init_states(0)

    def starts(train_states: str) -> list[int | None]:
        env = make_env("libero", 2, seed=0, settle_steps=0, train_states=train_states,
                       **SETTINGS)
        try:
            found = []
            for ids in (None, None, np.array([EVAL_STATE_IDS + 123] * 2)):
                env.reset(init_state_ids=ids)
                for slot in env._slots:
                    state = slot.env.sim.get_state().flatten()
                    found.append(next((i for i, row in enumerate(fixed)
                                       if np.allclose(row, state, atol=1e-9)), None))
            return found
        finally:
            env.close()
    benchmark = starts("benchmark")
    state = (EVAL_STATE_IDS + 123) // 10 % 50  # the grouped id's quotient by the 10 tasks
    assert None not in benchmark and benchmark[4] == benchmark[5] == state, benchmark
    assert len(set(benchmark[:4])) > 1, benchmark  # random starts: several states
    assert starts("sampled") == [None] * 6
    with pytest.raises(ConfigError, match="env.train_states"):
        load_config(ROOT / "configs/default.yaml", ["env.train_states=benchmark"])


def test_libero_imports_where_another_user_made_robosuites_log_file():
    """robosuite, imported, opens /tmp/robosuite.log for its DEBUG log: on a node where
    another user's job made that file first (0644) every LIBERO rank died with
    PermissionError. Here the file cannot be opened at all (as for that user); LIBERO imports,
    and robosuite logs to no file."""
    import subprocess
    import sys
    script = (
        "import logging, sys\n"
        "opened = logging.FileHandler.__init__\n"
        "def theirs(self, name, *a, **k):\n"
        "    if str(name) == '/tmp/robosuite.log':\n"
        "        raise PermissionError(13, 'Permission denied', name)\n"
        "    opened(self, name, *a, **k)\n"
        "logging.FileHandler.__init__ = theirs\n"
        "from hpcvla.envs.libero_suites import _import_libero\n"
        "_import_libero()\n"
        "from robosuite import macros\n"
        "import robosuite.utils.log_utils  # its loggers, made as robosuite first logs\n"
        "print(macros.FILE_LOGGING_LEVEL, [type(h).__name__ for h in "
        "logging.getLogger('robosuite_logs').handlers])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "None ['StreamHandler']", out.stdout
    # nor its warnings that no private macros file overrides the macros (the defaults are
    # what hpcvla runs it with): three lines on every plan and doctor of a LIBERO config
    assert "macro file" not in out.stderr, out.stderr
