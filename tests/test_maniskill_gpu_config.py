"""env.sim_backend without a GPU: the config accepts `gpu` for maniskill on a login node, refuses
it for the other simulators, and an env built where CUDA or the PhysX GPU library is missing
fails naming env.sim_backend and the fix. Stepping the GPU env itself: tests/gpu."""

import pytest
import torch

from hpcvla import envs
from hpcvla.config import ConfigError, load_config
from hpcvla.envs import check_env, env_uses_gpu, make_env


def test_gpu_backend_loads_without_cuda_for_maniskill_only():
    cfg = load_config(None, ["env.name=maniskill", "env.sim_backend=gpu"])  # a login node
    assert cfg.env.sim_backend == "gpu" and load_config().env.sim_backend == "cpu"
    for name in ("reach", "libero"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"env.name={name}", "env.sim_backend=gpu"])
        assert [p[0] for p in err.value.problems] == ["env.sim_backend"]
        assert "env.sim_backend=cpu" in str(err.value) and f"env.name={name}" in str(err.value)


def test_gpu_env_without_cuda_names_the_setting_and_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"env\.sim_backend = 'gpu'.*env\.sim_backend=cpu"):
        make_env("maniskill", 4, seed=0, sim_backend="gpu", task="PickCube-v1")  # the GPU env
    with pytest.raises(ValueError, match="env.sim_backend=cpu"):
        make_env("reach", 4, seed=0, sim_backend="gpu")


def test_missing_physx_gpu_library_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # SAPIEN looks in ~/.sapien/physx/<version>
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    library = envs.maniskill_gpu.physx_gpu_library()
    assert library.is_relative_to(tmp_path)
    with pytest.raises(ConfigError, match=r"env\.sim_backend.*libPhysXGpu_64\.so"):
        make_env("maniskill", 4, seed=0, sim_backend="gpu")  # fails before touching CUDA
    cfg = load_config(None, ["env.name=maniskill", "env.sim_backend=gpu"])
    with pytest.raises(ConfigError) as err:
        check_env(cfg)  # before any rank starts: no CUDA needed, only the file
    assert err.value.problems[0][0] == "env.sim_backend" and str(library) in str(err.value)
    assert "enable_gpu()" in envs.maniskill_gpu.physx_gpu_missing()  # bench gpu's skip says how
    library.parent.mkdir(parents=True)
    library.touch()
    check_env(cfg)
    check_env(load_config(None, ["env.name=maniskill"]))  # cpu needs no library


def test_env_uses_gpu(monkeypatch):
    cfg = load_config()
    assert env_uses_gpu(cfg.env) is False  # reach
    for backend in ("cpu", "gpu"):
        cfg.env.name, cfg.env.sim_backend = "maniskill", backend
        assert env_uses_gpu(cfg.env) is True
    cfg.env.name, cfg.env.sim_backend = "libero", "cpu"
    monkeypatch.setenv("MUJOCO_GL", "egl")
    assert env_uses_gpu(cfg.env) is True
    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    assert env_uses_gpu(cfg.env) is False


def test_a_controller_with_a_target_is_refused_on_gpu_simulation():
    """mani-skill 3.0.1's partial reset (every auto-reset, every GRPO group and evaluation
    state) resets every env's controller, after the reset mask is back to all envs: under a
    `*_target_*` mode one env's reset would snap every other env's accumulated target to its
    current pose. Refused before any rank starts; the CPU backend (an env per scene) runs it."""
    target = ["env.name=maniskill", "env.control_mode=pd_ee_target_delta_pose"]
    with pytest.raises(ConfigError) as err:
        check_env(load_config(None, [*target, "env.sim_backend=gpu"]))
    assert ("env.control_mode", "pd_ee_target_delta_pose") == err.value.problems[0][:2]
    assert "resets every env's controller target" in str(err.value)
    check_env(load_config(None, target))


def test_dense_delta_restarts_each_reset_envs_gain_from_zero():
    """env.reward=dense_delta around a batch of envs (the GPU backend's): each step pays the
    change of the dense reward since that env's step before; a partial reset (ManiSkill's
    `options={"env_idx": ...}`, as ManiSkillGPUEnv resets its finished envs) starts only those
    envs' next gain from 0, a full reset all of them."""
    from hpcvla.envs.maniskill import ShapingGain

    class Batch:  # three envs' dense rewards, as ManiSkill returns them
        unwrapped = None

        def __init__(self):
            self.rewards = iter(torch.tensor(r) for r in
                                ([0.1, 0.2, 0.3], [0.4, 0.2, 0.5], [0.6, 0.1, 0.5],
                                 [0.7, 0.3, 0.9]))

        def reset(self, **kwargs):
            return {}, {}

        def step(self, action):
            return {}, next(self.rewards), None, None, {}
    env = ShapingGain(Batch())
    gains = [env.step(None)[1]]
    gains.append(env.step(None)[1])
    env.reset(options={"env_idx": torch.tensor([1])})  # env 1 starts a new episode
    gains.append(env.step(None)[1])
    env.reset(seed=0)  # every env
    gains.append(env.step(None)[1])
    expected = [[0.1, 0.2, 0.3], [0.3, 0.0, 0.2], [0.2, 0.1, 0.0], [0.7, 0.3, 0.9]]
    torch.testing.assert_close(torch.stack(gains), torch.tensor(expected))


def test_the_gpu_simulators_spec_probe_is_a_build_under_env_build_timeout_s():
    """A GPU-simulated config's spec comes from a CPU env built in a worker of its own (SAPIEN
    cannot simulate on the GPU in a process that made a CPU scene); its build is a build,
    under env.build_timeout_s (it had 600 s of its own): here one no build meets."""
    from hpcvla.envs import env_spec
    from hpcvla.envs.isolated import EnvWorkerFailed
    cfg = load_config(None, ["env.name=maniskill", "env.sim_backend=gpu"])
    cfg.env.build_timeout_s = 1e-3  # (the config's checks want >= 1 s: a millisecond here)
    with pytest.raises(EnvWorkerFailed, match=r"the spec probe.*init did not return within "
                                              r"0.001 s \(env.build_timeout_s\)"):
        env_spec(cfg.env)
