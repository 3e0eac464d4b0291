"""The settings of the simulator a run steps (`env.*`): which one, its task, its envs and
their isolation, and what a step is; the rest of the schema: schema.py."""

from __future__ import annotations

from dataclasses import dataclass

from hpcvla.config.families import EE_DELTA_CONTROL, MANISKILL_REWARDS, SIMULATORS
from hpcvla.config.learning import setting


@dataclass
class EnvConfig:
    name: str = setting("reach", "Simulator. `reach` is built in (numpy only, pixels + "
                        "instruction, fast); `maniskill` (ManiSkill3, task env.task) and "
                        "`libero` (suite env.suite) are real simulators: far slower per step "
                        "(rendering on CPU), and a LIBERO env takes ~300 MB.",
                        choices=tuple(SIMULATORS))
    task: str = setting(
        "PickCube-v1", "ManiSkill3 task id (env.name=maniskill); the tasks that need no "
        "asset download are listed in hpcvla/envs/maniskill.py (NO_DOWNLOAD_TASKS).")
    sim_backend: str = setting(
        "cpu", "env.name=maniskill: where the physics runs. `cpu`: one single-env ManiSkill "
        "scene per env, stepped one after the other by the rank (PhysX on the CPU; cameras "
        "render on the rank's GPU if it has one). `gpu`: each shard (env.envs_per_simulator / "
        "env.shards envs) is ONE ManiSkill env whose envs PhysX steps together on the rank's "
        "GPU and renders there in one batch: for large shards (ManiSkill steps hundreds of envs "
        "per GPU at once); the same observations, rewards and episodes (but other initial "
        "object poses per init state id than `cpu`). Needs CUDA and PhysX GPU on the "
        "simulator nodes (SAPIEN's PhysX GPU library in ~/.sapien, downloaded on first use: "
        "fetch it beforehand where nodes have no internet). A GPU simulation cannot drop one "
        "failing env: a fault ends every episode of its shard (with env.isolation=process the "
        "shard's worker restarts).", choices=("cpu", "gpu"))
    control_mode: str = setting(
        EE_DELTA_CONTROL, "env.name=maniskill: the robot's controller, which says what an "
        "action is (ManiSkill3's control modes): `pd_ee_delta_pose` end-effector translation "
        "and rotation deltas + gripper (7-d; what VLA checkpoints and the scripted experts "
        "use), `pd_joint_delta_pos` joint-angle deltas + gripper (8-d; what ManiSkill's own "
        "PPO/SAC baselines train), or another mode whose actions are normalized to [-1, 1] "
        "(envs/maniskill.py CONTROL_MODES, checked before launch). Demonstrations: recorded in "
        "it.")
    suite: str = setting(
        "libero_spatial", "LIBERO suite (env.name=libero): libero_spatial, libero_object, "
        "libero_goal, libero_10 or libero_90, or a LIBERO-PRO perturbation of one of the "
        "first four for out-of-distribution evaluation: <suite>_object (other objects), _swap "
        "(positions swapped), _lan (instructions reworded), _task (another task in the same "
        "scene) (envs/libero.py SUITES, checked before launch).")
    suite_task: int = setting(
        -1, "LIBERO task index within env.suite for every env; -1 spreads the envs over all "
        "tasks of the suite (multi-task; each further scene a rank renders costs ~1 GB: "
        "libero_spatial's and libero_goal's tasks share one, envs/scenes.py).",
        ge=-1)
    wrist_image: bool = setting(
        False, "Add the wrist camera (`wrist_image`) next to the third-person `image` "
        "(maniskill, libero): a second render per step (~2x the rendering time).")
    reward: str = setting(
        "sparse", "maniskill: `sparse` (1 on success), `dense_delta` (the dense shaping's "
        "change per step: an episode returns its last value, most at success) or `dense` (the "
        "shaping; where success ends an episode, unbootstrapped, hovering short of it returns "
        "more: give it env.success_ends_episode=false). libero: sparse; reach: its own.",
        choices=MANISKILL_REWARDS)
    success_ends_episode: bool = setting(
        True, "maniskill: whether success ends a training episode (terminated: nothing after "
        "it is bootstrapped). false: every episode runs to its horizon and every step's reward "
        "counts, success's too (ManiSkill's ignore_terminations, its SAC baseline's): with "
        "`dense`, whose success state pays 1 a step, succeeding and staying is then the "
        "optimum, not hovering short of success; an episode's success is success_once. "
        "Evaluations run ManiSkill episodes to the horizon either way, counting the rewards "
        "after success as the run trained; `hpcvla demos` records with it, and RLPD's prior "
        "data must have been recorded with the run's value.")
    envs_per_simulator: int = setting(
        16, "Environments each simulator rank steps. More amortise inference per step "
        "but make a synchronous step wait longer for its slowest env.", ge=1)
    shards: int = setting(
        2, "Shards the envs of a simulator rank are split into (rollout-async, streamer): "
        "a shard steps and asks for actions without waiting for the others, so stepping "
        "overlaps inference. More shards: more overlap, smaller inference batches. Must divide "
        "env.envs_per_simulator; the other modes step one shard and ignore it.", ge=1)
    chunk_len: int = setting(
        4, "Primitive actions per action chunk (one policy call per chunk). Longer chunks "
        "mean fewer policy calls but coarser feedback.", ge=1)
    max_episode_chunks: int = setting(
        20, "Episode horizon in chunks; the episode is truncated after this many (the "
        "simulators' own step limits are lifted: horizon = this x chunk_len steps).", ge=1)
    image_size: int = setting(
        32, "Camera image side in pixels: more detail, more bytes per step and a slower "
        "encoder.", ge=16, le=512)
    camera: bool = setting(
        True, "maniskill (CPU simulation) only: render the third-person camera (`image`). "
        "false: state-only observations, nothing rendered (several times the env steps per "
        "second on CPUs); for the `default` policy, which then reads the state and the "
        "instruction; VLA policies read the camera.")
    state: bool = setting(
        True, "Include the low-dim state observation (learning is much faster with it; "
        "turn it off to learn from pixels and instruction alone).")
    state_format: str = setting(
        "quaternion", "libero only: the end-effector orientation in the state. `quaternion`: "
        "9-d state (position 3, xyzw quaternion 4, gripper 2). `axis_angle`: 8-d state, the "
        "quaternion as robosuite's axis-angle vector (3), as openpi's LIBERO example (pi0, "
        "pi0.5) and OpenVLA-OFT feed it: use it with their checkpoints (policy.pretrained), "
        "whose state normalization expects 8 values.",
        choices=("quaternion", "axis_angle"))
    gripper_action: str = setting(
        "closed_high", "libero only: what the last action dimension means. `closed_high`: "
        "LIBERO's controller's own (-1 open, +1 closed). `open_high`: OpenVLA-OFT's LIBERO "
        "datasets' (+1 open, 0 closed), given to LIBERO as OFT's and RLinf's evaluations do "
        "(the sign of 2 g - 1, negated); policy.name=oft on libero needs it.",
        choices=("closed_high", "open_high"))
    state_mode: str = setting(
        "privileged", "maniskill only: what the `state` observation holds. `privileged`: the "
        "task's `state` obs mode (robot joints and velocities, and the objects' and goals' "
        "poses: what a camera would have to find); `visual`: what ManiSkill's camera obs "
        "modes give beside the pictures (the robot's joints and velocities and the task's "
        "non-privileged extras, e.g. PickCube's goal position, which no camera shows), as "
        "its RGB baselines train on: with it a VLA policy must see the objects.",
        choices=("privileged", "visual"))
    train_states: str = setting(
        "sampled", "libero only: where training episodes start. `sampled`: fresh placements "
        "from each task's own samplers, never the benchmark's fixed initial states, which "
        "evaluation takes: its success is on states no episode trained on. `benchmark`: the "
        "fixed initial states themselves (50 a task), as RLinf trains (its "
        "use_fixed_reset_state_ids) and reports its after-RL success, for numbers comparable "
        "with it: evaluation is then not held out, and its result says so (held_out false).",
        choices=("sampled", "benchmark"))
    progress_reward: bool = setting(
        True, "reach only: pay the progress toward the target each step (the distance gained, "
        "x10) beside the 1 on success; false: the 1 on success alone, a sparse reward as "
        "LIBERO's (a fast testbed for what sparse rewards do to an algorithm).")
    latency_median_ms: float = setting(
        0.0, "reach only: emulated simulator cost: a step lasts the slowest of per-env "
        "lognormal draws with this median, its real compute included (0 = off).", ge=0)
    latency_sigma: float = setting(
        0.5, "Log-space spread of the emulated step latency (long tail).", ge=0)
    isolation: str = setting(
        "inline", "Where a simulator rank runs its env shards. `inline`: in the rank's own "
        "process (no extra process or copy). `process`: each shard in a worker subprocess "
        "(hpcvla/envs/isolated.py), so a hung or crashed simulator (deadlock, segfault, OOM "
        "kill) costs a restarted worker and the shard's current episodes, not the job, and "
        "the shards of a rank step concurrently (up to one core each: give the rank as many "
        "cores as shards); costs one process per shard and a copy of every observation.",
        choices=("inline", "process"))
    step_timeout_s: float = setting(
        300.0, "A simulator step (one chunk of one shard) that has not returned after this "
        "many seconds is a hang (a MuJoCo/EGL deadlock). env.isolation=process: the shard's "
        "worker is killed and restarted and the run goes on. inline: the rank prints its "
        "stacks and exits; the launcher names it and stops the job, so a checkpointed run "
        "can be resumed instead of hanging. Must exceed the slowest legitimate step (and reset, "
        "guarded too; a step gets 0.9-1 x it; builds: env.build_timeout_s): 0 = none, else "
        ">= 1.",
        ge=0)
    build_timeout_s: float = setting(
        1800.0, "A simulator rank's envs (a shard, a held-out evaluation's, or the one rank 0 "
        "builds to learn the env's spec) not built after this many seconds is a hang (a "
        "renderer or asset read that never returns): the rank prints its stacks and exits, "
        "or with env.isolation=process says which worker's build it was and stops; a "
        "worker restarted after a fault gets as long for its build. A "
        "held-out batch's reset from its states gets it too (LIBERO builds the states' "
        "scenes) where it is longer than env.step_timeout_s. A build reads the assets: at "
        "a job's start every simulator rank reads them from the shared file system at once, "
        "so a build may take many steps' time. 0 = none, else >= 1.", ge=0)
    max_restarts: int = setting(
        5, "Restarts of one shard's worker (env.isolation=process), or rebuilds of one env "
        "that raised (inline ManiSkill/LIBERO envs), within env.restart_window_s or in a row "
        "without a step between, after which the rank gives up and stops the job (a fault "
        "that always recurs is a bug, not bad luck).", ge=0)
    restart_window_s: float = setting(
        3600.0, "The seconds over which env.max_restarts counts a shard's or an env's "
        "restarts (a sliding window): a rare fault, that a job of days meets every few hours, "
        "does not add up to the job's end, while more than env.max_restarts within the "
        "window, or in a row without a step between (however slow), stop it. 0: over the "
        "whole world's life.", ge=0)
    hang_at_step: int = setting(
        0, "`reach`, fault injection: every env's step number N never returns (tests the "
        "step watchdog). 0 = never.", ge=0)
    crash_at_step: int = setting(
        0, "`reach`, fault injection: the process running the envs is killed (SIGKILL, as "
        "a segfault or the OOM killer would) at step number N. 0 = never.", ge=0)


# reach's emulation of a training's simulator ranks (latency, injected faults): an evaluation
# and a recording run it without (roles/heldout.py, imitation/recording.py), and `hpcvla
# eval` refuses them typed (evaluate.TRAINING_ONLY)
WITHOUT_EMULATION = {"latency_median_ms": 0.0, "hang_at_step": 0, "crash_at_step": 0}
