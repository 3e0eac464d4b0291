"""Report and benchmark charts as PNG files, drawn by matplotlib's Agg backend.

Each function builds its own `Figure` and renders it through `FigureCanvasAgg`: no pyplot,
so no global figure state, no GUI backend and nothing to close, which keeps it safe inside
MPI ranks, threads and tests. Every PNG is exactly `size` pixels (width, height): the layout
is constrained inside the figure instead of cropped with `bbox_inches="tight"`, so callers
and tests know the size beforehand.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from hpcvla.metrics.stats import t_critical

# matplotlib's tab10, as hex: series colours in order.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
# One colour per pipeline stage, the same in every run and report, so timelines of different
# runs (and of different days) can be compared by eye. Order = legend order.
STAGE_COLORS = {"simulate": "#2ca02c", "infer": "#1f77b4", "assemble": "#17becf",
                "dump": "#9467bd", "train": "#d62728", "wait_data": "#c8c8c8",
                "publish": "#ff7f0e", "checkpoint": "#8c564b", "send": "#6baed6",
                "ring_full": "#e0e0e0"}
# Stages not listed above: picked by a stable hash of the name (crc32, not Python's salted
# hash), from colours no listed stage uses.
FALLBACK_COLORS = ["#e377c2", "#bcbd22", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a",
                   "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5"]
DPI = 100


def stage_color(stage: str) -> str:
    """The fixed colour of `stage`; unknown stages always get the same fallback colour."""
    return STAGE_COLORS.get(stage) or \
        FALLBACK_COLORS[zlib.crc32(stage.encode()) % len(FALLBACK_COLORS)]


def _figure(size: tuple[int, int], dpi: int = DPI) -> Figure:
    # +0.5 px: Agg truncates width * dpi to an int, and e.g. 29 / 100 * 100 < 29.
    return Figure(figsize=((size[0] + 0.5) / dpi, (size[1] + 0.5) / dpi), dpi=dpi,
                  layout="constrained")


def _save(fig: Figure, path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=fig.dpi, format="png")
    return Path(path)


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def _label(v) -> str:
    if v is None or not math.isfinite(v):
        return ""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def spans_decades(values, decades: float = 2) -> bool:
    """Whether positive `values` span at least `decades` powers of ten (a log axis reads
    better: the small bars would otherwise be invisible next to the large ones)."""
    v = _finite(values)
    return bool(v) and min(v) > 0 and math.log10(max(v) / min(v)) >= decades


def line_chart(path, series: dict, title: str, xlabel: str, ylabel: str, ylim=None,
               colors: dict | None = None, size=(900, 420), logx=False, logy=False) -> Path:
    """series: label -> (xs, ys), one line each (with markers when it has few points; two
    points or fewer are markers alone: a line between them would draw a trend nobody
    measured); `colors` (label -> colour) overrides the palette."""
    fig = _figure(size)
    ax = fig.add_subplot()
    for i, (label, (xs, ys)) in enumerate(series.items()):
        color = (colors or {}).get(label, PALETTE[i % len(PALETTE)])
        ax.plot(xs, ys, color=color, label=label, lw=1.8 if len(xs) > 2 else 0,
                marker="o" if len(xs) <= 20 else None, ms=4 if len(xs) > 2 else 7)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.set_xscale("log" if logx else "linear")
    ax.set_yscale("log" if logy else "linear")
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize="small")
    return _save(fig, path)


def seed_curves(path, xs, groups: dict, title: str, xlabel: str, ylabel: str, ylim=None,
                size=(900, 460)) -> Path:
    """groups: label -> one curve (ys on `xs`) per seed. Each seed is drawn thin, the mean
    across seeds thick, with its 95 % Student-t interval shaded: mean ± t(0.975, n-1) · sd /
    sqrt(n). t rather than 1.96 because n is a handful of seeds (t = 4.30 at n = 3); one seed
    gets no band."""
    fig = _figure(size)
    ax = fig.add_subplot()
    xs = np.asarray(xs, float)
    for i, (label, curves) in enumerate(groups.items()):
        color, ys = PALETTE[i % len(PALETTE)], np.asarray(curves, float).reshape(-1, len(xs))
        n, mean = len(ys), ys.mean(axis=0)
        for k, y in enumerate(ys):
            ax.plot(xs, y, color=color, lw=0.7, alpha=0.45,
                    label=f"{label}: each seed" if k == 0 else None)
        if n > 1:
            half = t_critical(n - 1) * ys.std(axis=0, ddof=1) / math.sqrt(n)
            ax.fill_between(xs, mean - half, mean + half, color=color, alpha=0.2, lw=0,
                            label=f"{label}: 95 % t interval")
        ax.plot(xs, mean, color=color, lw=2.2, label=f"{label}: mean of {n} seeds")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if groups:
        ax.legend(fontsize="small", loc="best")
    return _save(fig, path)


def bar_chart(path, categories: list[str], series: dict, title: str, ylabel: str,
              markers: dict | None = None, logy: bool | None = None,
              size=(900, 420)) -> Path:
    """Grouped bars: series label -> one value per category (None: no bar), each bar
    labelled with its value. `markers` (label -> one value per category, None or NaN: none)
    draws a black line across the category's bars, e.g. the ideal bound the bars can't beat.
    `logy` None: a log axis when the values span two decades or more (spans_decades)."""
    fig = _figure(size)
    ax = fig.add_subplot()
    values = [v for vs in [*series.values(), *(markers or {}).values()] for v in vs]
    log = spans_decades(values) if logy is None else logy
    width = 0.8 / max(1, len(series))
    x = np.arange(len(categories))
    for s, (label, vals) in enumerate(series.items()):
        heights = [np.nan if v is None else v for v in vals]
        bars = ax.bar(x - 0.4 + (s + 0.5) * width, heights, width * 0.95, label=label,
                      color=PALETTE[s % len(PALETTE)])
        ax.bar_label(bars, labels=[_label(v) for v in vals], fontsize="x-small", padding=2)
    styles = ["-", "--", ":", "-."]
    for m, (label, vals) in enumerate((markers or {}).items()):
        shown = [(i, v) for i, v in enumerate(vals) if v is not None and math.isfinite(v)]
        for k, (i, v) in enumerate(shown):
            ax.hlines(v, i - 0.45, i + 0.45, colors="black", lw=2,
                      linestyles=styles[m % len(styles)], label=None if k else label)
    if log:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, max(_finite(values) or [1]) * 1.15)
    slant = max(map(len, categories), default=0) > 90 / max(1, len(categories))
    ax.set_xticks(x, categories, rotation=20 if slant else 0, ha="right" if slant else "center",
                  fontsize="small")
    ax.set_xlim(-0.5, len(categories) - 0.5)
    ax.set(title=title, ylabel=ylabel + (" (log scale)" if log else ""))
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if series or markers:
        ax.legend(fontsize="small")
    return _save(fig, path)


def swimlane(path, lanes: list, title: str, window=None, colors: dict | None = None,
             width: int = 1000) -> Path:
    """lanes: [(label, [(start, end, stage), ...])]; one row per lane, a bar per busy span in
    its stage's fixed colour (stage_color; `colors` overrides), white = idle. `window` =
    (t0, t1) zooms in. Spans narrower than a pixel are widened to one, so short but frequent
    stages stay visible; bars are not antialiased, so every bar pixel is the stage colour."""
    starts = [s for _, spans in lanes for s, _, _ in spans] or [0]
    ends = [e for _, spans in lanes for _, e, _ in spans] or [1]
    t0, t1 = window or (min(starts), max(ends))
    fig = _figure((width, 130 + 22 * len(lanes)))
    ax = fig.add_subplot()
    pixel = (t1 - t0) / (0.85 * width) or 1e-9  # a pixel of the plot area, in seconds
    seen = set()
    for row, (_, spans) in enumerate(lanes):
        by_stage = {}
        for start, end, stage in spans:
            if end >= t0 and start <= t1:
                by_stage.setdefault(stage, []).append((start, max(end - start, pixel)))
        for stage, bars in by_stage.items():
            color = (colors or {}).get(stage) or stage_color(stage)
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=color, edgecolor="none",
                           antialiased=False)
            seen.add(stage)
    ax.set_xlim(t0, t1)
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # first lane on top
    ax.set_yticks(range(len(lanes)), [label for label, _ in lanes], fontsize="small")
    ax.set(title=title, xlabel="time (s)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    order = [s for s in STAGE_COLORS if s in seen] + sorted(seen - set(STAGE_COLORS))
    handles = [Patch(color=(colors or {}).get(s) or stage_color(s), label=s) for s in order]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="idle"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 9),
               fontsize="small", frameon=False)
    return _save(fig, path)
