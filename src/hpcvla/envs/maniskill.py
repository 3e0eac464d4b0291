"""`maniskill`: ManiSkill3 tasks (`mani-skill` 3.0.1, SAPIEN 3) behind the VectorEnv interface.

One ManiSkill env per slot (the CPU backend refuses num_envs > 1), stepped in this process by
`SerialVectorEnv`. Each primitive step runs the task in `obs_mode="state"` (~3 ms); the cameras
are rendered once per action chunk, after its last step (one 64 px camera ~30 ms on lavapipe,
base + wrist ~100 ms), with exactly the pixels the task's `rgb` mode would give.
`env.sim_backend=gpu` runs a whole shard as one GPU-batched ManiSkill env instead, with the
same fields, actions and episodes (maniskill_gpu.py).

Observation fields (per env):
    image        (S, S, 3)  |u1  the task's third-person camera (`base_camera`), S = image_size;
                                 not with camera=False (env.camera: state-only, nothing rendered)
    wrist_image  (S, S, 3)  |u1  only if wrist_image: the Panda hand camera (`panda_wristcam`)
    state        (D,)       <f4  only if state: with state_mode=privileged the task's flat `state`
                                 observation (robot qpos, qvel, task extras such as goal and
                                 object poses); with state_mode=visual what ManiSkill's camera
                                 obs modes give beside the pictures (state_vector)
    instruction  (L,)       <i4  token ids of the task description (TASK_DESCRIPTIONS)

Actions: one per primitive step in [-1, 1] (clipped), in the controller `control_mode` names
(ManiSkill's normalized control modes, CONTROL_MODES). The default,
`pd_ee_delta_pose`: end-effector translation (±0.1 m) and rotation (±0.1 rad) deltas, then,
for the Panda gripper, -1 closed / 1 open (7-d; the stick-holding Panda of PushT and
DrawTriangle has no gripper: 6-d). `pd_joint_delta_pos`: the 7 joint angles' deltas (±0.1
rad) + the gripper (8-d), ManiSkill's baselines' mode. The spec names the mode
(`EnvSpec.controller`); a mode the task's robot lacks, or whose actions are not normalized,
is refused at construction.
Reward per chunk: the sum over its steps of the task's `sparse` (1 on success) or
`normalized_dense` reward, or of that one's change per step (`dense_delta`: ShapingGain;
env.reward). An episode terminates on `info["success"]` (unless env.success_ends_episode is
false: then it runs on, every step's reward counted, `run_to_horizon`) and is truncated after
max_episode_chunks chunks (RL-VLA³ uses 80 steps; the tasks' own limit, e.g. 50 for
PickCube, is lifted). Initial states: ManiSkill's reset seed is the init_state_id itself
(same id, same initial state), or for a random start a training id drawn from the env's RNG
(envs/base.py), so no random start is an evaluation state.

Tasks that need no asset download with mani-skill 3.0.1 (checked by making and stepping each
one offline on CPU): NO_DOWNLOAD_TASKS. A task whose assets are missing fails at construction
with the download command instead of prompting for it.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys

import numpy as np

from hpcvla.config.families import EE_DELTA_CONTROL, MANISKILL_REWARDS
from hpcvla.envs.base import EnvSpec, training_state_ids
from hpcvla.envs.serial import SerialVectorEnv, require
from hpcvla.text import vocab_of, words

NO_DOWNLOAD_TASKS = (  # one robot, pd_ee_delta_pose, a success flag; made and stepped offline
    "DrawTriangle-v1", "FMBAssembly1Easy-v1", "LiftPegUpright-v1", "PegInsertionSide-v1",
    "PickCube-v1", "PlaceSphere-v1", "PlugCharger-v1", "PokeCube-v1", "PullCube-v1",
    "PullCubeTool-v1", "PushCube-v1", "PushT-v1", "RollBall-v1", "StackCube-v1",
    "StackPyramid-v1",
)
# The Panda's controllers (mani-skill 3.0.1) whose actions are normalized to [-1, 1], the range
# every simulator here clips a policy's actions to (env.control_mode); the absolute ones
# (pd_joint_pos, pd_ee_pose, pd_joint_pos_vel) take joint angles and metres and are left out
CONTROL_MODES = ("pd_ee_delta_pose", "pd_ee_delta_pos", "pd_ee_target_delta_pose",
                 "pd_ee_target_delta_pos", "pd_joint_delta_pos", "pd_joint_target_delta_pos",
                 "pd_joint_vel", "pd_joint_delta_pos_vel")
TASK_DESCRIPTIONS = {
    "PickCube-v1": "pick up the red cube and move it to the green goal",
    "PushCube-v1": "push the cube to the red and white target",
    "PullCube-v1": "pull the cube to the red and white target",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "PegInsertionSide-v1": "insert the peg into the hole on the side of the box",
    "PlugCharger-v1": "plug the charger into the receptacle",
    "LiftPegUpright-v1": "lift the peg and stand it upright",
    "PokeCube-v1": "use the peg to poke the cube to the goal",
    "PlaceSphere-v1": "place the sphere into the bin",
    "PullCubeTool-v1": "use the tool to pull the cube closer",
    "PushT-v1": "push the t shaped block onto the target",
    "RollBall-v1": "push the ball so it rolls to the goal",
    "StackPyramid-v1": "stack the three cubes into a pyramid",
    "DrawTriangle-v1": "draw the triangle on the table",
    "FMBAssembly1Easy-v1": "insert the part into the assembly board",
}


def describe(task: str) -> str:
    """The instruction of a task: TASK_DESCRIPTIONS, else its id split into words."""
    name = task.rsplit("-v", 1)[0]
    return TASK_DESCRIPTIONS.get(task) or " ".join(
        w.lower() for w in re.findall(r"[A-Z][a-z]+|[A-Z]+(?![a-z])|\d+", name))


def missing_assets(task: str) -> list[str]:
    """Asset ids the task declares and this machine lacks; raises ValueError if unknown."""
    require("mani_skill.envs", "mani-skill", "maniskill")
    from mani_skill.utils import assets
    from mani_skill.utils.registration import REGISTERED_ENVS
    if task not in REGISTERED_ENVS:
        raise ValueError(f"unknown ManiSkill task {task!r}; tasks that need no download: "
                         f"{', '.join(NO_DOWNLOAD_TASKS)}")
    ids = REGISTERED_ENVS[task].asset_download_ids or []
    return [a for a in ids if a in assets.DATA_GROUPS or not assets.is_data_source_downloaded(a)]


def _download_error(task: str, detail: str) -> RuntimeError:
    return RuntimeError(
        f"ManiSkill task {task} needs assets that are not on this machine ({detail}). "
        f"Download them once with `python -m mani_skill.utils.download_asset {task}` "
        f"(needs internet), or pick a task that needs none: {', '.join(NO_DOWNLOAD_TASKS)}")


def make_task_env(task: str, num_envs: int, sim_backend: str, render_backend: str,
                  image_size: int, wrist_image: bool, reward: str, horizon: int,
                  control_mode: str = EE_DELTA_CONTROL):
    """`gym.make` of a task with `num_envs` parallel envs (1 on CPU physics) in `obs_mode="state"`
    (cameras are rendered by `render_cameras`); fails with the download command, never prompts,
    and refuses a control mode the robot lacks naming env.control_mode."""
    import gymnasium as gym
    if control_mode not in CONTROL_MODES:
        raise ValueError(f"env.control_mode={control_mode!r}: one of {', '.join(CONTROL_MODES)} "
                         "(ManiSkill's control modes with actions normalized to [-1, 1])")
    missing = missing_assets(task)
    if missing:
        raise _download_error(task, ", ".join(missing))
    kwargs = dict(obs_mode="state", control_mode=control_mode, num_envs=num_envs,
                  sim_backend=sim_backend, render_backend=render_backend,
                  reward_mode="sparse" if reward == "sparse" else "normalized_dense",
                  sensor_configs=dict(width=image_size, height=image_size),
                  max_episode_steps=horizon + 1)  # we truncate; ManiSkill never does first
    if wrist_image:
        kwargs["robot_uids"] = "panda_wristcam"
    try:  # an empty stdin: ManiSkill's download prompt fails instead of waiting for "y"
        with contextlib.redirect_stdout(sys.stderr), _no_stdin():
            env = gym.make(task, **kwargs)
            return ShapingGain(env) if reward == "dense_delta" else env
    except (EOFError, FileNotFoundError) as err:
        raise _download_error(task, f"{type(err).__name__}: {err}") from err
    except AssertionError as err:  # ManiSkill asserts the mode is among its robot's
        if control_mode in str(err):
            raise ValueError(f"env.control_mode={control_mode}: ManiSkill task {task}'s robot "
                             f"has no such controller ({err})") from err
        raise


def render_cameras(u) -> list:
    """Every camera of the (unwrapped) env rendered once, as the `rgb` obs mode would: one
    (num_envs, S, S, 3) uint8 tensor per camera, task cameras first, then the robot's."""
    for obj in u._hidden_objects:  # e.g. goal markers, hidden from cameras as in `rgb` mode
        obj.hide_visual()
    u.scene.update_render(update_sensors=True, update_human_render_cameras=False)
    cameras = list(u.scene.sensors.values())
    for camera in cameras:
        camera.capture()
    return [camera.get_obs(rgb=True, depth=False, position=False, segmentation=False)["rgb"]
            for camera in cameras]


def state_vector(u, state_mode: str, privileged=None):
    """The flat `state` of every env of the (unwrapped) env `u` now, (num_envs, D):
    `privileged`, the task's `state` obs mode's (`privileged`: what the last step returned);
    `visual`, what ManiSkill's camera obs modes carry beside the pictures (the robot's
    proprioception and the task's extras short of the objects' poses: PickCube's goal, which
    its cameras hide), flattened as its FlattenRGBDObservationWrapper does. The env steps in
    `state` mode (no rendering per step), so the task is asked as an `rgb` mode env."""
    if state_mode != "visual":
        return privileged if privileged is not None else u.get_obs()
    from mani_skill.envs.utils.observations import parse_obs_mode_to_struct
    from mani_skill.utils.common import flatten_state_dict
    saved = u._obs_mode, u.obs_mode_struct  # tasks read either (mani-skill 3.0.1)
    u._obs_mode, u.obs_mode_struct = "rgb", parse_obs_mode_to_struct("rgb")
    try:
        return flatten_state_dict(u._get_obs_state_dict(u.get_info()), use_torch=True,
                                  device=u.device)
    finally:
        u._obs_mode, u.obs_mode_struct = saved


# The flags of a task's evaluate() an episode reports as an episode metric (EnvSpec.
# episode_metrics), where the task has them: 1.0 if the flag was set at some step of the
# episode (PickCube's `is_grasped`, StackCube's `is_cubeA_grasped`: how often the policy got
# hold of the cube, the step before success that sparse rewards do not show). A task has one
# flag per metric.
EPISODE_FLAGS = {"is_grasped": "grasped", "is_cubeA_grasped": "grasped"}


def episode_flags(evaluated: dict) -> list[str]:
    """The EPISODE_FLAGS a task reports (`evaluated`: its evaluate() or a step's info)."""
    return [flag for flag in EPISODE_FLAGS if flag in evaluated]


def task_spec(env, task: str, image_size: int, wrist_image: bool, state: bool,
              chunk_len: int, max_episode_chunks: int, camera: bool = True,
              state_mode: str = "privileged", success_ends_episode: bool = True) -> EnvSpec:
    """The EnvSpec of a made task env (either backend); ValueError if we cannot run the task.
    `camera` False: no `image` (state-only)."""
    u = env.unwrapped
    if wrist_image and len(u.scene.sensors) < 2:
        raise ValueError(f"ManiSkill task {task} has no wrist camera")
    space = env.action_space
    shape = getattr(space, "shape", None)
    evaluated = u.evaluate()
    if not shape or "success" not in evaluated:
        raise ValueError(f"ManiSkill task {task} is not a single-robot task with a "
                         f"success flag; tasks that work: {', '.join(NO_DOWNLOAD_TASKS)}")
    if not (np.all(space.low == -1) and np.all(space.high == 1)):  # the range actions clip to
        raise ValueError(f"env.control_mode={u.control_mode}: ManiSkill task {task} takes "
                         f"actions in [{space.low.min()}, {space.high.max()}], not [-1, 1]; "
                         f"choose a normalized mode ({', '.join(CONTROL_MODES)})")
    img = ((image_size, image_size, 3), "|u1")
    instruction = describe(task)
    obs = {**({"image": img} if camera else {}), **({"wrist_image": img} if wrist_image else {}),
           "instruction": ((len(words(instruction)),), "<i4")}
    if state:
        obs["state"] = ((int(state_vector(u, state_mode).shape[-1]),), "<f4")
    reward = "dense_delta" if isinstance(env, ShapingGain) else \
        "sparse" if u.reward_mode == "sparse" else "dense"
    return EnvSpec(obs=obs, action_dim=int(shape[-1]), chunk_len=chunk_len,
                   max_episode_chunks=max_episode_chunks, vocab=vocab_of([instruction]),
                   controller=u.control_mode, reward=reward,
                   success_ends_episode=success_ends_episode, episode_metrics=tuple(dict.fromkeys(
                       EPISODE_FLAGS[flag] for flag in episode_flags(evaluated))))


class ShapingGain:
    """env.reward=dense_delta around a ManiSkill env (any number of envs): each step's reward
    is the change of its normalized dense reward since the env's step before, from 0 at an
    episode's start (RLinf's relative reward). An episode then returns the shaping's last
    value, highest at success, which ends it: with the shaping itself an episode that stays
    just short of success until the horizon, unbootstrapped, returns more than one that
    succeeds (measured on PickCube: 31.3 against 7.1 from one start)."""

    def __init__(self, env):
        self.env, self.unwrapped = env, env.unwrapped
        self.previous = None  # the dense reward of each env's last step

    def reset(self, **kwargs):
        out = self.env.reset(**kwargs)
        index = (kwargs.get("options") or {}).get("env_idx")  # ManiSkill's partial reset
        if self.previous is not None:
            self.previous[slice(None) if index is None else index] = 0.0
        return out

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        gain = reward if self.previous is None else reward - self.previous
        self.previous = reward.clone()
        return obs, gain, terminated, truncated, info

    def close(self):
        self.env.close()

    def __getattr__(self, name):  # the spaces and the rest, as gymnasium's wrappers do
        return getattr(self.env, name)


class _Slot:
    """One ManiSkill env (num_envs=1, CPU physics)."""

    def __init__(self, task: str, image_size: int, wrist_image: bool, reward: str,
                 horizon: int, camera: bool = True, control_mode: str = EE_DELTA_CONTROL,
                 state_mode: str = "privileged"):
        import torch
        # render on the rank's GPU (devices.py bound it), not SAPIEN's default one
        render = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.env = make_task_env(task, 1, "cpu", render, image_size, wrist_image, reward,
                                 horizon, control_mode)
        self.u = self.env.unwrapped
        self.instruction = describe(task)
        self.camera, self.state_mode = camera, state_mode
        self.flags: dict[str, bool] = {}  # EPISODE_FLAGS the task has: set this episode

    def reset(self, rng, init_state_id):
        seed = training_state_ids(rng) if init_state_id is None else int(init_state_id)
        self.state, info = self.env.reset(seed=seed)
        self.flags = {flag: False for flag in episode_flags(info)}

    def step(self, action):
        self.state, reward, _, _, info = self.env.step(action[None])
        for flag in self.flags:
            self.flags[flag] |= bool(info[flag][0])
        return float(reward[0]), bool(info["success"][0])

    def episode_metrics(self) -> dict[str, float]:
        return {EPISODE_FLAGS[flag]: float(held) for flag, held in self.flags.items()}

    def observe(self) -> dict:
        """Every camera rendered once (what the `rgb` obs mode would return) plus the state;
        the state alone without the camera."""
        obs = {"state": state_vector(self.u, self.state_mode, self.state)[0].cpu().numpy()}
        if not self.camera:
            return obs
        images = [image[0].cpu().numpy() for image in render_cameras(self.u)]
        obs["image"] = images[0]
        if len(images) > 1:
            obs["wrist_image"] = images[-1]
        return obs

    def close(self):
        self.env.close()


@contextlib.contextmanager
def _no_stdin():
    saved, sys.stdin = sys.stdin, io.StringIO("")
    try:
        yield
    finally:
        sys.stdin = saved


class ManiSkillEnv(SerialVectorEnv):
    """`num_envs` copies of one ManiSkill3 task; see the module docstring."""

    @classmethod
    def config_kwargs(cls, env_cfg) -> dict:
        return dict(task=env_cfg.task, wrist_image=env_cfg.wrist_image, reward=env_cfg.reward,
                    sim_backend=env_cfg.sim_backend, control_mode=env_cfg.control_mode,
                    state_mode=env_cfg.state_mode,
                    success_ends_episode=env_cfg.success_ends_episode,
                    **({} if env_cfg.sim_backend == "gpu" else {  # the CPU env's
                        "max_rebuilds": env_cfg.max_restarts,
                        "rebuild_window_s": env_cfg.restart_window_s}),
                    **({} if env_cfg.camera else {"camera": False}))  # CPU env only

    @classmethod
    def config_problems(cls, env_cfg) -> list[tuple[str, object, str]]:
        """A control mode of CONTROL_MODES and a task whose assets are here."""
        if env_cfg.control_mode not in CONTROL_MODES:
            return [("env.control_mode", env_cfg.control_mode, f"one of "
                     f"{', '.join(CONTROL_MODES)} (ManiSkill's control modes whose actions are "
                     "normalized to [-1, 1]; the absolute ones take joint angles and metres)")]
        try:
            missing = missing_assets(env_cfg.task)
        except ValueError:
            missing = None
        if missing is None or missing:
            return [("env.task", env_cfg.task, "a ManiSkill3 task whose assets are here (no "
                     f"download needed: {', '.join(NO_DOWNLOAD_TASKS)})" +
                     (f"; or download {', '.join(missing)} first with `python -m "
                      f"mani_skill.utils.download_asset {env_cfg.task}`" if missing else ""))]
        return []

    @classmethod
    def uses_gpu(cls, env_cfg) -> bool:
        return True  # SAPIEN renders on the GPU (and simulates there with sim_backend=gpu)

    def __init__(self, num_envs: int, seed: int = 0, task: str = "PickCube-v1",
                 image_size: int = 64, wrist_image: bool = False, state: bool = True,
                 reward: str = "sparse", chunk_len: int = 5, max_episode_chunks: int = 16,
                 first_env: int = 0, camera: bool = True,
                 control_mode: str = EE_DELTA_CONTROL, max_rebuilds: int = 5,
                 state_mode: str = "privileged", rebuild_window_s: float = 0.0,
                 success_ends_episode: bool = True):
        if reward not in MANISKILL_REWARDS:
            raise ValueError(f"ManiSkillEnv: reward must be one of {MANISKILL_REWARDS}, "
                             f"got {reward!r}")
        horizon = chunk_len * max_episode_chunks

        def make_slot(_i):
            return _Slot(task, image_size, wrist_image, reward, horizon, camera, control_mode,
                         state_mode if state else "privileged")  # (the step's: no cost)

        first = make_slot(0)
        try:
            first.reset(np.random.default_rng(0), None)
            spec = task_spec(first.env, task, image_size, wrist_image, state, chunk_len,
                             max_episode_chunks, camera, state_mode, success_ends_episode)
        except BaseException:
            first.close()
            raise
        instruction = describe(task)
        self.task = task
        self.end_episodes_at_success(success_ends_episode)
        super().__init__(num_envs, seed, spec, len(words(instruction)), make_slot, first_env,
                         name=f"maniskill {task}", first_slot=first, max_rebuilds=max_rebuilds,
                         rebuild_window_s=rebuild_window_s)

    def privileged_envs(self) -> list:
        """The unwrapped ManiSkill env of every slot (one env each, batch dimension 1): the
        privileged state a scripted expert reads (object poses, goals, contacts;
        envs/experts.py), which a policy never sees. Read it; stepping or resetting it
        behind this env's back would desynchronize the episodes."""
        return [slot.u for slot in self._slots]
