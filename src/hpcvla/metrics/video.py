"""Episode videos: the camera frames a policy acted on, one per action chunk, as H.264 MP4
through imageio's ffmpeg plugin (its own ffmpeg binary: nothing from the system). Each frame
is scaled up to at least MIN_SIDE pixels (simulator cameras are 32-256 px; nearest neighbour,
so the pixels the policy saw stay visible) above a caption bar: which episode, the step and
the instruction; a last frame repeats the last image with the outcome."""

from __future__ import annotations

from pathlib import Path

import numpy as np

MIN_SIDE = 256
LINE_H = 12    # PIL's default bitmap font: ~6 x 11 px per character
BLOCK = 16     # H.264 encoders want sides that are multiples of 16: frames are padded to them


def caption_frame(image: np.ndarray, lines: list[str]) -> np.ndarray:
    """(H, W, 3) uint8 -> a larger (H', W', 3) uint8 frame: the image scaled up, the caption
    lines below it (wrapped to the frame's width), black padding to multiples of BLOCK."""
    import textwrap

    from PIL import Image, ImageDraw

    scale = max(1, -(-MIN_SIDE // min(image.shape[:2])))
    big = np.repeat(np.repeat(np.asarray(image, np.uint8), scale, 0), scale, 1)
    h, w = big.shape[:2]
    lines = [part for line in lines for part in textwrap.wrap(line, max(1, w // 6)) or [""]]
    height = h + LINE_H * len(lines) + 4
    canvas = Image.new("RGB", (-(-w // BLOCK) * BLOCK, -(-height // BLOCK) * BLOCK))
    canvas.paste(Image.fromarray(big), (0, 0))
    draw = ImageDraw.Draw(canvas)
    for k, line in enumerate(lines):
        draw.text((3, h + 2 + LINE_H * k), line, fill=(255, 255, 255))
    return np.asarray(canvas)


def write_video(path: Path, frames: list[np.ndarray], fps: int = 4) -> Path:
    """Frames of one size (caption_frame's) as an MP4 at `fps` frames per second."""
    import imageio.v2 as imageio

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with imageio.get_writer(path, fps=fps, codec="libx264", quality=8,
                            macro_block_size=BLOCK) as writer:
        for frame in frames:
            writer.append_data(frame)
    return path


def episode_video(path: Path, images: list[np.ndarray], steps: list[int], header: str,
                  instruction: str, outcome: str, end: int) -> str:
    """One episode as an MP4: each image captioned with `header`, the step it was seen at and
    the instruction, then the last image again with the outcome and the step it ended at."""
    frames = [caption_frame(image, [header, f"step {step}", instruction])
              for image, step in zip(images, steps)]
    frames.append(caption_frame(images[-1], [header, f"{outcome} at step {end}",
                                             instruction]))
    return str(write_video(path, frames))


def dump_videos(path: Path, count: int, out_dir: Path) -> list[str]:
    """The first `count` episodes of an HDF5 trajectory dump (metrics/dump.py) as MP4 in
    `out_dir`, `demo_<i>-<success|failure>.mp4`: the camera (and wrist camera) each chunk
    was chosen from. Read as every dump reader reads (metrics/dump.py): without HDF5's file
    lock, a damaged part named as a DumpError."""
    from hpcvla.metrics.dump import _reading, attr_text, open_dump
    episodes = []
    with open_dump(path) as f:
        chunk = int(f.attrs.get("chunk_len", 1))
        for name in sorted(f["data"], key=lambda n: int(n.split("_")[-1]))[:count]:
            demo = f["data"][name]
            if "image" not in demo["obs"]:
                raise ValueError(f"{path}: no camera in its observations (env.camera=false)")
            with _reading(path):  # only the reads: a damaged chunk is the file's fault
                cameras = [demo["obs"][k][()] for k in ("image", "wrist_image")
                           if k in demo["obs"]]
                versions, a = demo["policy_versions"][()], dict(demo.attrs)
            episodes.append((name, np.concatenate(cameras, axis=2), versions, a))
    written = []
    for name, images, versions, a in episodes:
        outcome = "success" if a["success"] else "failure"
        played = f"v{versions.min()}" if versions.min() == versions.max() else \
            f"v{versions.min()}-v{versions.max()}"
        header = f"{attr_text(a['env_id'])} ep {a['episode']}, policy {played}"
        written.append(episode_video(
            Path(out_dir) / f"{name}-{outcome}.mp4", list(images),
            [t * chunk for t in range(len(images))], header, attr_text(a["instruction"]),
            outcome, int(a.get("env_steps", len(images) * chunk))))
    return written


def read_video(path: Path) -> np.ndarray:
    """An MP4 decoded back: (frames, H, W, 3) uint8."""
    import imageio.v2 as imageio

    with imageio.get_reader(path, format="FFMPEG") as reader:
        return np.stack([frame for frame in reader])  # its length is unknown (inf)


def gif_bytes(frames: np.ndarray, fps: int = 4) -> bytes:
    """Frames (N, H, W, 3) uint8 as an animated GIF that loops (TensorBoard's image plugin
    plays one: its `add_video` would need moviepy for the same bytes)."""
    import imageio.v3 as iio

    return iio.imwrite("<bytes>", np.asarray(frames, np.uint8), extension=".gif",
                       duration=1000 / fps, loop=0)
