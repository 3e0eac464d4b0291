"""Charts as PNG files from numpy and zlib alone: a pixel canvas, a 5x7 font (capitals,
digits, punctuation), axes with ticks, line/bar/swimlane charts, and a PNG encoder/decoder.

matplotlib is not an hpcvla dependency (requirements.txt pins the whole stack and every test
runs in CI), so the reports draw their few chart types themselves: filled rectangles, lines
and text are all they need.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import numpy as np

WHITE, BLACK, GREY, LIGHT = (255, 255, 255), (0, 0, 0), (120, 120, 120), (225, 225, 225)
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]

# 5x7 glyphs, rows top to bottom; lowercase letters are drawn as capitals.
_GLYPHS = """
0 .###. #...# #..## #.#.# ##..# #...# .###.
1 ..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.
2 .###. #...# ....# ...#. ..#.. .#... #####
3 ##### ...#. ..#.. ...#. ....# #...# .###.
4 ...#. ..##. .#.#. #..#. ##### ...#. ...#.
5 ##### #.... ####. ....# ....# #...# .###.
6 ..##. .#... #.... ####. #...# #...# .###.
7 ##### ....# ...#. ..#.. .#... .#... .#...
8 .###. #...# #...# .###. #...# #...# .###.
9 .###. #...# #...# .#### ....# ...#. .##..
A .###. #...# #...# ##### #...# #...# #...#
B ####. #...# #...# ####. #...# #...# ####.
C .###. #...# #.... #.... #.... #...# .###.
D ###.. #..#. #...# #...# #...# #..#. ###..
E ##### #.... #.... ####. #.... #.... #####
F ##### #.... #.... ####. #.... #.... #....
G .###. #...# #.... #.### #...# #...# .####
H #...# #...# #...# ##### #...# #...# #...#
I .###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.
J ..### ...#. ...#. ...#. ...#. #..#. .##..
K #...# #..#. #.#.. ##... #.#.. #..#. #...#
L #.... #.... #.... #.... #.... #.... #####
M #...# ##.## #.#.# #.#.# #...# #...# #...#
N #...# #...# ##..# #.#.# #..## #...# #...#
O .###. #...# #...# #...# #...# #...# .###.
P ####. #...# #...# ####. #.... #.... #....
Q .###. #...# #...# #...# #.#.# #..#. .##.#
R ####. #...# #...# ####. #.#.. #..#. #...#
S .#### #.... #.... .###. ....# ....# ####.
T ##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..
U #...# #...# #...# #...# #...# #...# .###.
V #...# #...# #...# #...# #...# .#.#. ..#..
W #...# #...# #...# #.#.# #.#.# #.#.# .#.#.
X #...# #...# .#.#. ..#.. .#.#. #...# #...#
Y #...# #...# .#.#. ..#.. ..#.. ..#.. ..#..
Z ##### ....# ...#. ..#.. .#... #.... #####
. ..... ..... ..... ..... ..... .##.. .##..
, ..... ..... ..... ..... .##.. ..#.. .#...
: ..... .##.. .##.. ..... .##.. .##.. .....
- ..... ..... ..... ##### ..... ..... .....
+ ..... ..#.. ..#.. ##### ..#.. ..#.. .....
= ..... ..... ##### ..... ##### ..... .....
( ...#. ..#.. .#... .#... .#... ..#.. ...#.
) .#... ..#.. ...#. ...#. ...#. ..#.. .#...
/ ..... ....# ...#. ..#.. .#... #.... .....
% ##... ##..# ...#. ..#.. .#... #..## ...##
_ ..... ..... ..... ..... ..... ..... #####
[ .###. .#... .#... .#... .#... .#... .###.
] .###. ...#. ...#. ...#. ...#. ...#. .###.
< ...#. ..#.. .#... #.... .#... ..#.. ...#.
> .#... ..#.. ...#. ....# ...#. ..#.. .#...
! ..#.. ..#.. ..#.. ..#.. ..#.. ..... ..#..
? .###. #...# ....# ...#. ..#.. ..... ..#..
* ..... ..#.. #.#.# .###. #.#.# ..#.. .....
| ..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#..
' ..#.. ..#.. .#... ..... ..... ..... .....
"""
FONT = {line[0]: np.array([[c == "#" for c in row] for row in line[2:].split()])
        for line in _GLYPHS.strip().splitlines()}
FONT[" "] = np.zeros((7, 5), bool)
GLYPH_W, GLYPH_H = 6, 7  # advance (5 + 1 space), height


def text_width(s: str, scale: int = 1) -> int:
    return len(s) * GLYPH_W * scale


class Canvas:
    """RGB pixels, (0, 0) top left; drawing is clipped to the canvas."""

    def __init__(self, width: int, height: int, background=WHITE):
        self.pixels = np.empty((height, width, 3), np.uint8)
        self.pixels[...] = background
        self.height, self.width = height, width

    def rect(self, x0, y0, x1, y1, color) -> None:
        """Fill [x0, x1) x [y0, y1)."""
        x0, x1 = (int(round(max(0, min(self.width, v)))) for v in sorted((x0, x1)))
        y0, y1 = (int(round(max(0, min(self.height, v)))) for v in sorted((y0, y1)))
        self.pixels[y0:y1, x0:x1] = color

    def line(self, x0, y0, x1, y1, color, width: int = 2) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        xs = np.rint(np.linspace(x0, x1, n)).astype(int)
        ys = np.rint(np.linspace(y0, y1, n)).astype(int)
        for dx in range(width):
            for dy in range(width):
                x, y = xs + dx - width // 2, ys + dy - width // 2
                ok = (x >= 0) & (x < self.width) & (y >= 0) & (y < self.height)
                self.pixels[y[ok], x[ok]] = color

    def text(self, x, y, s: str, color=BLACK, scale: int = 1, align: str = "left") -> None:
        """`s` with its top at y; `align` left/center/right about x."""
        x -= {"left": 0, "center": text_width(s, scale) // 2,
              "right": text_width(s, scale)}[align]
        for i, ch in enumerate(s):
            glyph = FONT.get(ch.upper(), FONT["?"])
            rows, cols = np.nonzero(glyph)
            for dy in range(scale):
                for dx in range(scale):
                    px = int(x) + i * GLYPH_W * scale + cols * scale + dx
                    py = int(y) + rows * scale + dy
                    ok = (px >= 0) & (px < self.width) & (py >= 0) & (py < self.height)
                    self.pixels[py[ok], px[ok]] = color

    def save(self, path) -> None:
        write_png(path, self.pixels)


def write_png(path, rgb: np.ndarray) -> None:
    """An 8-bit RGB PNG (no filtering; zlib does the work)."""
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + \
            struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" +
                           chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
                           chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) +
                           chunk(b"IEND", b""))


def read_png(path) -> np.ndarray:
    """Pixels of a PNG written by `write_png` (8-bit RGB, unfiltered); checks every CRC."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG file")
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(tag + body) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: bad CRC in {tag!r}")
        if tag == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif tag == b"IDAT":
            idat += body
        pos += 12 + length
    w, h, depth, colour = header[:4]
    if (depth, colour) != (8, 2):
        raise ValueError(f"{path}: only 8-bit RGB is read here")
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    if raw[:, 0].any():
        raise ValueError(f"{path}: filtered scanlines are not read here")
    return raw[:, 1:].reshape(h, w, 3)


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / count
    step = min(s * 10 ** math.floor(math.log10(raw)) for s in (1, 2, 5, 10)
               if s * 10 ** math.floor(math.log10(raw)) >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


class Axes:
    """A plot area on a canvas with data limits, a frame, ticks and labels."""

    def __init__(self, canvas: Canvas, box, xlim, ylim):
        self.c, (self.left, self.top, self.right, self.bottom) = canvas, box
        self.xlim, self.ylim = xlim, ylim

    def x(self, v):
        lo, hi = self.xlim
        return self.left + (v - lo) / ((hi - lo) or 1) * (self.right - self.left)

    def y(self, v):
        lo, hi = self.ylim
        return self.bottom - (v - lo) / ((hi - lo) or 1) * (self.bottom - self.top)

    def frame(self, title="", xlabel="", ylabel="", xticks=True, yticks=True) -> None:
        c = self.c
        if yticks:
            for v in nice_ticks(*self.ylim):
                c.rect(self.left, self.y(v), self.right, self.y(v) + 1, LIGHT)
                c.text(self.left - 5, self.y(v) - 3, f"{v:g}", GREY, align="right")
        if xticks:
            for v in nice_ticks(*self.xlim, count=8):
                c.rect(self.x(v), self.bottom, self.x(v) + 1, self.bottom + 4, GREY)
                c.text(self.x(v), self.bottom + 7, f"{v:g}", GREY, align="center")
        c.rect(self.left, self.bottom, self.right + 1, self.bottom + 1, BLACK)
        c.rect(self.left, self.top, self.left + 1, self.bottom + 1, BLACK)
        c.text((self.left + self.right) / 2, 10, title, BLACK, scale=2, align="center")
        c.text((self.left + self.right) / 2, self.bottom + 22, xlabel, BLACK, align="center")
        c.text(10, self.top - 14, ylabel, BLACK)


def legend(canvas: Canvas, x: int, y: int, entries) -> None:
    """Coloured squares with labels, in one row from (x, y), wrapping at the canvas edge."""
    for label, color in entries:
        if x + 14 + text_width(label) > canvas.width - 10:
            x, y = 10, y + 14
        canvas.rect(x, y, x + 9, y + 9, color)
        canvas.text(x + 13, y + 1, label)
        x += 30 + text_width(label)


def line_chart(path, series: dict, title: str, xlabel: str, ylabel: str, ylim=None,
               width: int = 900, height: int = 420, colors: dict | None = None) -> None:
    """series: label -> (xs, ys); `colors` (label -> RGB) overrides the palette."""
    xs = [x for sx, _ in series.values() for x in sx] or [0, 1]
    ys = [y for _, sy in series.values() for y in sy] or [0, 1]
    c = Canvas(width, height)
    ax = Axes(c, (70, 50, width - 20, height - 70), (min(xs), max(xs)),
              ylim or (min(0, min(ys)), max(ys) * 1.05 or 1))
    ax.frame(title, xlabel, ylabel)
    entries = []
    for i, (label, (sx, sy)) in enumerate(series.items()):
        color = (colors or {}).get(label, PALETTE[i % len(PALETTE)])
        points = [(ax.x(x), ax.y(y)) for x, y in zip(sx, sy)]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            c.line(x0, y0, x1, y1, color)
        if len(points) == 1:
            c.rect(points[0][0] - 2, points[0][1] - 2, points[0][0] + 3, points[0][1] + 3, color)
        entries.append((label, color))
    legend(c, 10, height - 32, entries)
    c.save(path)


def bar_chart(path, categories: list[str], series: dict, title: str, ylabel: str,
              markers: dict | None = None, width: int = 900, height: int = 420) -> None:
    """Grouped bars: series label -> one value per category (None: no bar). `markers`
    (label -> values) draws a black tick per category, e.g. an upper bound."""
    values = [v for vs in [*series.values(), *(markers or {}).values()] for v in vs
              if v is not None] or [1]
    c = Canvas(width, height)
    ax = Axes(c, (70, 50, width - 20, height - 80), (0, len(categories)),
              (0, max(values) * 1.1 or 1))
    ax.frame(title, "", ylabel, xticks=False)
    group = 0.8 / max(1, len(series))
    entries = []
    for s, (label, vals) in enumerate(series.items()):
        color = PALETTE[s % len(PALETTE)]
        for i, v in enumerate(vals):
            if v is not None:
                x0 = ax.x(i + 0.1 + s * group)
                c.rect(x0, ax.y(v), ax.x(i + 0.1 + (s + 1) * group) - 1, ax.y(0), color)
        entries.append((label, color))
    for label, vals in (markers or {}).items():
        for i, v in enumerate(vals):
            if v is not None:
                c.rect(ax.x(i + 0.05), ax.y(v) - 1, ax.x(i + 0.95), ax.y(v) + 2, BLACK)
        entries.append((label, BLACK))
    for i, name in enumerate(categories):
        c.text(ax.x(i + 0.5), ax.bottom + 7, name[:150 // GLYPH_W], align="center")
    legend(c, 10, height - 32, entries)
    c.save(path)


def swimlane(path, lanes: list, colors: dict, title: str, window=None,
             width: int = 1000) -> None:
    """lanes: [(label, [(start, end, stage), ...])]; one row per lane, a coloured bar per
    busy span, white = idle. `window` = (t0, t1) zooms in."""
    starts = [s for _, spans in lanes for s, _, _ in spans] or [0]
    ends = [e for _, spans in lanes for _, e, _ in spans] or [1]
    t0, t1 = window or (min(starts), max(ends))
    lane_h, top = 16, 50
    height = top + lane_h * len(lanes) + 70
    c = Canvas(width, height)
    ax = Axes(c, (150, top, width - 20, top + lane_h * len(lanes)), (t0, t1), (0, 1))
    for i, (label, spans) in enumerate(lanes):
        y0 = top + i * lane_h
        c.rect(ax.left, y0 + 2, ax.right, y0 + lane_h - 2, (245, 245, 245))
        for start, end, stage in spans:
            if end < t0 or start > t1:
                continue
            x0, x1 = ax.x(max(start, t0)), ax.x(min(end, t1))
            c.rect(x0, y0 + 2, max(x1, x0 + 1), y0 + lane_h - 2, colors[stage])
        c.text(ax.left - 6, y0 + 4, label, align="right")
    ax.frame(title, "time (s)", "", yticks=False)
    legend(c, 10, height - 30, [(stage, color) for stage, color in colors.items()] +
           [("idle", (245, 245, 245))])
    c.save(path)
