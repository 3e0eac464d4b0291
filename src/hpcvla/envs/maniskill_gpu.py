"""`maniskill` with `env.sim_backend=gpu`: a whole env shard as ONE GPU-batched ManiSkill3 env.

The CPU backend (maniskill.py) steps one single-env ManiSkill scene per env, one after the other.
Here the shard's `num_envs` envs are the parallel sub-scenes of one ManiSkill env that PhysX
simulates on the rank's GPU (`sim_backend="physx_cuda:<i>"`, i = torch's current device, the one
the rank is bound to; mani-skill 3.0.1 maps "gpu" and "cuda" to "physx_cuda" too) and SAPIEN
renders there in one batch. A primitive step advances every env at once; the cameras render once per
chunk, after its last step. Tensors stay on the GPU during a chunk: the chunk's actions go up in
one copy, its rewards and success flags come down in one, and the observations of the whole
batch in one (packed as bytes).

The contract is the CPU backend's, field for field (see maniskill.py): same spec, actions
clipped to [-1, 1], reward summed over the chunk, termination on `info["success"]` (an env
that succeeds mid-chunk is stepped on with the batch, but those steps are neither counted nor
seen: it restarts at the end of the chunk; with env.success_ends_episode=false none ends at
success, every step counted), truncation after max_episode_chunks, per-env auto
reset (ManiSkill's partial reset, `options={"env_idx": ...}`), seeds and instruction tokens.

Initial states. A ManiSkill task draws its robot noise from per-env numpy RNGs and its objects
and goals with torch on the sim device, seeding torch with the first seed of a reset call. So:
  - init_state_id: each env is reset alone, from the id: its start is a pure function of the id,
    whatever the env and its neighbours (GRPO groups, `hpcvla eval`), at one reset call per env;
  - random starts (auto resets, reset() without ids): one reset call for all envs that need one,
    seeded from their RNGs: reproducible from the env seeds, not a function of one env's alone.
    The seeds are training ids (envs/base.py), so the robot draws and the torch seed of a
    random start are never those of an evaluation state.
ManiSkill's own seeded reset builds two numpy RNGs for every env of the batch on each call
(~0.1-0.2 ms each: 50-100 ms per call at 256 envs), so `_reset` seeds what it would seed, for
the reset envs only. The same id gives the same robot pose as on CPU (numpy draws) but other object
and goal poses: the CUDA generator (Philox) is not the CPU's (Mersenne Twister). Same
distribution, other draws.
Tasks that randomise their scene when built (PegInsertionSide-v1: a peg size per env) give each
env of the batch its own scene, so there an id fixes the start of one env slot only.

Faults: a GPU simulation cannot lose one env alone, so nothing is isolated per env here and
`env_fault` is never set: a failing batched step raises. With `env.isolation=process` the
shard's worker is then restarted and all its episodes end truncated (envs/isolated.py); inline,
the rank stops the job.

Needs CUDA and SAPIEN's PhysX GPU library (`physx_gpu_library()`), which SAPIEN downloads from
GitHub on first use: nodes without internet need it put there beforehand.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcvla.config.families import EE_DELTA_CONTROL, MANISKILL_REWARDS
from hpcvla.envs.base import StepResult, VectorEnv, episode_ends, training_state_ids
from hpcvla.envs.maniskill import (EPISODE_FLAGS, ManiSkillEnv, describe, episode_flags,
                                   make_task_env, render_cameras, state_vector, task_spec)
from hpcvla.envs.serial import chunk_actions, require
from hpcvla.seeds import env_seeds
from hpcvla.text import tokenize, words


def physx_gpu_library() -> Path:
    """Where SAPIEN loads its PhysX GPU library from (and downloads it to when missing)."""
    physx = require("sapien.physx", "mani-skill", "maniskill")
    return Path.home() / ".sapien" / "physx" / physx.version() / "libPhysXGpu_64.so"


def physx_gpu_missing() -> str | None:
    """Why ManiSkill cannot simulate on a GPU here (the package, or SAPIEN's PhysX GPU library,
    which SAPIEN downloads on first use and GPU nodes often cannot), or None."""
    try:
        library = physx_gpu_library()
    except ImportError as err:
        return str(err)
    if library.is_file():
        return None
    return (f"SAPIEN's PhysX GPU library at {library} (SAPIEN downloads it on first use, which "
            "fails without internet); fetch it once where there is internet: python -c "
            "'import sapien.physx as p; p.enable_gpu()', and copy ~/.sapien to the nodes")


def gpu_sim_device() -> int:
    """The CUDA device to simulate on, or a ConfigError naming env.sim_backend and the fix."""
    import torch

    from hpcvla.config import ConfigError
    if not torch.cuda.is_available():
        raise ConfigError([("env.sim_backend", "gpu", "cpu on a machine without a CUDA GPU: "
                            "ManiSkill's PhysX GPU simulation needs one and torch sees none "
                            "here. Set env.sim_backend=cpu, or run the simulators on GPU nodes")],
                          "env configuration")
    missing = physx_gpu_missing()
    if missing:
        raise ConfigError([("env.sim_backend", "gpu", f"cpu, or {missing}")],
                          "env configuration")
    return torch.cuda.current_device()


class ManiSkillGPUEnv(VectorEnv):
    """`num_envs` copies of one ManiSkill3 task simulated together on a GPU; see the module
    docstring. ManiSkillEnv's constructor arguments, less `camera`."""

    @classmethod
    def config_problems(cls, env_cfg) -> list[tuple[str, object, str]]:
        """The CPU env's (ManiSkillEnv), then PhysX's GPU library (CUDA itself is checked on
        the nodes)."""
        problems = ManiSkillEnv.config_problems(env_cfg)
        if "_target_" in env_cfg.control_mode:  # mani-skill 3.0.1, BaseEnv.reset: its
            # controllers reset after the reset mask is back to all envs, so a partial reset
            # snaps every env's accumulated target to its current pose
            problems.append(("env.control_mode", env_cfg.control_mode, "a mode without a "
                             "target (e.g. pd_ee_delta_pose) with env.sim_backend=gpu: "
                             "ManiSkill's partial reset of one env resets every env's "
                             "controller target; or env.sim_backend=cpu"))
        missing = None if problems else physx_gpu_missing()
        return problems + ([("env.sim_backend", env_cfg.sim_backend, f"cpu, or {missing}")]
                           if missing else [])

    def __init__(self, num_envs: int, seed: int = 0, task: str = "PickCube-v1",
                 image_size: int = 64, wrist_image: bool = False, state: bool = True,
                 reward: str = "sparse", chunk_len: int = 5, max_episode_chunks: int = 16,
                 first_env: int = 0, control_mode: str = EE_DELTA_CONTROL,
                 state_mode: str = "privileged", success_ends_episode: bool = True):
        if reward not in MANISKILL_REWARDS:
            raise ValueError(f"ManiSkillGPUEnv: reward must be one of {MANISKILL_REWARDS}, "
                             f"got {reward!r}")
        if num_envs < 1 or chunk_len < 1 or max_episode_chunks < 1:
            raise ValueError("ManiSkillGPUEnv: num_envs, chunk_len and max_episode_chunks "
                             "must be >= 1")
        gpu = gpu_sim_device()
        self.env = make_task_env(task, num_envs, f"physx_cuda:{gpu}", f"cuda:{gpu}",
                                 image_size, wrist_image, reward,
                                 chunk_len * max_episode_chunks, control_mode)
        self.u = self.env.unwrapped
        self.num_envs, self.task, self.first_env = num_envs, task, first_env
        self.end_episodes_at_success(success_ends_episode)
        self.device = self.u.device
        # without a state observation, none is computed (the privileged one is the step's)
        self.instruction, self.state_mode = describe(task), state_mode if state else \
            "privileged"
        self._seed_envs(env_seeds(seed, num_envs))
        self._chunks = np.zeros(num_envs, dtype=np.int32)
        self._return = np.zeros(num_envs, dtype=np.float32)
        self._done_once = np.zeros(num_envs, dtype=bool)  # the task was done this episode
        try:
            self.spec = task_spec(self.env, task, image_size, wrist_image, state, chunk_len,
                                  max_episode_chunks, state_mode=state_mode,
                                  success_ends_episode=success_ends_episode)
            # each episode metric's flag the task reports, set where it was at some step
            self._flags = {flag: np.zeros(num_envs, bool)
                           for flag in episode_flags(self.u.evaluate())}
            tokens = tokenize(self.instruction, self.spec.vocab, len(words(self.instruction)))
            self._tokens = np.tile(tokens, (num_envs, 1))
            self.reset()
        except BaseException:
            self.close()
            raise

    # ---- episodes ---------------------------------------------------------------------

    def _reset(self, envs: np.ndarray, seeds: list[int]) -> None:
        """ManiSkill's partial reset of `envs`, seeded as its seeded reset would seed them
        (mani-skill 3.0.1, BaseEnv.reset; see the module docstring for why not through it):
        each env's episode RNG from its seed, the task's shared `_episode_rng` (the first
        env's) and torch from the first seed; the other envs' RNGs are left as they are."""
        import torch
        u = self.u
        rngs = [np.random.RandomState(s) for s in seeds]
        u._batched_episode_rng[envs] = rngs
        u._episode_rng = rngs[0]
        u._episode_seed[envs] = seeds
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seeds[0])
            index = torch.as_tensor(envs, device=self.device)
            self._state, _ = self.env.reset(options={"env_idx": index})

    def _start_episodes(self, envs: np.ndarray, init_state_ids=None) -> None:
        """New episodes for `envs`: each alone from its init_state_id, or all in one call
        from seeds drawn from their RNGs."""
        self._chunks[envs], self._return[envs], self._done_once[envs] = 0, 0.0, False
        for held in self._flags.values():
            held[envs] = False
        if init_state_ids is None:
            self._reset(envs, [training_state_ids(self._rngs[i]) for i in envs])
        else:
            for i, state_id in zip(envs, init_state_ids, strict=True):
                self._reset(np.array([i]), [int(state_id)])

    def _observe(self) -> dict[str, np.ndarray]:
        """The batch's observations: cameras rendered once, one copy to the host."""
        images = render_cameras(self.u)
        fields = {"image": images[0], "wrist_image": images[-1],
                  "state": state_vector(self.u, self.state_mode, self._state).float()}
        host = _to_host({k: v for k, v in fields.items() if k in self.spec.obs})
        host["instruction"] = self._tokens.copy()
        return {k: host[k] for k in self.spec.obs}

    def reset(self, seeds: np.ndarray | None = None,
              init_state_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        self._begin_reset(seeds, init_state_ids)
        self._start_episodes(np.arange(self.num_envs), init_state_ids)
        return self._observe()

    def instructions(self) -> list[str]:
        return [self.instruction] * self.num_envs

    def step(self, actions: np.ndarray) -> StepResult:
        import torch
        n, chunk = self.num_envs, self.spec.chunk_len
        actions = chunk_actions(actions, n, self.spec).swapaxes(0, 1)  # (chunk, n, dim)
        actions = torch.as_tensor(np.ascontiguousarray(actions), device=self.device)
        reward = torch.zeros(n, device=self.device)
        success = torch.tensor(self._done_once, device=self.device)  # done at some step
        at_end = torch.zeros(n, dtype=torch.bool, device=self.device)  # at the last step
        ran = torch.zeros(n, device=self.device)  # steps of the chunk in each env's episode
        flags = {flag: torch.zeros(n, dtype=torch.bool, device=self.device)
                 for flag in self._flags}
        for t in range(chunk):
            # the steps of each env's episode: all to the horizon, else up to its success (the
            # serial envs stop there)
            counted = torch.ones_like(success) if self.run_to_horizon else ~success
            ran += counted.float()
            self._state, r, _, _, info = self.env.step(actions[t])
            reward += r.float() if self.rewards_after_success else \
                torch.where(success, 0.0, r.float())  # nothing counts after success
            for flag, held in flags.items():
                held |= info[flag] & counted
            success |= info["success"]
            at_end = info["success"]
            if not self.run_to_horizon and t + 1 < chunk and bool(success.all()):
                break
        reward, success, at_end, ran, *held = torch.stack([  # one copy to the host
            reward, success.float(), at_end.float(), ran,
            *(f.float() for f in flags.values())]).cpu().numpy()
        success, at_end = success > 0.5, at_end > 0.5
        for flag, now in zip(self._flags, held):
            self._flags[flag] |= now > 0.5
        self._chunks += 1
        self._return += reward
        self._done_once = success  # the chunk's success includes the episode's before it
        terminated, truncated, success, at_end = episode_ends(
            success, self._done_once, at_end, self._chunks >= self.spec.max_episode_chunks,
            np.zeros(n, bool), self.run_to_horizon)
        done = terminated | truncated
        episode_return = np.where(done, self._return, 0.0).astype(np.float32)
        episode_length = np.where(done, self._chunks, 0).astype(np.int32)
        final_obs = self._observe() if self.keep_final_obs and truncated.any() else None
        metrics = {EPISODE_FLAGS[flag]: np.where(done, held, False).astype(np.float32)
                   for flag, held in self._flags.items()} or None
        if self.holding_resets:  # they stay where they ended, a new episode's count begun
            self._chunks[done], self._return[done], self._done_once[done] = 0, 0.0, False
            for held in self._flags.values():
                held[done] = False
        elif done.any():
            self._start_episodes(np.flatnonzero(done))
        return StepResult(self._observe(), reward.astype(np.float32), terminated, truncated,
                          success, episode_return, episode_length, np.zeros(n, bool), at_end,
                          final_obs, ran.astype(np.int32), metrics)

    def close(self) -> None:
        env, self.env = getattr(self, "env", None), None
        if env is not None:
            env.close()


def _to_host(tensors: dict) -> dict[str, np.ndarray]:
    """Batched device tensors as numpy arrays, in ONE device-to-host copy: each is viewed as
    (batch, bytes), the views are concatenated, copied, and cut apart again on the host."""
    import torch
    flat = [t.contiguous().view(len(t), -1).view(torch.uint8) for t in tensors.values()]
    packed = torch.cat(flat, dim=1).cpu().numpy()
    out, start = {}, 0
    for (name, t), f in zip(tensors.items(), flat, strict=True):
        dtype = np.dtype(str(t.dtype).removeprefix("torch."))
        part = np.ascontiguousarray(packed[:, start:start + f.shape[1]])
        out[name] = part.view(dtype).reshape(tuple(t.shape))
        start += f.shape[1]
    return out
