"""Output tok/s against concurrency, one line per mode, the crossover marked: as a PNG and in the terminal.

PNG through Pillow: one wheel without dependencies that brings line drawing and a scalable font
(matplotlib would pull numpy, fonttools, kiwisolver and contourpy). The terminal chart uses plotext 5,
the version textual-plotext (the TUI's widget) builds on.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynctl.base.errors import UsageError

PALETTE = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207))
TERM_COLORS = ("blue", "red", "green", "magenta", "orange", "cyan")
Series = tuple[str, list[tuple[int, float]]]


def chart_series(runs: Sequence[Any]) -> list[Series]:
    """(mode name, [(concurrency, output tok/s), ...]) per run that measured something."""
    out = []
    for run in runs:
        points = sorted((lv["max_concurrency"], float(lv["output_throughput"])) for lv in run.levels)
        if points:
            out.append((run.mode.name, points))
    return out


def crossover_x(recommendation: dict[str, Any] | None) -> tuple[float, str] | None:
    """Where to mark the crossover on a log2 axis (between the last spec win and the first loss), and its label."""
    if not recommendation:
        return None
    cross = recommendation.get("crossover") or {}
    lo, hi = cross.get("last_spec_win"), cross.get("first_no_spec_win")
    if lo and hi:
        return math.sqrt(lo * hi), f"crossover: threshold {recommendation['threshold']}"
    if hi:
        return float(hi), "no-spec wins from here"
    return None


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / ticks
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def write_png(series: list[Series], path: str | os.PathLike[str], *, title: str,
              crossover: tuple[float, str] | None = None, size: tuple[int, int] = (960, 560)) -> Path:
    from PIL import Image, ImageDraw, ImageFont

    target = Path(path).expanduser()
    if not series:
        raise UsageError(f"--png {target}: nothing was measured, no chart to draw")
    w, h = size
    left, right, top, bottom = 80, 30, 70, 64
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=14)
    small = ImageFont.load_default(size=12)
    xs = sorted({c for _, pts in series for c, _ in pts})
    ymax = max(v for _, pts in series for _, v in pts) or 1.0
    step = _nice_step(ymax * 1.1)
    ytop = step * math.ceil(ymax * 1.1 / step)
    lx0, lx1 = math.log2(xs[0]), math.log2(xs[-1])
    span = (lx1 - lx0) or 1.0

    def px(c: float) -> float:
        return left + (math.log2(c) - lx0) / span * (w - left - right) if len(xs) > 1 else (left + w - right) / 2

    def py(v: float) -> float:
        return h - bottom - v / ytop * (h - top - bottom)

    draw.text((left, 12), title, fill="black", font=font)
    y = 0.0
    while y <= ytop + 1e-9:  # horizontal grid and y labels
        draw.line([(left, py(y)), (w - right, py(y))], fill=(225, 225, 225))
        label = f"{y:,.0f}"
        draw.text((left - 8 - draw.textlength(label, font=small), py(y) - 7), label, fill="black", font=small)
        y += step
    for c in xs:
        draw.line([(px(c), h - bottom), (px(c), h - bottom + 5)], fill="black")
        label = str(c)
        draw.text((px(c) - draw.textlength(label, font=small) / 2, h - bottom + 8), label, fill="black", font=small)
    draw.line([(left, top), (left, h - bottom), (w - right, h - bottom)], fill="black", width=1)
    draw.text(((w - 160) / 2, h - 26), "concurrency (log scale)", fill="black", font=font)
    draw.text((10, top - 24), "output tok/s", fill="black", font=font)
    if crossover is not None:
        cx = px(crossover[0])
        yy = top
        while yy < h - bottom:  # dashed vertical line
            draw.line([(cx, yy), (cx, min(yy + 6, h - bottom))], fill=(90, 90, 90), width=2)
            yy += 11
        draw.text((cx + 6, top + 2), crossover[1], fill=(60, 60, 60), font=small)
    for i, (name, pts) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        coords = [(px(c), py(v)) for c, v in pts]
        if len(coords) > 1:
            draw.line(coords, fill=color, width=3)
        for x, yv in coords:
            draw.ellipse([x - 4, yv - 4, x + 4, yv + 4], fill=color)
        ly = top + 22 + 20 * i  # legend, top right
        lx = w - right - 190
        draw.line([(lx, ly + 7), (lx + 24, ly + 7)], fill=color, width=3)
        draw.text((lx + 32, ly), name, fill="black", font=small)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        img.save(tmp, format="PNG")
        os.replace(tmp, target)
    except OSError as err:
        raise UsageError(f"--png {target}: cannot write: {err.strerror or err}") from None
    return target


def terminal_chart(series: list[Series], *, width: int = 80, height: int = 20, title: str = "",
                   crossover: tuple[float, str] | None = None, color: bool = True) -> str:
    """The same chart as text (ANSI colours unless color=False), for the CLI and the TUI's bench panel."""
    import plotext as plt

    plt.clear_figure()
    plt.plotsize(width, height)
    plt.theme("clear")  # no background fill: the terminal's own shows through
    xs = sorted({c for _, pts in series for c, _ in pts})
    for i, (name, pts) in enumerate(series):
        plt.plot([math.log2(c) for c, _ in pts], [v for _, v in pts], label=name,
                 color=TERM_COLORS[i % len(TERM_COLORS)], marker="hd")
    if xs:
        plt.xticks([math.log2(c) for c in xs], [str(c) for c in xs])
    if crossover is not None:
        plt.vline(math.log2(crossover[0]), "gray")
    plt.title(title)
    plt.xlabel("concurrency")
    plt.ylabel("output tok/s")
    text = plt.build()
    plt.clear_figure()
    return text if color else plt.uncolorize(text)
