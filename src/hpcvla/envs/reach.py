"""`reach`: a tiny language-conditioned tabletop task in pure numpy, vectorized over envs.

The table is the unit square [0, 1]^2 seen from straight above by a camera. It holds
`num_objects` discs (radius OBJECT_RADIUS) with distinct colours from PALETTE, and the end
effector, drawn as a small white cross. The instruction names one object by its colour,
"reach the red object"; the episode succeeds when the effector gets within `success_radius` of
that object's centre.

Image layout: `image[row, col]` covers x in [col/S, (col+1)/S) and y in [row/S, (row+1)/S),
i.e. x grows to the right and y grows downwards; a pixel is painted when its centre is inside
a shape. Objects are painted in index order, the effector last (on top).

Observation fields (per env; batched with a leading num_envs dimension):
    image        (S, S, 3)  |u1  RGB camera image, S = image_size
    instruction  (4,)       <i4  token ids of ["reach", "the", <colour>, "object"] in `vocab`
    state        (3K + 4,)  <f4  only if state=True: [ee_x, ee_y, obj0_x, obj0_y, ...,
                                 obj{K-1}_x, obj{K-1}_y, target one-hot (K), target_x - ee_x,
                                 target_y - ee_y], K = num_objects. The last two are
                                 privileged (like ManiSkill's goal-relative state): with them
                                 the task is easy; without state, the policy must find the
                                 target from pixels and instruction.

Actions: (chunk_len, 2) per env, (dx, dy) clipped to [-1, 1] and scaled by `max_delta` per
primitive step; the effector is clipped to the table. A chunk stops early (the remaining
primitive steps are ignored) as soon as the target is reached. Reward per chunk: the sum over
executed primitive steps of (previous distance - new distance) * progress_scale, plus 1.0 on
success (env.progress_reward=false: progress_scale 0, the success alone, a sparse reward).
Truncation after `max_episode_chunks` chunks. Finished envs auto-reset.

Initial states (effector start, object positions and colours, target) come from each env's
own stream (`seeds.env_rng` of the env's seed: `seeds.env_seeds` of the shard seed, or
`reset(seeds=...)`); `reset(init_state_ids=...)` makes the layout a pure function of the id
instead (`seeds.state_rng`: RL groups restart from one state, `hpcvla eval` runs ids 0, 1,
...). An env's stream is never an id's stream (seeds.py), so training's random layouts are not
evaluation layouts, and GRPO's grouped ids come from the training split (envs/base.py).

An optional lognormal latency model emulates slow simulators: each step lasts the slowest of
num_envs draws, from a separate RNG (with latency_sleep=False it only reports the draw in
`last_latency_s`, so a caller can keep several shards in flight, as one-process-per-env
simulators do).

Speed (one CPU core, numpy 2.4, 64 envs, 64x64 images, chunk_len 4, incl. auto-resets):
~1.1 ms per step() with random actions, ~1.5 ms with the oracle (more resets; a full reset()
of 64 envs is ~2 ms). Rendering touches only a small window around each shape.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import numpy as np

from hpcvla.emulate import pad
from hpcvla.envs.base import EnvSpec, StepResult, VectorEnv
from hpcvla.seeds import env_seeds, state_rng

PALETTE = {  # name -> RGB; all far from the table colour and from white
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 190),
    "orange": (245, 140, 20),
}
COLOUR_NAMES = tuple(PALETTE)
PALETTE_RGB = np.array(list(PALETTE.values()), dtype=np.uint8)
TABLE_RGB = np.array((96, 96, 96), dtype=np.uint8)
EFFECTOR_RGB = np.array((255, 255, 255), dtype=np.uint8)

VOCAB = ("", "reach", "the", "object", *COLOUR_NAMES)
INSTRUCTION_LEN = 4
OBJECT_RADIUS = 0.06
MIN_OBJECT_SEPARATION = 2.5 * OBJECT_RADIUS  # centre-to-centre: discs never touch
EFFECTOR_CLEARANCE = 0.25  # objects start this far from the effector: no free successes
EFFECTOR_ARM = 0.04  # half-length of the cross arms
_LATENCY_STREAM = 0x1A7E  # mixed into the shard seed: the latency draws' own stream


def _sample_layout(rng: np.random.Generator, num_objects: int):
    """Draw (effector xy, object xys (K, 2), colour ids (K,), target index) from `rng`."""
    lo, hi = OBJECT_RADIUS + 0.02, 1.0 - OBJECT_RADIUS - 0.02
    while True:  # rejection sampling; restarts are rare for K <= 6
        ex, ey = rng.uniform(0.1, 0.9, size=2).tolist()
        objs: list[tuple[float, float]] = []
        for _ in range(200):
            px, py = rng.uniform(lo, hi, size=2).tolist()  # python floats: cheap distance checks
            if math.hypot(px - ex, py - ey) >= EFFECTOR_CLEARANCE and all(
                    math.hypot(px - qx, py - qy) >= MIN_OBJECT_SEPARATION for qx, qy in objs):
                objs.append((px, py))
                if len(objs) == num_objects:
                    colours = rng.choice(len(COLOUR_NAMES), size=num_objects, replace=False)
                    return (ex, ey), objs, colours, int(rng.integers(num_objects))


class ReachEnv(VectorEnv):
    """Vectorized "reach the <colour> object" task; see the module docstring."""

    @classmethod
    def config_kwargs(cls, env_cfg) -> dict:
        return dict(latency_median_ms=env_cfg.latency_median_ms,
                    latency_sigma=env_cfg.latency_sigma, hang_at_step=env_cfg.hang_at_step,
                    crash_at_step=env_cfg.crash_at_step,
                    **({} if env_cfg.progress_reward else {"progress_scale": 0.0}))

    def __init__(self, num_envs: int, seed: int = 0, image_size: int = 64, num_objects: int = 3,
                 chunk_len: int = 4, max_episode_chunks: int = 20, state: bool = True,
                 max_delta: float = 0.05, success_radius: float = 0.07,
                 progress_scale: float = 10.0, latency_median_ms: float = 0.0,
                 latency_sigma: float = 0.5, latency_sleep: bool = True,
                 hang_at_step: int = 0, crash_at_step: int = 0):
        checks = {
            "num_envs": num_envs >= 1,
            "image_size": image_size >= 8,
            "num_objects": 1 <= num_objects <= len(COLOUR_NAMES),
            "chunk_len": chunk_len >= 1,
            "max_episode_chunks": max_episode_chunks >= 1,
            "max_delta": np.isfinite(max_delta) and max_delta > 0,
            "success_radius": np.isfinite(success_radius) and success_radius > 0,
            "progress_scale": np.isfinite(progress_scale) and progress_scale >= 0,
            "latency_median_ms": np.isfinite(latency_median_ms) and latency_median_ms >= 0,
            "latency_sigma": np.isfinite(latency_sigma) and latency_sigma >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"ReachEnv: invalid {name}={locals()[name]!r}")
        self.num_envs, self.seed, self.image_size = num_envs, seed, image_size
        self.num_objects, self.chunk_len, self.use_state = num_objects, chunk_len, state
        self.max_episode_chunks, self.max_delta = max_episode_chunks, max_delta
        self.success_radius, self.progress_scale = success_radius, progress_scale
        self.latency_median_ms, self.latency_sigma = latency_median_ms, latency_sigma
        self.last_latency_s = 0.0
        self.latency_sleep = latency_sleep
        self.hang_at_step, self.crash_at_step = hang_at_step, crash_at_step
        self._steps_taken = 0

        obs = {"image": ((image_size, image_size, 3), "|u1"),
               "instruction": ((INSTRUCTION_LEN,), "<i4")}
        if state:
            obs["state"] = ((3 * num_objects + 4,), "<f4")
        self.spec = EnvSpec(obs=obs, action_dim=2, chunk_len=chunk_len,
                            max_episode_chunks=max_episode_chunks, vocab=VOCAB)

        # Pixel-centre coordinates, shared by rows (y) and columns (x).
        self._centres = (np.arange(image_size) + 0.5) / image_size
        self._half_thick = 1.0 / image_size  # cross arms ~2 pixels thick at any resolution
        self._background = np.tile(TABLE_RGB, (image_size, image_size, 1))

        n, k = num_envs, num_objects
        self._seed_envs(env_seeds(seed, n))
        self._latency_rng = np.random.default_rng([seed, _LATENCY_STREAM])
        self._ee = np.zeros((n, 2))
        self._obj = np.zeros((n, k, 2))
        self._colours = np.zeros((n, k), dtype=np.int64)
        self._target = np.zeros(n, dtype=np.int64)
        self._dist = np.zeros(n)  # current effector-target distance
        self._chunks = np.zeros(n, dtype=np.int32)  # chunks elapsed in the current episode
        self._return = np.zeros(n, dtype=np.float32)
        # the table and its objects, which stand still within an episode: drawn once per
        # layout (a reset), so a step paints only the effector on a copy (a third of a step)
        self._scene = np.empty((n, image_size, image_size, 3), np.uint8)
        self._stale_scene = np.ones(n, bool)
        self.reset()

    # ---- episode bookkeeping -------------------------------------------------------------

    def _reset_env(self, i: int, rng: np.random.Generator) -> None:
        self._ee[i], self._obj[i], self._colours[i], self._target[i] = _sample_layout(
            rng, self.num_objects)
        # np.hypot as in step(): a norm there would differ in the last bit on some CPUs, and
        # standing still would earn a reward of +-1e-16 instead of 0
        self._dist[i] = np.hypot(*(self._ee[i] - self._obj[i, self._target[i]]))
        self._chunks[i] = 0
        self._return[i] = 0.0
        self._stale_scene[i] = True

    def reset(self, seeds: np.ndarray | None = None,
              init_state_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        self._begin_reset(seeds, init_state_ids)
        for i in range(self.num_envs):
            rng = (self._rngs[i] if init_state_ids is None
                   else state_rng(init_state_ids[i]))
            self._reset_env(i, rng)
        return self._observe()

    def _target_xy(self) -> np.ndarray:
        return self._obj[np.arange(self.num_envs), self._target]

    # ---- observations --------------------------------------------------------------------

    def _window(self, centre: np.ndarray, half: float) -> np.ndarray:
        """(n, P) pixel indices of a window covering every pixel centre within `half` of each
        env's `centre` coordinate (P fixed, window shifted to stay inside the image)."""
        size = min(self.image_size, math.ceil(2 * half * self.image_size) + 2)
        start = np.floor((centre - half) * self.image_size).astype(np.int64)
        return np.clip(start, 0, self.image_size - size)[:, None] + np.arange(size)

    def _paint(self, img: np.ndarray, xy: np.ndarray, half: float, shape, rgb: np.ndarray,
               envs: np.ndarray | None = None):
        """Paint `rgb` (m, 3) where `shape(dx, dy)` holds, in a window around each env's `xy`
        (m, 2), into the images of `envs` (m of them; default all).

        Only a small window per env is touched (fancy indexing over all envs at once), which is
        far cheaper than full-image masks: the discs cover ~1 % of the image.
        """
        rows, cols = self._window(xy[:, 1], half), self._window(xy[:, 0], half)
        dy = self._centres[rows] - xy[:, 1:2]  # (n, P) offsets of the window's pixel centres
        dx = self._centres[cols] - xy[:, 0:1]
        mask = shape(dx[:, None, :], dy[:, :, None])  # (n, P, P), broadcast
        envs = np.arange(self.num_envs) if envs is None else envs
        idx = (envs[:, None, None], rows[:, :, None], cols[:, None, :])
        img[idx] = np.where(mask[..., None], rgb[:, None, None, :], img[idx])

    def _render(self) -> np.ndarray:
        n, r2, ht = self.num_envs, OBJECT_RADIUS ** 2, self._half_thick

        def disc(dx, dy):
            return dx * dx + dy * dy <= r2

        def cross(dx, dy):
            dx, dy = np.abs(dx), np.abs(dy)
            return ((dy <= ht) & (dx <= EFFECTOR_ARM)) | ((dx <= ht) & (dy <= EFFECTOR_ARM))

        if self._stale_scene.any():  # new layouts: their table and objects drawn anew
            envs = np.flatnonzero(self._stale_scene)
            self._scene[envs] = self._background
            for k in range(self.num_objects):  # in index order: later objects on top
                self._paint(self._scene, self._obj[envs, k], OBJECT_RADIUS, disc,
                            PALETTE_RGB[self._colours[envs, k]], envs)
            self._stale_scene[envs] = False
        img = self._scene.copy()
        self._paint(img, self._ee, EFFECTOR_ARM, cross, np.broadcast_to(EFFECTOR_RGB, (n, 3)))
        return img

    def _observe(self) -> dict[str, np.ndarray]:
        n = self.num_envs
        tokens = np.empty((n, INSTRUCTION_LEN), dtype=np.int32)
        tokens[:, 0], tokens[:, 1], tokens[:, 3] = (VOCAB.index(w) for w in ("reach", "the",
                                                                              "object"))
        tokens[:, 2] = VOCAB.index(COLOUR_NAMES[0]) + self._colours[np.arange(n), self._target]
        obs = {"image": self._render(), "instruction": tokens}
        if self.use_state:
            onehot = np.eye(self.num_objects)[self._target]
            obs["state"] = np.concatenate(
                [self._ee, self._obj.reshape(n, -1), onehot, self._target_xy() - self._ee],
                axis=1).astype(np.float32)
        return obs

    def instructions(self) -> list[str]:
        colours = self._colours[np.arange(self.num_envs), self._target]
        return [f"reach the {COLOUR_NAMES[c]} object" for c in colours]

    # ---- dynamics ------------------------------------------------------------------------

    def step(self, actions: np.ndarray) -> StepResult:
        self._steps_taken += 1
        if self._steps_taken == self.hang_at_step:  # fault injection: a step that never returns
            threading.Event().wait()
        if self._steps_taken == self.crash_at_step:  # fault injection: the process dies (SEGV)
            os.kill(os.getpid(), signal.SIGKILL)
        begin, n = time.monotonic(), self.num_envs
        actions = np.asarray(actions, dtype=np.float64)
        if actions.shape != (n, self.chunk_len, 2):
            raise ValueError(f"step: actions must have shape ({n}, {self.chunk_len}, 2), "
                             f"got {actions.shape}")
        deltas = np.clip(actions, -1.0, 1.0) * self.max_delta
        target = self._target_xy()
        active = np.ones(n, dtype=bool)  # still executing this chunk (not yet successful)
        success = np.zeros(n, dtype=bool)
        reward = np.zeros(n)
        ran = np.zeros(n, dtype=np.int32)  # primitive steps of the chunk executed
        for t in range(self.chunk_len):
            ran += active
            ee = np.clip(self._ee + deltas[:, t], 0.0, 1.0)
            self._ee = np.where(active[:, None], ee, self._ee)
            dist = np.hypot(*(self._ee - target).T)
            reward += np.where(active, (self._dist - dist) * self.progress_scale, 0.0)
            self._dist = dist  # unchanged where inactive, since the effector did not move
            hit = active & (dist <= self.success_radius)
            success |= hit
            active &= ~hit
        reward = (reward + success).astype(np.float32)

        self._chunks += 1
        self._return += reward
        terminated = success
        truncated = ~success & (self._chunks >= self.max_episode_chunks)
        done = terminated | truncated
        episode_return = np.where(done, self._return, 0.0).astype(np.float32)
        episode_length = np.where(done, self._chunks, 0).astype(np.int32)
        final_obs = self._observe() if self.keep_final_obs and truncated.any() else None
        for i in np.flatnonzero(done):  # auto-reset with each env's own RNG, unless held
            if self.holding_resets:
                self._chunks[i], self._return[i] = 0, 0.0
            else:
                self._reset_env(i, self._rngs[i])
        obs = self._observe()
        self._sleep_latency(begin)
        return StepResult(obs, reward, terminated, truncated, success.copy(),
                          episode_return, episode_length, np.zeros(n, bool),
                          final_obs=final_obs, chunk_steps=ran)

    def _sleep_latency(self, begin: float) -> None:
        """The emulated latency is the step's whole duration: the numpy work done since
        `begin` counts towards it."""
        if self.latency_median_ms <= 0:
            self.last_latency_s = 0.0
            return
        # A vectorized step waits for its slowest env, like one-process-per-env simulators.
        draws = self._latency_rng.lognormal(np.log(self.latency_median_ms / 1e3),
                                            self.latency_sigma, size=self.num_envs)
        self.last_latency_s = float(draws.max())
        if self.latency_sleep:  # else the caller holds the result back (shards in flight)
            pad(begin, self.last_latency_s)

    def close(self) -> None:
        pass  # nothing to release


def oracle_actions(env: ReachEnv) -> np.ndarray:
    """Scripted expert: a (num_envs, chunk_len, 2) chunk moving straight to each target.

    Uses privileged state. Each primitive step moves at full speed, or exactly onto the target
    when it is closer than one step, so it never overshoots.
    """
    remaining = env._target_xy() - env._ee
    out = np.empty((env.num_envs, env.chunk_len, 2), dtype=np.float32)
    for t in range(env.chunk_len):
        steps = remaining / env.max_delta  # in action units
        norm = np.maximum(np.linalg.norm(steps, axis=1, keepdims=True), 1.0)
        out[:, t] = steps / norm
        remaining = remaining - out[:, t] * env.max_delta
    return out
