"""ManiSkill3 trajectory files as mani_skill's `RecordEpisode` wrapper writes them
(mani_skill/utils/wrappers/record.py, mani-skill 3.0.1; the same layout as ManiSkill's
published demos after `python -m mani_skill.trajectory.replay_trajectory`):

    <name>.h5      traj_<episode_id>: actions (T, A) f4, terminated, truncated (T,),
                   success (T,) (if the task defines it), rewards (T,), env_states (T+1, ..),
                   obs (T+1, ..) if observations were recorded: one flat array with
                   obs_mode=state, else a group (sensor_data/<camera>/rgb, ..., and `state`,
                   the flat state vector, when the obs mode includes "+state")
    <name>.json    env_info {env_id, env_kwargs {obs_mode, control_mode, ...},
                   max_episode_steps}, episodes [{episode_id, episode_seed, control_mode,
                   elapsed_steps, reset_kwargs, success}], source_type, source_desc

How the fields of the project's ManiSkill env (envs/maniskill.py) are made from it: `state`
is the task's flat obs_mode="state" vector, which is the recorded obs itself with obs_mode
state and obs/state with obs_mode rgb+state (the same numbers: ManiSkill flattens the same
agent and extra dicts); `image` is the base camera's rgb (obs/sensor_data/base_camera/rgb),
`wrist_image` the panda_wristcam's (obs/sensor_data/hand_camera/rgb), resized to the spec's
size when they differ; the instruction is the task's description (envs.maniskill.describe of
env_id). Actions must be in the env's control mode (env.control_mode, the spec's
`controller`): a file recorded in another is refused with the replay_trajectory command that
converts it. obs has one row more than actions (the scene after the last action); sample t is
obs[t] with actions[t:t+H]."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hpcvla.config.families import EE_DELTA_CONTROL
from hpcvla.demonstrations.common import (Episode, Problems, chunks, fit_images,
                                          image_dtype_problem, rows_problem)

NAME = "ManiSkill3 RecordEpisode trajectories"
CAMERAS = {"image": "base_camera", "wrist_image": "hand_camera"}


def matches(f) -> bool:
    return any(name.startswith("traj_") for name in f) and "data" not in f


def _meta_path(path) -> Path:
    """The JSON ManiSkill writes beside its trajectory file (its name, suffix .json)."""
    return Path(path).with_suffix(".json")


def _convert(path, obs_mode: str, control_mode: str) -> str:
    return (f"convert the file with `python -m mani_skill.trajectory.replay_trajectory "
            f"--traj-path {path} -c {control_mode} -o {obs_mode} --save-traj` and give the "
            f"file it writes beside it (<name>.{obs_mode}.{control_mode}.<backend>.h5)")


def _state_of(traj):
    """The flat state vector's dataset in a trajectory group, or None."""
    obs = traj.get("obs")
    if obs is None:
        return None
    if hasattr(obs, "shape"):  # obs_mode=state: obs is the vector
        return obs
    return obs.get("state")


def scan(path, f, spec, problems: Problems) -> list[Episode]:
    from hpcvla.envs.maniskill import CONTROL_MODES, describe
    meta_path = _meta_path(path)
    try:
        meta = json.loads(meta_path.read_text())
        env_info = meta["env_info"]
        env_id, kwargs = env_info["env_id"], env_info.get("env_kwargs", {})
        by_id = {int(e["episode_id"]): e for e in meta["episodes"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        problems.add(meta_path, "env_info", None, "the JSON RecordEpisode writes beside the "
                     f".h5 (env_info.env_id, episodes): {type(err).__name__}: {err}")
        return []
    obs_mode = "rgb+state" if any(k != "state" and k in spec.obs for k in CAMERAS) else "state"
    # the file's mode: its env's, else (ManiSkill's replay reads them so) its episodes' own
    modes = {e.get("control_mode") for e in meta["episodes"]} - {None}
    mode = kwargs.get("control_mode") or (modes.pop() if len(modes) == 1 else None)
    want = spec.controller or EE_DELTA_CONTROL
    convert = _convert(path, obs_mode, want)

    def instead(recorded) -> str:  # the other way out, where the env can act in that mode
        return f", or set env.control_mode={recorded}" if recorded in CONTROL_MODES else ""
    if mode != want:  # unset: the robot's default controller, not necessarily the env's
        problems.add(meta_path, "env_info.env_kwargs.control_mode", mode,
                     f"{want} (env.control_mode); {convert}{instead(mode)}")
    instruction = describe(env_id)
    _warn_evaluation_seeds(meta_path, meta["episodes"])
    episodes = []
    for name in sorted((n for n in f if n.startswith("traj_")),
                       key=lambda n: int(n.rsplit("_", 1)[-1])):
        traj, episode_id = f[name], int(name.rsplit("_", 1)[-1])
        info = by_id.get(episode_id, {})
        if info.get("control_mode", mode) != want:  # same fix: reported once
            problems.add(meta_path, f"episodes[episode_id={episode_id}].control_mode",
                         info.get("control_mode", mode), f"{want} (env.control_mode); "
                         f"{convert}{instead(info.get('control_mode', mode))}")
        if "state" in spec.obs:
            state = _state_of(traj)
            if state is None:
                problems.add(path, f"{name}/obs/state", None,
                             "the flat state observation for the spec's 'state' field (the "
                             f"file was recorded with obs_mode={kwargs.get('obs_mode')!r}); "
                             + convert)
            elif state.shape[1:] != tuple(spec.obs["state"][0]):
                problems.add(path, f"{name}/obs/state", tuple(state.shape[1:]),
                             f"shape {tuple(spec.obs['state'][0])} of the spec's 'state' "
                             f"({env_id}'s obs is another size: another task or robot?)")
        for field, camera in CAMERAS.items():
            if field in spec.obs and f"obs/sensor_data/{camera}/rgb" not in traj:
                problems.add(path, f"{name}/obs/sensor_data/{camera}/rgb", None,
                             f"the {camera} rgb images for the spec's {field!r} field (the "
                             f"file was recorded with obs_mode={kwargs.get('obs_mode')!r}"
                             + (", robot panda_wristcam" if field == "wrist_image" else "")
                             + f"); {convert}")
        unknown = sorted(set(spec.obs) - {*CAMERAS, "state", "instruction"})
        if unknown:
            problems.add(path, name, unknown, "only image, wrist_image, state and "
                         "instruction fields in the spec: the project's ManiSkill env has no "
                         "others")
        actions = traj.get("actions")
        if actions is None or not hasattr(actions, "shape"):
            problems.add(path, f"{name}/actions", None, "a (T, A) actions dataset")
        elif actions.ndim != 2 or actions.shape[1] != spec.action_dim:
            problems.add(path, f"{name}/actions", tuple(actions.shape),
                         f"(T, {spec.action_dim}) actions: action_dim {spec.action_dim} of "
                         f"the spec ({env_id} under {mode} has {actions.shape[-1]})")
        else:
            _rows_and_images_problems(path, traj, spec, len(actions), problems)
        success = traj.get("success")
        episodes.append(Episode(str(path), name, instruction, f"{meta_path}:env_info.env_id",
                                bool(success[-1]) if success is not None and len(success)
                                else bool(info.get("success", False)),
                                len(actions) if hasattr(actions, "shape") else 0))
    return episodes


def _rows_and_images_problems(path, traj, spec, steps: int, problems: Problems) -> None:
    """A trajectory's observations: the reset's and each step's (steps + 1 rows, ManiSkill's
    RecordEpisode), its images uint8."""
    state = _state_of(traj) if "state" in spec.obs else None  # obs_mode=state's: obs itself
    datasets = [(state, False)] if state is not None else []  # (dataset, an image?)
    datasets += [(traj[f"obs/sensor_data/{camera}/rgb"], True) for field, camera in
                 CAMERAS.items() if field in spec.obs and f"obs/sensor_data/{camera}/rgb" in traj]
    for dataset, image in datasets:
        key = dataset.name.lstrip("/")  # where it is in the file, as messages name it
        rows_problem(path, key, dataset, steps + 1, "one row more than actions: the reset's "
                     "observation and each step's", problems)
        if image:
            image_dtype_problem(path, key, dataset, problems)


_warned: set[str] = set()  # files said once per process (a command scans them again)


def _warn_evaluation_seeds(meta_path: Path, episodes: list) -> None:
    """Say (once per file) which episodes start from reset seeds below EVAL_STATE_IDS: the
    states hpcvla evaluates ManiSkill on (envs/maniskill.py), where ManiSkill's own demo
    scripts start counting. Not refused: they are the demonstrations users have."""
    import sys

    from hpcvla.config.evaluation import EVAL_STATE_IDS
    seeds = []
    for e in episodes:
        seed = e.get("episode_seed", (e.get("reset_kwargs") or {}).get("seed")) \
            if isinstance(e, dict) else None
        if isinstance(seed, int) and seed < EVAL_STATE_IDS:
            seeds.append(seed)
    if seeds and str(meta_path) not in _warned:
        _warned.add(str(meta_path))
        shown = ", ".join(map(str, seeds[:5])) + (", ..." if len(seeds) > 5 else "")
        print(f"[hpcvla] {meta_path}: {len(seeds)} of {len(episodes)} episodes start from "
              f"reset seeds {shown}, ManiSkill states hpcvla evaluates on: a held-out "
              "figure after training on them is not held out (`hpcvla demos` records from "
              "the training states)", file=sys.stderr, flush=True)


def load(f, episode: Episode, spec, horizon: int | None = None
         ) -> tuple[dict, np.ndarray, np.ndarray]:
    """Obs rows 0..T-1 mapped to the spec's fields (the last, after the final action, is
    dropped), and their `horizon` actions (default spec.chunk_len)."""
    traj = f[episode.key]
    actions, pad = chunks(traj["actions"][()], horizon or spec.chunk_len)
    steps = len(actions)
    obs = {}
    if "state" in spec.obs:
        obs["state"] = _state_of(traj)[:steps].astype(np.dtype(spec.obs["state"][1]))
    for field, camera in CAMERAS.items():
        if field in spec.obs:
            images = traj[f"obs/sensor_data/{camera}/rgb"][:steps]
            obs[field] = fit_images(images, spec.obs[field][0])
    return obs, actions, pad
