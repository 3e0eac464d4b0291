"""Scripted experts for ManiSkill3 tasks (and `reach`'s oracle): controllers that read each
env's privileged state (object poses, the goal, the TCP pose, contacts) and return action
chunks, for recording imitation demonstrations (`hpcvla demos`, imitation/recording.py).

Measured success (`hpcvla demos configs/maniskill_pickcube.yaml [env.task=PushCube-v1]
--episodes 128`: 128 training initial states each, chunk_len 5, max_episode_chunks 16 = 80
steps; docs/imitation.md):
    PushCube-v1   1.000 (128/128; mean 3.0 chunks), with --noise 0.1: 1.000 (128/128)
    PickCube-v1   1.000 (128/128; mean 8.0 chunks), with --noise 0.1: 0.992 (127/128)

Closed loop per chunk, extrapolated within it. The env executes a whole chunk per
`env.step` and observes only after it, exactly as for the policy that learns from the
demonstrations, so a recorded chunk must be a function of the observation it is stored with.
The expert therefore reads the true state once per chunk and plans the chunk's steps on a
nominal model of the arm (TRACKING, LAG, ROTATION below), in which a grasped or pushed cube
moves with the TCP and nothing else moves. The model's errors are corrected at the next
chunk, 5 steps (0.25 s) later.

Frames: the Panda stands at (-0.615, 0, 0) with the world's orientation, so a world
displacement is the translation delta `pd_ee_delta_pose` takes (its root frame), and a
world rotation vector is the rotation delta times ROTATION (negative: +1 turns the gripper
about the opposite world axis, measured). Gripper: ManiSkill's Panda gripper maps -1 to
closed, 1 to open.
"""

from __future__ import annotations

import numpy as np

from hpcvla.config.families import EE_DELTA_CONTROL

STEP_M, STEP_RAD = 0.1, 0.1  # what an action of 1 means: metres, radians per primitive step
# The nominal arm, measured on PickCube-v1 (one step = 5 physics steps at 100 Hz): a commanded
# translation moves the TCP by TRACKING of it, LAG of that in the step after (0.55 and 0.45
# of 0.021 m for a steady 0.05 m command), and a commanded rotation turns it at once by
# ROTATION of it, about the opposite world axis (+1 on the yaw action: -0.039 rad about z).
TRACKING, LAG, ROTATION = 0.42, 0.45, -0.39
# Of the move that would reach the target in one step; with the lag, a higher gain
# overshoots. Commands stay within SPEED: faster, the arm gathers momentum the model lacks
# and the IK drifts sideways (a full-speed descent moved the TCP 0.015 m the wrong way).
GAIN, SPEED = 0.5, 0.6
OPEN, CLOSE = 1.0, -1.0


def _rotation(q) -> np.ndarray:
    """The 3x3 rotation matrix of a wxyz quaternion."""
    w, x, y, z = np.asarray(q, dtype=np.float64) / np.linalg.norm(q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def _turn(rotvec: np.ndarray) -> np.ndarray:
    """The rotation matrix of a rotation vector (Rodrigues)."""
    angle = np.linalg.norm(rotvec)
    if angle < 1e-12:
        return np.eye(3)
    x, y, z = rotvec / angle
    k = np.array([[0, -z, y], [z, 0, -x], [-y, x, 0]])
    return np.eye(3) + np.sin(angle) * k + (1 - np.cos(angle)) * k @ k


def _numpy(tensor) -> np.ndarray:
    return tensor[0].detach().cpu().numpy().astype(np.float64)


def yaw_of(rot: np.ndarray) -> float:
    """The heading of a frame's x axis in the world's xy plane."""
    return float(np.arctan2(rot[1, 0], rot[0, 0]))


class Expert:
    """A scripted controller of one task over the envs of a ManiSkillEnv.

    A task subclass implements `read(u) -> dict`, the privileged state of one unwrapped env
    in numpy (with `tcp` and `tcp_rot` from `arm`), and `plan(state) -> (target, yaw_error,
    gripper)`: where the TCP should go, how far to turn the gripper about the vertical, and
    the gripper command; `carry(state, moved)` moves what the TCP moves in the nominal model.
    The base class turns a plan into one primitive action, keeping the gripper pointing down,
    and predicts the TCP after it. `noise` is the std of Gaussian noise added to every arm
    action (translation, rotation; then clipped to [-1, 1]) so the demonstrations visit states
    off the expert's path, and the recovery from them."""

    task = ""

    def __init__(self, chunk_len: int, noise: float = 0.0, seed: int = 0):
        self.chunk_len, self.noise = chunk_len, noise
        self.rng = np.random.default_rng(seed)
        # env -> the last translation it was sent: its lag carries into the next chunk
        self._previous: dict[int, np.ndarray] = {}

    def act(self, env) -> np.ndarray:
        """The action chunks (num_envs, chunk_len, 7) for the env's current states."""
        chunks = []
        for i, u in enumerate(env.privileged_envs()):
            state, chunk = self.read(u), []
            fresh = int(u.elapsed_steps[0]) == 0  # a new episode: the arm is at rest
            state["previous"] = np.zeros(3) if fresh else self._previous.get(i, np.zeros(3))
            for _ in range(self.chunk_len):
                chunk.append(self.step(state))
            chunks.append(chunk)
        actions = np.asarray(chunks, dtype=np.float32)
        if self.noise > 0:  # the arm's; the gripper's command stays a clean open or close
            arm = actions[..., :6]
            arm += self.rng.normal(0.0, self.noise, arm.shape).astype(np.float32)
        actions = np.clip(actions, -1.0, 1.0)
        self._previous = {i: actions[i, -1, :3].astype(np.float64) for i in range(len(actions))}
        return actions

    def executed(self, actions: np.ndarray) -> None:
        """The chunks (num_envs, chunk_len, 7) the envs ran instead of this expert's (a policy
        drove them, the expert labelled: `hpcvla demos --policy`): their last translation is
        the lag the next plan starts from."""
        self._previous = {i: actions[i, -1, :3].astype(np.float64) for i in range(len(actions))}

    def step(self, state: dict) -> np.ndarray:
        """One primitive action for `state`, which is advanced by the nominal model."""
        target, yaw_error, gripper = self.plan(state)
        move = np.clip(GAIN * (target - state["tcp"]) / (STEP_M * TRACKING), -SPEED, SPEED)
        tilt = np.cross(state["tcp_rot"][:, 2], [0.0, 0.0, -1.0])  # sin(angle) * axis to -z
        turn = GAIN * np.array([tilt[0], tilt[1], yaw_error])  # world rotation vector wanted
        rotate = np.clip(turn / (STEP_RAD * ROTATION), -1.0, 1.0)
        moved = ((1 - LAG) * move + LAG * state["previous"]) * STEP_M * TRACKING
        state["previous"] = move
        state["tcp"] = state["tcp"] + moved
        state["tcp_rot"] = _turn(rotate * STEP_RAD * ROTATION) @ state["tcp_rot"]
        self.carry(state, moved)
        return np.concatenate([move, rotate, [gripper]])

    @staticmethod
    def arm(u) -> dict:
        """TCP position, its rotation matrix and the finger opening (metres per finger)."""
        pose = u.agent.tcp.pose
        return {"tcp": _numpy(pose.p), "tcp_rot": _rotation(_numpy(pose.q)),
                "fingers": float(u.agent.robot.get_qpos()[0, -1])}

    def read(self, u) -> dict:
        raise NotImplementedError

    def plan(self, state: dict) -> tuple[np.ndarray, float, float]:
        raise NotImplementedError

    def carry(self, state: dict, moved: np.ndarray) -> None:
        """Nothing moves with the TCP unless a task says so."""


class PushCubeExpert(Expert):
    """PushCube-v1: get behind the cube on the far side from the goal, lower the closed
    gripper to the cube's middle, push along the line to the goal until the cube's centre
    is on it (success: within the goal's 0.1 m radius, so the push has a margin).

    The phase follows from the state alone, so a push that turns or loses the cube is
    recovered from: low, behind the cube and on its line to the goal: push; behind the
    cube's back face: go to the pre-push point BEHIND_M behind it, lowering; anywhere else:
    go there over the cube, at SAFE_Z, so the fingers never land on it."""

    task = "PushCube-v1"
    BEHIND_M = 0.05   # pre-push point: this far behind the cube's centre, away from the goal
    PUSH_Z = 0.02     # TCP height while pushing: the cube's middle (half size 0.02)
    SAFE_Z = 0.07     # travel height: the fingertips clear the cube's top (0.04)
    LATERAL_M = 0.012  # off the cube-goal line by more than this: back to the pre-push point
    FINGER_M = 0.01   # from the TCP to the face of the closed fingers that pushes

    def read(self, u) -> dict:
        return {**self.arm(u), "cube": _numpy(u.obj.pose.p),
                "goal": _numpy(u.goal_region.pose.p), "half": float(u.cube_half_size)}

    def plan(self, state):
        tcp, cube, goal, half = state["tcp"], state["cube"], state["goal"], state["half"]
        line = goal[:2] - cube[:2]
        direction = line / max(np.linalg.norm(line), 1e-6)
        rel = tcp[:2] - cube[:2]
        along = rel @ direction  # < 0: behind the cube
        lateral = abs(rel[0] * direction[1] - rel[1] * direction[0])
        low = tcp[2] < self.PUSH_Z + 0.015
        state["pushing"] = low and along < -half and lateral < self.LATERAL_M
        state["direction"] = direction
        if state["pushing"]:  # the TCP's target puts the cube's centre on the goal's
            target = np.append(goal[:2] - direction * (half + self.FINGER_M), self.PUSH_Z)
        elif along < -(half + self.FINGER_M):
            target = np.append(cube[:2] - direction * self.BEHIND_M, self.PUSH_Z)
        else:
            target = np.append(cube[:2] - direction * self.BEHIND_M, self.SAFE_Z)
        return target, 0.0, CLOSE

    def carry(self, state, moved):
        if state["pushing"]:  # the fingers' face pushes the cube ahead of it
            direction = state["direction"]
            lead = ((state["tcp"][:2] - state["cube"][:2]) @ direction + state["half"]
                    + self.FINGER_M)
            if lead > 0:
                state["cube"] = state["cube"] + np.append(direction * lead, 0.0)


class PickCubeExpert(Expert):
    """PickCube-v1: turn the open gripper to the cube's yaw (modulo 90 degrees) above it,
    descend to its centre, close, carry it to the goal and hold still there (success also
    needs the arm static).

    The grasp is the task's own contact test (`agent.is_grasping`), read once per chunk; a
    gripper that closed on nothing opens, backs up and starts over."""

    task = "PickCube-v1"
    HOVER_M = 0.06    # above the cube's centre, where the gripper turns before descending
    CLOSED_M = 0.005  # a finger this close to closed holds nothing

    def read(self, u) -> dict:
        return {**self.arm(u), "cube": _numpy(u.cube.pose.p), "goal": _numpy(u.goal_site.pose.p),
                "cube_yaw": yaw_of(_rotation(_numpy(u.cube.pose.q))),
                "grasped": bool(u.agent.is_grasping(u.cube)[0]), "closing": False}

    def plan(self, state):
        tcp, cube = state["tcp"], state["cube"]
        yaw_error = ((state["cube_yaw"] - yaw_of(state["tcp_rot"]) + np.pi / 4) % (np.pi / 2)
                     - np.pi / 4)  # a cube's faces repeat every 90 degrees
        if state["grasped"]:
            return tcp + (state["goal"] - cube), 0.0, CLOSE  # the cube's centre to the goal
        xy_error = np.linalg.norm(tcp[:2] - cube[:2])
        if state["closing"] or (xy_error < 0.008 and abs(tcp[2] - cube[2]) < 0.008):
            state["closing"] = True  # the grasp shows in the next chunk's contacts
            return cube, 0.0, CLOSE
        if state["fingers"] < self.CLOSED_M:  # closed on nothing: open and back up
            return tcp + np.array([0.0, 0.0, 0.03]), 0.0, OPEN
        if xy_error < 0.01 and abs(yaw_error) < 0.08:
            return cube, yaw_error, OPEN  # above it and turned: descend
        above = cube + np.array([0.0, 0.0, self.HOVER_M])
        return above, yaw_error, OPEN

    def carry(self, state, moved):
        if state["grasped"]:
            state["cube"] = state["cube"] + moved


class ReachExpert:
    """`reach`: straight to the named target at full speed (envs/reach.oracle_actions, success
    1.0), plus Gaussian `noise` on every action."""

    def __init__(self, chunk_len: int, noise: float = 0.0, seed: int = 0):
        self.noise, self.rng = noise, np.random.default_rng(seed)

    def act(self, env) -> np.ndarray:
        from hpcvla.envs.reach import oracle_actions

        actions = oracle_actions(env)
        if self.noise > 0:
            actions = actions + self.rng.normal(0.0, self.noise, actions.shape)
        return np.clip(actions, -1.0, 1.0).astype(np.float32)

    def executed(self, actions: np.ndarray) -> None:
        """The oracle plans from the env's state alone: what ran before changes nothing."""


EXPERTS = {cls.task: cls for cls in (PickCubeExpert, PushCubeExpert)}
# The control modes the ManiSkill experts' actions are in: their arm model (TRACKING, LAG,
# ROTATION) was measured under this controller, and a plan is end-effector deltas
EXPERT_CONTROL_MODES = (EE_DELTA_CONTROL,)


def make_expert(env: str, task: str, chunk_len: int, noise: float = 0.0, seed: int = 0,
                control_mode: str = EE_DELTA_CONTROL):
    """The scripted expert of env `env` (its ManiSkill `task`, in `control_mode`); ValueError
    naming those that have one."""
    if env == "reach":
        return ReachExpert(chunk_len, noise, seed)
    if env != "maniskill":
        raise ValueError(f"env.name={env}: no scripted expert; envs with one: reach, maniskill "
                         f"(env.task one of {', '.join(sorted(EXPERTS))})")
    if task not in EXPERTS:
        raise ValueError(f"env.task={task}: no scripted expert; tasks with one: "
                         f"{', '.join(sorted(EXPERTS))}")
    if control_mode not in EXPERT_CONTROL_MODES:
        raise ValueError(f"env.control_mode={control_mode}: the scripted {task} expert acts in "
                         f"{', '.join(EXPERT_CONTROL_MODES)} only (end-effector deltas on an "
                         "arm model measured under that controller); record the demonstrations "
                         f"with env.control_mode={EE_DELTA_CONTROL}, or convert ManiSkill's own "
                         "with its replay_trajectory -c <mode>")
    return EXPERTS[task](chunk_len, noise, seed)
