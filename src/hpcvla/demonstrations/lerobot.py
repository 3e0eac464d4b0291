"""LeRobot datasets (a folder: meta/info.json, parquet frames, mp4 videos), as LeRobot's
LeRobotDataset writes them, formats v2.0/v2.1 (one parquet and one mp4 per episode) and v3.0
(files of many episodes, located by meta/episodes/); what π0 and OFT users have for LIBERO
(physical-intelligence/libero, lerobot/libero, HuggingFaceVLA/libero):

    meta/info.json     codebase_version, fps, features {key: {dtype, shape, names}},
                       data_path and video_path templates, chunks_size
    meta/episodes.jsonl + tasks.jsonl (v2.x) or meta/episodes/*/*.parquet + tasks.parquet (v3.0)
    data/...parquet    one row per frame: each non-video feature, episode_index, frame_index,
                       index, task_index; a feature of dtype "image" as PNG bytes
    videos/...mp4      one stream per video feature (v3.0: episodes one after another)

How the env's fields are made from it:

* Alignment. Frame t holds the observation and the action executed from it (LeRobot's
  convention), so the chunk from frame t is actions[t : t+H]: T frames give T samples.
* Fields. The features are found by name (FIELDS: LeRobot's `observation.images.image`,
  `observation.images.image2` or `observation.images.wrist_image`, `observation.state`,
  `action`, and openpi's `image`, `wrist_image`, `state`, `actions`). Images are taken as they
  are stored (LIBERO's datasets hold the camera turned by 180 degrees, as the env feeds it) and
  resized to the spec's size. The state must have the spec's dims (LIBERO's datasets: 8, the
  env's axis_angle format).
* Gripper. The last action dim is the gripper. A dataset holding negative gripper commands is
  in LIBERO's convention (-1 open, +1 closed: the simulator's); for an env that reads +1 open /
  0 closed (env.gripper_action=open_high: OFT's) it is converted as LIBERO's own files are
  (common.open_high). One with none below 0 for an env of LIBERO's convention is refused.
* Video frames are decoded by imageio-ffmpeg's ffmpeg (requirements.txt; it decodes AV1, the
  codec LeRobot writes): the episode's frames in order from its start time (v3.0's
  `videos/<key>/from_timestamp`), one per frame of the episode.
* Success. A `next.success` feature gives it (its last frame); without one every episode is a
  demonstration that succeeded (LeRobot's LIBERO datasets hold only such).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from hpcvla.demonstrations.common import Episode, Problems, chunks, fit_images, open_high

NAME = "LeRobot dataset"
MARK = "meta/info.json"
VERSIONS = ("v2.0", "v2.1", "v3.0")
# the spec's fields and the features that hold them, in order of preference
FIELDS = {"image": ("observation.images.image", "image"),
          "wrist_image": ("observation.images.wrist_image", "observation.images.image2",
                          "wrist_image"),
          "state": ("observation.state", "state")}
ACTIONS = ("action", "actions")


def matches(path) -> bool:
    return (Path(path) / MARK).is_file()


class Dataset:
    """One dataset's metadata, and its frames and video by episode (the last parquet file
    read is kept: v3.0's files hold many episodes, read in order)."""

    def __init__(self, root, features: dict[str, str] | None = None):
        import pyarrow.parquet as pq
        self.root, self.named = Path(root), dict(features or {})  # sft.features
        self.info = json.loads((self.root / MARK).read_text())
        self.version = self.info.get("codebase_version", "")
        self.features = self.info.get("features", {})
        if self.version.startswith("v2"):
            self.episodes = _jsonl(self.root / "meta/episodes.jsonl")
        else:
            self.episodes = [row for path in sorted((self.root / "meta/episodes").glob(
                "*/*.parquet")) for row in pq.read_table(path, columns=[
                    c for c in pq.read_schema(path).names if not c.startswith("stats/")]
                ).to_pylist()]  # not the per-episode statistics of every feature
        self.by_key = {str(e["episode_index"]): e for e in self.episodes}  # Episode.key
        self._table: tuple[Path, object] | None = None
        self._closed_high: bool | None = None

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self._table = None

    def closed_high(self) -> bool:
        """Whether the gripper commands (the last action dim) are LIBERO's -1 open / +1
        closed: some are below 0 (every data file's action column is read, once)."""
        import pyarrow.parquet as pq
        if self._closed_high is None:
            key = self.key("actions")
            files = sorted({self.data_file(e) for e in self.episodes})
            self._closed_high = any(
                np.min(np.asarray(pq.read_table(f, columns=[key])[key].to_pylist())[:, -1]) < 0
                for f in files)
        return self._closed_high

    def key(self, field: str) -> str | None:
        """The feature that holds `field`: sft.features', or the first of its known names."""
        if field in self.named:
            return self.named[field] if self.named[field] in self.features else None
        names = ACTIONS if field == "actions" else FIELDS[field]
        return next((k for k in names if k in self.features), None)

    def _located(self, episode: dict, prefix: str) -> dict:
        """The template keys of an episode's file: v2.x by episode, v3.0 by chunk and file."""
        index = episode["episode_index"]
        return {"episode_index": index,
                "episode_chunk": index // int(self.info.get("chunks_size", 1000)),
                "chunk_index": episode.get(f"{prefix}/chunk_index"),
                "file_index": episode.get(f"{prefix}/file_index")}

    def data_file(self, episode: dict) -> Path:
        return self.root / self.info["data_path"].format(**self._located(episode, "data"))

    def video_file(self, episode: dict, key: str) -> Path:
        return self.root / self.info["video_path"].format(
            video_key=key, **self._located(episode, f"videos/{key}"))

    def frames(self, episode: dict, columns: list[str]):
        """The episode's rows of `columns`, in frame order (a pyarrow table)."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        path = self.data_file(episode)
        if self._table is None or self._table[0] != path:
            self._table = (path, pq.read_table(path))
        table = self._table[1]
        table = table.filter(pc.equal(table["episode_index"], episode["episode_index"]))
        return table.sort_by("frame_index").select(columns)

    def video(self, episode: dict, key: str, frames: int) -> np.ndarray:
        """(frames, h, w, 3) uint8: the episode's frames of video feature `key`."""
        import imageio_ffmpeg
        start = float(episode.get(f"videos/{key}/from_timestamp", 0.0))
        fps = float(self.info["fps"])
        # an accurate seek to half a frame before the first: its frame is the first decoded
        reader = imageio_ffmpeg.read_frames(
            str(self.video_file(episode, key)),
            input_params=["-ss", f"{max(start - 0.5 / fps, 0.0):.6f}"] if start > 0 else [])
        width, height = next(reader)["size"]
        out = []
        for raw in reader:
            out.append(np.frombuffer(raw, np.uint8).reshape(height, width, 3))
            if len(out) == frames:
                break
        reader.close()
        if len(out) < frames:
            raise ValueError(f"{self.video_file(episode, key)}: {len(out)} frames of episode "
                             f"{episode['episode_index']} decoded, {frames} expected")
        return np.stack(out)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def scan(path, d: Dataset, spec, problems: Problems) -> list[Episode]:
    if d.version not in VERSIONS:
        problems.add(path, MARK + ":codebase_version", d.version,
                     f"one of {', '.join(VERSIONS)} (LeRobot's dataset formats read here); "
                     "convert older ones with LeRobot's convert_dataset_v1_to_v2 / v21_to_v30")
        return []
    features = ", ".join(d.features)
    for field, key in d.named.items():
        if field not in (*FIELDS, "actions"):
            problems.add(path, "sft.features", field, f"one of {', '.join(FIELDS)}, actions "
                         "(the fields a LeRobot dataset's features give)")
        elif key not in d.features:
            problems.add(path, MARK + ":features", features, f"the feature {key} that "
                         f"sft.features names for {field}; name one of these")
    for field in (f for f in spec.obs if f != "instruction"):
        _check_field(path, d, field, spec, problems, features)
    actions = d.key("actions")
    if actions is None and "actions" not in d.named:  # a named one missing: said above
        problems.add(path, MARK + ":features", features, f"an action feature ({', '.join(ACTIONS)}"
                     "), or sft.features naming it")
    elif actions is not None and tuple(d.features[actions]["shape"]) != (spec.action_dim,):
        problems.add(path, f"{MARK}:features.{actions}.shape", d.features[actions]["shape"],
                     f"({spec.action_dim},): action_dim of the spec; the dataset is of another env")
    elif actions is not None and spec.gripper and d.episodes:
        _check_gripper(path, d, actions, spec, problems)
    tasks = _tasks(d)
    episodes = []
    for e in d.episodes:
        names = e.get("tasks") or [tasks.get(i) for i in e.get("task_index", [])]
        where = f"episode {e['episode_index']}"
        if len(names) != 1:
            problems.add(path, where + ":tasks", names, "one task per episode (its instruction)")
            continue
        for key in {d.key(f) for f in spec.obs if f in FIELDS} - {None}:
            if d.features[key]["dtype"] == "video" and not d.video_file(e, key).is_file():
                problems.add(path, where, str(d.video_file(e, key)), f"the video of {key}")
        episodes.append(Episode(str(path), str(e["episode_index"]), names[0],
                                f"{where}:tasks", _success(d, e), int(e.get("length", 0))))
    return episodes


def _check_field(path, d: Dataset, field: str, spec, problems: Problems, features: str) -> None:
    """The feature for one of the spec's fields (FIELDS has each but the instruction: an
    EnvSpec has no other): there, and of the field's kind."""
    key = d.key(field)
    if key is None and field not in d.named:  # a named one missing: said by scan
        problems.add(path, MARK + ":features", features,
                     f"a feature for the spec's {field!r} (one of {', '.join(FIELDS[field])}), "
                     f"or sft.features naming it; or set the env so that it has no {field}")
    elif key is None:
        return
    elif (d.features[key]["dtype"] in ("image", "video")) != (field != "state"):
        problems.add(path, f"{MARK}:features.{key}.dtype", d.features[key]["dtype"],
                     f"{'a number vector' if field == 'state' else 'image or video'} for the "
                     f"spec's {field!r}")
    elif field == "state" and tuple(d.features[key]["shape"]) != spec.obs["state"][0]:
        problems.add(path, f"{MARK}:features.{key}.shape", d.features[key]["shape"],
                     f"{spec.obs['state'][0]}, the env's state (LeRobot's LIBERO datasets "
                     "hold 8 dims: env.state_format=axis_angle)")


def _tasks(d: Dataset) -> dict[int, str]:
    if d.version.startswith("v2"):
        return {t["task_index"]: t["task"] for t in _jsonl(d.root / "meta/tasks.jsonl")}
    import pyarrow.parquet as pq
    rows = pq.read_table(d.root / "meta/tasks.parquet").to_pylist()
    return {row["task_index"]: row["task"] for row in rows}


def _check_gripper(path, d: Dataset, key: str, spec, problems: Problems) -> None:
    """The dataset's gripper convention against the env's (module docstring)."""
    if spec.gripper == "closed_high" and not d.closed_high():
        problems.add(path, f"{key}[:, -1]", None,
                     "gripper commands of the env's convention (-1 open, +1 closed), as "
                     "LeRobot's LIBERO datasets hold them: this dataset holds none below 0 "
                     "(OFT's +1 open / 0 closed?): env.gripper_action=open_high")


def _success(d: Dataset, episode: dict) -> bool:
    if "next.success" not in d.features:
        return True
    return bool(d.frames(episode, ["next.success"])["next.success"][-1].as_py())


def load(d: Dataset, episode: Episode, spec, horizon: int | None = None
         ) -> tuple[dict, np.ndarray, np.ndarray]:
    """Every frame's observation and the `horizon` actions from it (default the chunk
    executed, spec.chunk_len)."""
    meta = d.by_key[episode.key]
    keys = {f: d.key(f) for f in spec.obs if f in FIELDS}
    stored = [k for k in keys.values() if d.features[k]["dtype"] != "video"]
    table = d.frames(meta, [d.key("actions"), *stored])
    actions = np.asarray(table[d.key("actions")].to_pylist(), dtype=np.float32)
    obs = {}
    for field, key in keys.items():
        shape, dtype = spec.obs[field]
        if d.features[key]["dtype"] == "video":
            obs[field] = fit_images(d.video(meta, key, len(actions)), shape)
        elif d.features[key]["dtype"] == "image":
            obs[field] = fit_images(np.stack([_png(cell) for cell in table[key].to_pylist()]),
                                    shape)
        else:
            obs[field] = np.asarray(table[key].to_pylist(), dtype=np.dtype(dtype))
    if spec.gripper == "open_high" and d.closed_high():
        actions = open_high(actions)
    actions, pad = chunks(actions, horizon or spec.chunk_len)
    return obs, actions, pad


def _png(cell: dict) -> np.ndarray:
    """An "image" feature's cell ({"bytes", "path"}: Hugging Face datasets' Image) as HWC."""
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(cell["bytes"])).convert("RGB"))
