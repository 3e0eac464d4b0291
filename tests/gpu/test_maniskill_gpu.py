"""ManiSkill3 on the GPU (env.sim_backend=gpu: one GPU-batched env for the shard) against the CPU
backend, PickCube-v1 with 4 envs and 64 px cameras: the same spec and observation fields,
chunks that step, termination only on success, truncation after max_episode_chunks, and
initial states that are a function of the init_state_id.

Same id, CPU vs GPU: the robot's initial pose is drawn by numpy from the id on both backends and
is compared; the cube and the goal are drawn by torch on the sim device, and torch's CUDA
generator (Philox) gives other numbers than its CPU one (Mersenne Twister) for the same seed,
so they are not compared (same distribution, other draws). Within the GPU backend, envs sit at
different offsets in one PhysX GPU scene, so the same state may differ in its last float bits
between envs: those comparisons have a small tolerance.
"""

import numpy as np
import pytest
import torch

from hpcvla.envs import make_env

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (ManiSkill PhysX GPU simulation); this machine has none",
                allow_module_level=True)

from hpcvla.envs.maniskill_gpu import physx_gpu_missing  # noqa: E402

if physx_gpu_missing():
    pytest.skip(f"needs {physx_gpu_missing()}", allow_module_level=True)

N, CHUNK, HORIZON = 4, 4, 3  # envs, primitive steps per chunk, chunks per episode
SETTINGS = dict(task="PickCube-v1", image_size=64, wrist_image=True, reward="sparse",
                chunk_len=CHUNK, max_episode_chunks=HORIZON)
IDS = np.array([7, 8])
ATOL = 1e-5  # the same state in two envs of one GPU scene (see the module docstring)


CPU_SIDE = """
import pickle, sys
import numpy as np
from hpcvla.envs import make_env
env = make_env("maniskill", {n}, seed=0, **{settings!r})
obs = env.reset(init_state_ids=np.array({ids!r}))
qpos = np.stack([s.u.agent.robot.get_qpos()[0].cpu().numpy() for s in env._slots])
with open(sys.argv[1], "wb") as out:
    pickle.dump(dict(spec=env.spec, obs=obs, qpos=qpos, instructions=env.instructions()), out)
env.close()
"""


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    """What the CPU backend gives for IDS, from a process of its own: SAPIEN refuses GPU
    simulation in a process that made a CPU PhysX scene."""
    import pickle
    import subprocess
    import sys
    out = tmp_path_factory.mktemp("cpu") / "cpu.pkl"
    code = CPU_SIDE.format(n=len(IDS), settings=SETTINGS, ids=IDS.tolist())
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return pickle.loads(out.read_bytes())


@pytest.fixture(scope="module")
def gpu(cpu):
    env = make_env("maniskill", N, seed=0, sim_backend="gpu", **SETTINGS)
    assert env.u.device.type == "cuda" and env.u.gpu_sim_enabled
    yield env
    env.close()


def still(moves=None):
    """A chunk holding every arm still (gripper open); `moves` {env: action} overrides."""
    actions = np.zeros((N, CHUNK, 7), dtype=np.float32)
    actions[..., 6] = -1.0
    for i, action in (moves or {}).items():
        actions[i] = action
    return actions


def place_at_goal(env, i):
    """Put env i's cube at its goal in the GPU simulation (the other envs' cubes stay)."""
    u = env.u
    pose = u.cube.pose.raw_pose.clone()
    pose[i, :3] = u.goal_site.pose.p[i]
    u.cube.pose = pose
    u.scene.px.gpu_apply_rigid_dynamic_data()
    u.scene.px.gpu_fetch_rigid_dynamic_data()


def check_result(result):
    for name, dtype in (("reward", np.float32), ("terminated", bool), ("truncated", bool),
                        ("success", bool), ("episode_return", np.float32),
                        ("episode_length", np.int32), ("env_fault", bool)):
        value = getattr(result, name)
        assert value.shape == (N,) and value.dtype == dtype, name
    assert np.isfinite(result.reward).all() and not result.env_fault.any()
    assert np.array_equal(result.terminated, result.success)  # terminated only with success
    grasped = result.metrics["grasped"]  # PickCube's episode metric: 0 until an episode ends
    assert grasped.shape == (N,) and grasped.dtype == np.float32
    assert not grasped[~(result.terminated | result.truncated)].any()


def test_spec_and_observations_match_the_cpu_backend(cpu, gpu):
    assert gpu.spec == cpu["spec"]
    obs = gpu.reset()
    assert list(obs) == list(cpu["obs"]) == list(gpu.spec.obs)
    for name, (shape, dtype) in gpu.spec.obs.items():
        assert obs[name].shape == (N, *shape) and obs[name].dtype == np.dtype(dtype), name
        assert obs[name].dtype == cpu["obs"][name].dtype, name
    assert obs["image"].std() > 5 and obs["wrist_image"].std() > 5  # real renders, not blank
    assert (obs["instruction"] == cpu["obs"]["instruction"][0]).all()
    assert gpu.instructions() == cpu["instructions"][:1] * N


def test_chunks_step_and_actions_move_only_their_env(gpu):
    start = gpu.reset(init_state_ids=np.full(N, 4))
    push = np.zeros((CHUNK, 7), dtype=np.float32)
    push[:, 0], push[:, 6] = 1.0, -1.0  # full speed along +x, gripper open
    result = gpu.step(still({0: push}))
    check_result(result)
    state, image = result.obs["state"], result.obs["image"]
    assert np.abs(state[0] - start["state"][0]).max() > 0.01  # the pushed arm moved
    assert np.abs(state[0] - state[1]).max() > 0.01
    for i in (2, 3):  # identical still arms stay identical
        np.testing.assert_allclose(state[i], state[1], atol=1e-4)
    assert np.abs(image[0].astype(int) - image[1]).sum() > 0
    rng = np.random.default_rng(0)
    for _ in range(2 * HORIZON):  # random chunks, across truncation and auto resets
        result = gpu.step(rng.uniform(-1, 1, (N, CHUNK, 7)).astype(np.float32))
        check_result(result)


def test_success_terminates_with_reward_and_auto_resets(gpu):
    gpu.reset(init_state_ids=np.array([1, 2, 3, 4]))
    place_at_goal(gpu, 1)
    result = gpu.step(still())
    check_result(result)
    assert result.success.tolist() == [False, True, False, False]
    assert result.terminated.tolist() == [False, True, False, False]
    assert not result.truncated.any()
    assert result.reward[1] == 1.0 and result.episode_return[1] == 1.0  # sparse: 1 at success
    assert result.episode_length.tolist() == [0, 1, 0, 0]
    assert gpu._chunks.tolist() == [1, 0, 1, 1]  # env 1 already started its next episode
    assert np.abs(gpu.u.cube.pose.p[1].cpu().numpy() -
                  gpu.u.goal_site.pose.p[1].cpu().numpy()).max() > 1e-3  # a fresh start


def test_truncation_at_horizon_then_auto_reset(gpu):
    gpu.reset()
    for chunk in range(1, HORIZON + 1):
        result = gpu.step(still())
        check_result(result)
        assert result.truncated.all() == (chunk == HORIZON) and not result.terminated.any()
    assert result.episode_length.tolist() == [HORIZON] * N
    assert result.metrics["grasped"].tolist() == [0.0] * N  # the still arms held nothing
    assert not result.success.any() and gpu._chunks.tolist() == [0] * N
    result = gpu.step(still())  # the new episodes run on
    assert not result.truncated.any() and gpu._chunks.tolist() == [1] * N


def test_same_init_state_id_same_initial_state(gpu):
    first = gpu.reset(init_state_ids=np.array([7, 7, 8, 7]))["state"]
    for i in (1, 3):
        np.testing.assert_allclose(first[i], first[0], atol=ATOL)
    assert np.abs(first[2] - first[0]).max() > 1e-3
    gpu.step(still())
    again = gpu.reset(init_state_ids=np.array([8, 7, 7, 7]))["state"]
    np.testing.assert_allclose(again[0], first[2], atol=ATOL)
    np.testing.assert_allclose(again[1:], first[[0, 0, 0]], atol=ATOL)
    seeded = [gpu.reset(seeds=np.array([3, 4, 5, 6]))["state"] for _ in range(2)]
    np.testing.assert_allclose(*seeded, atol=ATOL)  # seeds make random starts repeatable
    assert np.abs(seeded[0][0] - seeded[0][1]).max() > 1e-3  # and each env its own


def test_init_state_id_gives_the_cpu_backends_robot_pose(cpu, gpu):
    """See the module docstring: the robot's pose is the CPU backend's, the objects' are not."""
    state = gpu.reset(init_state_ids=np.array([7, 8, 8, 7]))["state"]
    qpos = gpu.u.agent.robot.get_qpos().cpu().numpy()
    np.testing.assert_allclose(qpos[[0, 1]], cpu["qpos"], atol=1e-6)
    np.testing.assert_allclose(qpos[[3, 2]], cpu["qpos"], atol=1e-6)
    # ManiSkill's state starts with the agent: the Panda's 9 joint positions, 9 velocities
    np.testing.assert_allclose(state[[0, 1], :18], cpu["obs"]["state"][:, :18], atol=1e-6)
    assert state.shape[1] == cpu["obs"]["state"].shape[1]
