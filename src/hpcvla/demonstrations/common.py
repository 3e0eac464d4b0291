"""What every demonstration layout shares: the episode index a layout reports without reading
bulk data, the problem list, action chunks cut from per-step actions, images brought to the
spec's size and orientation, and LIBERO/robosuite's rotation formats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

Problem = tuple[str, Any, str]  # (where: "FILE:key", value, what is expected and the fix)


class DemonstrationError(ValueError):
    """Demonstration files that cannot be read for this spec; one line per problem."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        lines = [f"  {where} = {value!r}: expected {fix}" for where, value, fix in problems]
        super().__init__("unusable demonstrations:\n" + "\n".join(lines))


@dataclass
class Episode:
    """One demonstration as a layout's scan finds it (no bulk data read yet)."""

    path: str            # the file
    key: str             # its group in the file, e.g. "data/demo_3" or "traj_0"
    instruction: str     # the text the policy is given (the env's instruction for the task)
    instruction_key: str  # where the instruction came from, for messages ("FILE:key")
    success: bool
    rows: int = 0        # the samples it gives, from the file's headers (0: not known)


class Problems:
    """A problem list that keeps one entry per (file, message): a key missing from every demo
    of a file is reported once, at the first demo, with the count of the others."""

    def __init__(self):
        self.items: list[list] = []
        self._seen: dict[tuple[str, str], list] = {}

    def add(self, path, key: str, value, fix: str) -> None:
        seen = self._seen.get((str(path), fix))
        if seen is not None:
            seen[3] += 1
            return
        item = [f"{path}:{key}" if key else str(path), value, fix, 0]
        self._seen[(str(path), fix)] = item
        self.items.append(item)

    def __bool__(self) -> bool:
        return bool(self.items)

    def listed(self) -> list[Problem]:
        return [(where, value, fix + (f" (and in {more} more place{'s' if more > 1 else ''}"
                                      " in this file)" if more else ""))
                for where, value, fix, more in self.items]


def chunks(actions: np.ndarray, horizon: int,
           starts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(T, A) per-step actions -> (T, horizon, A) float32 chunks, row t = actions[t:t+horizon],
    and the (T, horizon) mask of padded entries; with `starts`, a row per start instead.

    Past the episode's end the last action is repeated. Nothing was recorded after it (the task
    succeeded or the horizon came), so any value is made up; zeros would be a command of their
    own (LIBERO's and ManiSkill's gripper at 0 is half-open, not "as before"), while the last
    action keeps the gripper where the demonstrator left it. This is also what LeRobot's
    datasets give (frame indices clamped to the episode, with an `action_is_pad` mask); the
    mask is returned so that a loss can leave the padding out."""
    T = len(actions)
    starts = np.arange(T) if starts is None else np.asarray(starts)
    steps = starts[:, None] + np.arange(horizon)[None, :]
    return (np.asarray(actions, dtype=np.float32)[np.minimum(steps, T - 1)],
            steps > T - 1)


def open_high(actions: np.ndarray) -> np.ndarray:
    """(T, A) actions whose last dim is LIBERO's gripper command (-1 open, +1 closed) in the
    convention of env.gripper_action=open_high (OFT's: +1 open, 0 closed): 1 - clip(g, 0, 1),
    as OFT's LIBERO datasets convert it (prismatic's libero transform)."""
    return np.concatenate([actions[:, :-1], 1.0 - np.clip(actions[:, -1:], 0.0, 1.0)],
                          axis=1).astype(actions.dtype)


def fit_images(images: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """(N, h, w, 3) uint8 images at the spec's (S, S, 3): resized with PIL's antialiased
    bilinear filter when the size differs (a non-square image is squashed, not cropped)."""
    if images.shape[1:] == tuple(shape):
        return np.ascontiguousarray(images, dtype=np.uint8)
    from PIL import Image  # Pillow comes with matplotlib (requirements.txt)
    height, width = shape[:2]
    return np.stack([np.asarray(Image.fromarray(np.asarray(img, dtype=np.uint8)).resize(
        (width, height), Image.Resampling.BILINEAR)) for img in images])


def axis_angle_to_quat(vectors: np.ndarray) -> np.ndarray:
    """(..., 3) axis-angle vectors (axis scaled by the angle) -> (..., 4) xyzw quaternions.

    w = cos(angle / 2) without folding the angle into [0, pi], so robosuite's quat2axisangle
    (angle = 2 acos(w), in [0, 2 pi]) is undone exactly, sign of the quaternion included, and
    the result equals the env's robot0_eef_quat; a zero vector is the identity (0, 0, 0, 1), as
    in robosuite's axisangle2quat."""
    vectors = np.asarray(vectors, dtype=np.float64)
    angle = np.linalg.norm(vectors, axis=-1, keepdims=True)
    axis = vectors / np.where(angle > 0, angle, 1.0)
    return np.concatenate([axis * np.sin(angle / 2), np.cos(angle / 2)], axis=-1)


def image_dtype_problem(path, key: str, dataset, problems: Problems) -> None:
    """Images must be stored as uint8 (0-255): others would be cast to it on reading, floats
    in [0, 1] to black frames."""
    if np.dtype(dataset.dtype) != np.uint8:
        problems.add(path, key, str(dataset.dtype),
                     "uint8 images (0-255), as the envs give them: other values are cast to "
                     "uint8 on reading (floats in [0, 1] become black); convert them, e.g. "
                     "(x * 255).round().astype(np.uint8)")


def rows_problem(path, key: str, dataset, rows: int, pairing: str, problems: Problems) -> None:
    """A dataset of a demo whose first axis is not `rows` long: its rows would be paired with
    other steps' (`pairing` says how the layout pairs them)."""
    have = getattr(dataset, "shape", ())
    if have and have[0] != rows:
        problems.add(path, key, f"{have[0]} rows against {rows}",
                     f"{pairing}; the file is cut or misassembled: write it again")


def is_image(entry) -> bool:
    """An EnvSpec obs entry (shape, dtype) that holds an RGB image."""
    shape, dtype = entry
    return len(shape) == 3 and shape[2] == 3 and np.dtype(dtype) == np.uint8


