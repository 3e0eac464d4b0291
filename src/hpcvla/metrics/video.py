"""Episode videos: the camera frames a policy acted on, one per action chunk, as H.264 MP4
through imageio's ffmpeg plugin (its own ffmpeg binary: nothing from the system). Each frame
is scaled up to at least MIN_SIDE pixels (simulator cameras are 32-256 px; nearest neighbour,
so the pixels the policy saw stay visible) above a caption bar: the step, the outcome so far
and the instruction."""

from __future__ import annotations

from pathlib import Path

import numpy as np

MIN_SIDE = 256
LINE_H = 12    # PIL's default bitmap font: ~6 x 11 px per character
BLOCK = 16     # H.264 encoders want sides that are multiples of 16: frames are padded to them


def caption_frame(image: np.ndarray, lines: list[str]) -> np.ndarray:
    """(H, W, 3) uint8 -> a larger (H', W', 3) uint8 frame: the image scaled up, the caption
    lines below it (cut to the frame's width), black padding to multiples of BLOCK."""
    from PIL import Image, ImageDraw

    scale = max(1, -(-MIN_SIDE // min(image.shape[:2])))
    big = np.repeat(np.repeat(np.asarray(image, np.uint8), scale, 0), scale, 1)
    h, w = big.shape[:2]
    height = h + LINE_H * len(lines) + 4
    canvas = Image.new("RGB", (-(-w // BLOCK) * BLOCK, -(-height // BLOCK) * BLOCK))
    canvas.paste(Image.fromarray(big), (0, 0))
    draw = ImageDraw.Draw(canvas)
    for k, line in enumerate(lines):
        draw.text((3, h + 2 + LINE_H * k), line[:max(1, w // 6)], fill=(255, 255, 255))
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


def read_video(path: Path) -> np.ndarray:
    """An MP4 decoded back: (frames, H, W, 3) uint8."""
    import imageio.v2 as imageio

    with imageio.get_reader(path, format="FFMPEG") as reader:
        return np.stack([frame for frame in reader])  # its length is unknown (inf)
