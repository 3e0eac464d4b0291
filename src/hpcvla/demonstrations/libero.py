"""LIBERO's published demonstrations (`<task>_demo.hdf5`, robomimic-style), as LIBERO's
scripts/create_dataset.py writes them (github.com/Lifelong-Robot-Learning/LIBERO):

    /data              attrs: env_name, problem_info (JSON: problem_name, domain_name,
                       language_instruction), macros_image_convention (robosuite's
                       IMAGE_CONVENTION when written: "opengl"), bddl_file_name,
                       bddl_file_content, env_args (JSON), num_demos, total
    /data/demo_<i>     attrs: num_samples, model_file (MJCF), init_state
        obs/agentview_rgb, obs/eye_in_hand_rgb   (T, 128, 128, 3) u1
        obs/ee_pos (T, 3), obs/ee_ori (T, 3), obs/ee_states (T, 6),
        obs/gripper_states (T, 2), obs/joint_states (T, 7)
        actions (T, 7), states (T, D), robot_states (T, 9), rewards, dones (T,) u1

How the fields of the project's LIBERO env (envs/libero.py) are made from it:

* Alignment. The script replays the raw demo and appends the observation that `env.step(
  action_j)` RETURNS beside action_j (and the raw `states[j]`, which precede it): obs[k] is the
  scene after actions[k]. The chunk a demonstrator executed from obs[k] is therefore
  actions[k+1 : k+1+H]; the last row (nothing executed after it) is dropped, so a demo of T
  rows gives T - 1 samples. (LIBERO's own robomimic training pairs obs[k] with actions[k],
  one step late; OpenVLA's regenerate_libero_dataset.py re-records observations before each
  step for this reason, and writes files without the /data attributes read here.)
* Images. robosuite returns camera images in `macros_image_convention`: "opengl" (the
  default, and what LIBERO's files hold) is the MuJoCo render upside down, "opencv" upright.
  The env feeds the render rotated by 180 degrees, as OpenVLA/openpi feed LIBERO images
  (envs/libero.py: the upright render mirrored left-right), so an "opengl" image is rotated by
  180 degrees ([::-1, ::-1]) and an "opencv" one mirrored ([:, ::-1]). Checked pixel for pixel
  on LIBERO's env by tests/fixtures/demonstrations/make_fixtures.py (README.md there).
  Both cameras get the same treatment; images are resized to the spec's size when it differs.
* state. The script writes ee_pos = robot0_eef_pos, ee_ori = robosuite's
  quat2axisangle(robot0_eef_quat) and gripper_states = robot0_gripper_qpos. The 8-d
  axis_angle state is [ee_pos, ee_ori, gripper_states]; the 9-d quaternion state converts
  ee_ori back to the xyzw quaternion (common.axis_angle_to_quat, exact inverse).
* Instruction. LIBERO's benchmark (and so the env, OpenVLA and openpi) names a task by its
  BDDL file: the file name, less a libero_90/libero_10 scene prefix ("KITCHEN_SCENE3_"), with
  underscores as spaces. problem_info's language_instruction is the BDDL's `:language`, which
  can differ ("pick the akita black bowl ..." for "pick up the black bowl ..."), so the
  instruction is taken from bddl_file_name.
* Gripper. The files hold LIBERO's own command (-1 open, +1 closed). For a policy whose
  gripper reads +1 open / 0 closed (env.gripper_action=open_high: OFT's) it becomes
  1 - clip(g, 0, 1), as OFT's LIBERO datasets convert it (prismatic's libero transform).
* Success. Every demo of these files is a success (the script writes rewards[-1] = 1).
"""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath

import numpy as np

from hpcvla.demonstrations.common import (Episode, Problems, axis_angle_to_quat, fit_images,
                                          image_dtype_problem, open_high, rows_problem)
from hpcvla.metrics.dump import attr_text

NAME = "LIBERO dataset (scripts/create_dataset.py)"
CAMERAS = {"image": "agentview_rgb", "wrist_image": "eye_in_hand_rgb"}
STATE_KEYS = ("ee_pos", "ee_ori", "gripper_states")
STATE_FORMATS = {9: "quaternion", 8: "axis_angle"}  # envs/libero.py's STATE_DIMS, inverted
ROTATIONS = {"opengl": (slice(None, None, -1), slice(None, None, -1)),  # 180 degrees
             "opencv": (slice(None), slice(None, None, -1))}            # mirrored


def matches(f) -> bool:
    data = f.get("data")
    return data is not None and "problem_info" in data.attrs and any(
        n.startswith("demo_") and "obs" in data[n] for n in data)


def instruction_of(bddl_file_name: str) -> str:
    """The task's instruction as LIBERO's benchmark derives it from the BDDL file name."""
    stem = PurePosixPath(bddl_file_name.replace("\\", "/")).name
    stem = stem[:-len(".bddl")] if stem.endswith(".bddl") else stem
    stem = re.sub(r"^[A-Z][A-Z0-9_]*?SCENE\d+_", "", stem)
    return " ".join(stem.split("_"))


def _demo_names(data) -> list[str]:
    return sorted((n for n in data if n.startswith("demo_")),
                  key=lambda n: int(n.rsplit("_", 1)[-1]))


def scan(path, f, spec, problems: Problems) -> list[Episode]:
    data = f["data"]
    bddl = data.attrs.get("bddl_file_name")
    if bddl is None:
        problems.add(path, "/data.attrs[bddl_file_name]", None,
                     "the BDDL file name LIBERO's create_dataset.py writes (it names the task)")
        instruction = json.loads(attr_text(data.attrs["problem_info"])).get(
            "language_instruction", "")
    else:
        instruction = instruction_of(attr_text(bddl))
    convention = attr_text(data.attrs.get("macros_image_convention", "opengl"))
    if convention not in ROTATIONS:
        problems.add(path, "/data.attrs[macros_image_convention]", convention,
                     f"one of {', '.join(ROTATIONS)} (robosuite's image conventions)")
    needs = [CAMERAS[k] for k in CAMERAS if k in spec.obs]
    if "state" in spec.obs:
        dim = spec.obs["state"][0][0]
        if dim not in STATE_FORMATS:
            problems.add(path, "obs/state", dim, "a state of 9 (env.state_format=quaternion) "
                         "or 8 (axis_angle) dims: a LIBERO file has no other")
        needs += STATE_KEYS
    unknown = sorted(set(spec.obs) - {*CAMERAS, "state", "instruction"})
    if unknown:
        problems.add(path, "/data", unknown, "only image, wrist_image, state and instruction "
                     "fields in the spec: LIBERO's files hold no others")
    episodes = []
    for name in _demo_names(data):
        demo, key = data[name], f"/data/{name}"
        for k in needs:
            if f"obs/{k}" not in demo:
                field = next((fld for fld, cam in CAMERAS.items() if cam == k), "state")
                problems.add(path, f"{key}/obs/{k}", None,
                             f"obs/{k} for the spec's {field!r} field (the file has obs/"
                             f"{', obs/'.join(demo['obs'])}); use files recorded with it or "
                             f"set the env so that it has no {field}")
        actions = demo.get("actions")
        if actions is None or actions.ndim != 2 or actions.shape[1] != spec.action_dim:
            problems.add(path, f"{key}/actions", None if actions is None else
                         tuple(actions.shape), f"(T, {spec.action_dim}) actions: action_dim "
                         f"{spec.action_dim} of the spec (LIBERO's OSC_POSE actions are 7-d)")
        elif actions.shape[0] < 2:
            problems.add(path, f"{key}/actions", tuple(actions.shape),
                         "at least 2 steps (the last observation has no action after it)")
        else:
            for k in (k for k in needs if f"obs/{k}" in demo):
                dataset = demo[f"obs/{k}"]
                rows_problem(path, f"{key}/obs/{k}", dataset, len(actions),
                             "a row per actions row, as LIBERO records them", problems)
                if k in CAMERAS.values():
                    image_dtype_problem(path, f"{key}/obs/{k}", dataset, problems)
        rewards = demo.get("rewards")
        samples = actions.shape[0] - 1 if actions is not None and actions.ndim == 2 else 0
        episodes.append(Episode(str(path), key, instruction,
                                "/data.attrs[bddl_file_name]" if bddl is not None else
                                "/data.attrs[problem_info]",
                                bool(rewards is None or rewards[-1] > 0), max(samples, 0)))
    return episodes


def load(f, episode: Episode, spec, horizon: int | None = None
         ) -> tuple[dict, np.ndarray, np.ndarray]:
    """Obs rows 0..T-2 mapped to the spec's fields, and their `horizon` actions (default
    spec.chunk_len) from actions[1:]."""
    from hpcvla.demonstrations.common import chunks
    demo = f[episode.key]
    rotation = ROTATIONS[attr_text(f["data"].attrs.get("macros_image_convention", "opengl"))]
    obs = {}
    for field, camera in CAMERAS.items():
        if field in spec.obs:
            images = demo[f"obs/{camera}"][:-1]
            obs[field] = fit_images(images[(slice(None), *rotation)], spec.obs[field][0])
    if "state" in spec.obs:
        pos, ori, gripper = (demo[f"obs/{k}"][:-1].astype(np.float64) for k in STATE_KEYS)
        if STATE_FORMATS[spec.obs["state"][0][0]] == "quaternion":
            ori = axis_angle_to_quat(ori)
        obs["state"] = np.concatenate([pos, ori, gripper], axis=1).astype(
            np.dtype(spec.obs["state"][1]))
    actions = demo["actions"][1:]
    if spec.gripper == "open_high":  # module docstring: OFT's convention
        actions = open_high(actions)
    actions, pad = chunks(actions, horizon or spec.chunk_len)
    return obs, actions, pad
