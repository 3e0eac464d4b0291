"""`hpcvla demos`: demonstrations of a scripted expert (envs/experts.py) in the configured
ManiSkill task (or `reach`, by its oracle), in this process, written in the trajectory dump
layout (metrics/dump.py) by its one writer, for `hpcvla sft` to imitate before RL.

    hpcvla demos configs/maniskill_pickcube.yaml env.task=PushCube-v1 --episodes 100 \
        --out demos.h5 [--noise 0.1] [--successful-only]
    hpcvla demos CONFIG --policy <run dir> [--deterministic] --episodes 64 --out round1.h5

With `--policy` a trained run's policy (its newest checkpoint) drives the env and the expert
labels every observation the policy reaches with the chunk it would have given there: DAgger
(Ross et al. 2011), the expert's corrections in the states its imitator drifts into, for the
next `hpcvla sft` on the union of the files.

Initial states come from the training split only (`training_state_ids`, at or above
EVAL_STATE_IDS: envs/base.py), never from the ids `hpcvla eval` measures (0, 1, 2, ...), so
an imitation start is evaluated on states it has not been shown. Each id is the ManiSkill
reset seed of its episode, recorded as the demo's `seed`: `env.reset(init_state_ids=[seed])`
gives the same initial state back.

A line every pipeline.progress_every_s says how far it is. Ctrl-C or SIGTERM (process/
preempt.py) ends the recording after the episode it is in, the file holding the episodes
written so far, complete (none: no file), and the command exits 128 + the signal's number; a
second Ctrl-C interrupts at once.

One env, one episode at a time: on CPU physics ManiSkill steps one env per slot in this
process anyway (envs/serial.py), so a batch would be no faster, and the envs of a batch that
finish early would auto-reset into episodes that are not recorded.

What a demo holds beyond a run's dump: `actions` is the chunk the expert gave for `obs` (noise
included, clipped to [-1, 1], what the env executed unless a policy drove; a chunk that
succeeded early stopped there); `policy_versions` and the `policy_version` attribute are EXPERT_VERSION (-1: a scripted
expert, no policy); `logprobs` and `values` are NaN (an expert has neither); `staleness` is 0.
Attributes: seed (the init_state_id), episode (the attempt's number: with --successful-only,
the failed ones are missing), instruction, success, return, env_fault (the policy's
episode's where one drove), env_id "expert/e0", driver (the driving run and its policy
version; "" for the expert's own episodes).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import yaml

from hpcvla.config.env import WITHOUT_EMULATION
from hpcvla.config.families import simulator
from hpcvla.config.loader import config_to_dict
from hpcvla.envs import check_env, env_kwargs, make_env
from hpcvla.envs.base import training_state_ids
from hpcvla.envs.experts import make_expert
from hpcvla.metrics.dump_writer import TrajectoryDump
from hpcvla.preflight import unwritable
from hpcvla.process import preempt

EXPERT_VERSION = -1  # policy_versions of a scripted expert's steps
_STREAM = 0xDE_305  # the init_state_id stream, apart from the run's other uses of run.seed
ATTEMPTS_PER_EPISODE = 4  # --successful-only gives up after this x --episodes attempts in all


class RecordingError(ValueError):
    """Demonstrations cannot be recorded as asked; the message names the setting."""


def record(cfg, episodes: int, out, noise: float = 0.0, successful_only: bool = False,
           policy_run: str | None = None, deterministic: bool = False) -> dict:
    """Record `episodes` episodes of the configured task's expert to `out` (with
    `successful_only`: that many successful ones; with `policy_run`: that run's policy acting,
    the expert labelling); returns what the command prints."""
    expert = _expert(cfg, noise)
    out = Path(out)
    if episodes < 1:
        raise RecordingError(f"--episodes {episodes}: at least 1")
    if policy_run is not None and (noise or successful_only):
        raise RecordingError("--policy: the expert labels the policy's states as it is "
                             "(no --noise) and every episode is the policy's (no "
                             "--successful-only)")
    if deterministic and policy_run is None:
        raise RecordingError("--deterministic: the driving policy's mean action; name the "
                             "run with --policy")
    why = unwritable(out.parent)
    if why:
        raise RecordingError(f"--out {out}: a file in a folder it can be written in ({why})")
    out.parent.mkdir(parents=True, exist_ok=True)  # (unwritable: it can be made)
    try:  # the name claimed now, not when the env is built (seconds later): two jobs given
        os.close(os.open(out, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # one --out both wrote
    except FileExistsError:
        raise RecordingError(f"--out {out}: exists; remove it or name another file") from None
    try:
        check_env(cfg)
        env, task = _env(cfg)
        driver = None if policy_run is None else PolicyDriver(Path(policy_run), env.spec,
                                                               deterministic)
        dump = TrajectoryDump(out, -1, list(env.spec.obs), env.spec.vocab, None,
                              " ".join(dict.fromkeys([cfg.env.name, task])),  # reach's task
                              env.spec.chunk_len,
                              yaml.safe_dump(config_to_dict(cfg), sort_keys=False),
                              flush_s=30.0, fresh=True,
                              source=f"scripted expert {task}, noise {noise}"
                              + (f", driven by {driver.name}" if driver else ""))
    except BaseException:
        out.unlink(missing_ok=True)  # the claim goes with the recording that made it
        raise
    rng = np.random.default_rng([cfg.run.seed, _STREAM])
    start, seen, attempts, successes, steps, ran = time.monotonic(), set(), 0, 0, 0, 0
    written, said = 0, start
    try:
        while written < episodes and not preempt.requested():  # a signal: stop, file whole
            if time.monotonic() - said >= cfg.pipeline.progress_every_s and attempts:
                said = time.monotonic()
                print(f"[hpcvla demos] {written}/{episodes} episodes written, {attempts} "
                      f"attempts (success {successes / attempts:.2f}), {said - start:.0f} s",
                      flush=True)
            if successful_only and attempts >= ATTEMPTS_PER_EPISODE * episodes:
                raise RecordingError(
                    f"--successful-only: {written} successful episodes in {attempts} attempts "
                    f"(expert success {successes / attempts:.2f}); ask for fewer --episodes or "
                    "less --noise")
            init_state_id = training_state_ids(rng)
            if init_state_id in seen:
                continue
            seen.add(init_state_id)
            demo, attrs = _episode(env, expert, init_state_id, attempts, driver)
            attempts += 1
            successes += attrs["success"]
            if attrs["success"] or not successful_only:
                dump.add_episode(demo, attrs)
                written += 1
                steps += len(demo["reward"])
                ran += attrs["env_steps"]
    finally:
        dump.close()
        env.close()
        if not written:  # none to keep: no file to stand in the next try's way
            out.unlink(missing_ok=True)
    return {"file": str(out), "task": task, "episodes": written, "asked": episodes,
            "stopped_by": preempt.requested_by(),
            "driver": driver.name if driver else "",
            "attempts": attempts, "steps": steps,
            "expert_success_rate": successes / attempts if attempts else float("nan"),
            "chunk_len": env.spec.chunk_len, "env_steps": ran,
            "seconds": time.monotonic() - start}


def _expert(cfg, noise: float):
    """The expert of the configured env, or a RecordingError naming the setting."""
    if not 0 <= noise < float("inf"):  # nan fails this too
        raise RecordingError(f"--noise {noise}: a standard deviation, finite and >= 0")
    try:
        return make_expert(cfg.env.name, cfg.env.task, cfg.env.chunk_len, noise,
                           seed=cfg.run.seed, control_mode=cfg.env.control_mode)
    except ValueError as err:
        raise RecordingError(str(err)) from None


def _env(cfg):
    """One env of the configured simulator, and the task's name: ManiSkill on CPU physics
    (the experts read its privileged state there), reach without its emulated latency and
    injected faults (as `hpcvla eval` runs it)."""
    kwargs = env_kwargs(cfg.env)
    if simulator(cfg.env.name).emulated:
        kwargs.update(WITHOUT_EMULATION)
        return make_env(cfg.env.name, 1, cfg.run.seed, **kwargs), cfg.env.name
    return make_env(cfg.env.name, 1, cfg.run.seed, **dict(kwargs, sim_backend="cpu")), \
        cfg.env.task


def _episode(env, expert, init_state_id: int, number: int, driver=None) -> tuple[dict, dict]:
    """One episode from `init_state_id`: its steps in the dump's fields, and its attributes.
    With a `driver` it runs the policy's chunks, and the expert's are the labels."""
    obs = env.reset(init_state_ids=np.array([init_state_id]))
    instruction = env.instructions()[0]
    rows = []
    while True:
        actions = expert.act(env)
        if driver is not None:
            ran = driver(obs)
            expert.executed(ran)  # the lag of what ran carries into the next plan
        result = env.step(actions if driver is None else ran)
        rows.append((obs, actions[0], result))
        if result.terminated[0] or result.truncated[0]:
            break
        obs = result.obs
    T = len(rows)
    demo = {f"obs/{key}": np.stack([o[key][0] for o, _, _ in rows]) for key in env.spec.obs}
    demo["actions"] = np.stack([a for _, a, _ in rows]).astype(np.float32)
    demo["reward"] = np.array([r.reward[0] for _, _, r in rows], dtype=np.float32)
    for field in ("terminated", "truncated", "env_fault"):
        demo[field] = np.array([getattr(r, field)[0] for _, _, r in rows], dtype=bool)
    demo["done"] = np.arange(T) == T - 1
    demo["logprob"] = np.full(T, np.nan, dtype=np.float32)
    demo["value"] = np.full(T, np.nan, dtype=np.float32)
    demo["version"] = np.full(T, EXPERT_VERSION, dtype=np.int64)
    demo["staleness"] = np.zeros(T, dtype=np.int64)
    last = rows[-1][2]
    attrs = {"env_id": "expert/e0", "producer_rank": -1, "slot": 0, "env_index": 0,
             "seed": init_state_id, "episode": number, "instruction": instruction,
             "policy_version": EXPERT_VERSION, "staleness": 0,
             "success": bool(last.success[0]), "return": float(last.episode_return[0]),
             "env_fault": bool(last.env_fault[0]), "driver": driver.name if driver else "",
             "env_steps": int(sum(r.chunk_steps[0] for _, _, r in rows))}
    return demo, attrs


class PolicyDriver:
    """A run's policy (its newest checkpoint, the run's own config) acting in the recording's
    env, on a GPU where there is one: `hpcvla eval`'s policy, one chunk at a time."""

    def __init__(self, run_dir: Path, spec, deterministic: bool):
        from hpcvla.checkpoint import catalog, store
        from hpcvla.config import load_config
        from hpcvla.devices import local_device
        from hpcvla.evaluate import checkpoint_weights
        from hpcvla.factory import build_policy

        if not (run_dir / "config.yaml").is_file():
            raise RecordingError(f"--policy {run_dir}: not a run directory (no config.yaml)")
        run_cfg = load_config(run_dir / "config.yaml", record=True)
        self.policy = build_policy(run_cfg, spec, local_device(run_cfg.placement.gpus_per_node))
        try:  # none yet, or another env's policy: its shapes do not fit this one's
            weights, state = checkpoint_weights(run_dir)
            store.check_fit(weights, self.policy.state_dict(), f"--policy {run_dir}")
        except catalog.CheckpointError as err:
            raise RecordingError(str(err)) from None
        self.policy.load_arrays(weights)
        self.deterministic = deterministic
        self.name = f"{run_dir} v{state['version']}"

    def __call__(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        import torch

        with torch.no_grad():
            out = self.policy.act(self.policy.obs_to_tensors(obs), self.deterministic)
        return np.clip(out.actions.cpu().numpy(), -1.0, 1.0)


def summary_line(s: dict) -> str:
    """The one line `hpcvla demos` prints."""
    who = f"policy {s['driver']} (the expert labelled every step)" if s["driver"] else "expert"
    return (f"hpcvla demos: {s['episodes']} episodes of {s['task']} to {s['file']} | {who} "
            f"success {s['expert_success_rate']:.3f} over {s['attempts']} attempts | "
            f"{s['steps']} steps (chunks of {s['chunk_len']}: {s['env_steps']} env steps ran) | "
            f"{s['seconds']:.1f} s" + ("" if s["stopped_by"] is None else
            f" | stopped by signal {s['stopped_by']} after {s['episodes']} of {s['asked']} "
            "episodes" + (": the file holds them, complete" if s["episodes"] else
                          ": no file written")))
