"""The tok/s history chart: eighth-block columns coloured by speculation state, switch moments marked.

A custom renderer rather than textual's Sparkline or plotext: Sparkline can neither colour a column by
state nor mark a moment, and plotext would add a dependency and redraw a whole canvas each second for
what is a few hundred cells. Pure function of the history, so it is tested without a terminal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rich.text import Text

from dynctl.live.snapshot import Point, Switch

BLOCKS = " ▁▂▃▄▅▆▇█"
ON_STYLE = "green"
OFF_STYLE = "dark_orange"
UNKNOWN_STYLE = "grey50"
AXIS_STYLE = "grey50"


def nice_ceiling(value: float) -> float:
    """The smallest 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 × 10^k at or above `value` (a readable axis top)."""
    if value <= 0:
        return 1.0
    exp = math.floor(math.log10(value))
    for step in (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0):
        top = step * 10 ** exp
        if top >= value * 0.999:
            return top
    return 10.0 ** (exp + 1)


def short_number(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k".replace(".0k", "k")
    if value >= 10 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.1f}"


def _style(speculation: bool | None) -> str:
    return ON_STYLE if speculation else OFF_STYLE if speculation is False else UNKNOWN_STYLE


def _tok_s(p: Point) -> float | None:
    return p.gen_throughput


def bin_points(points: Sequence[Point], start: float, end: float, columns: int, hold: float = 3.0,
               value: Callable[[Point], float | None] = _tok_s) -> list[tuple[float | None, bool | None]]:
    """(mean tok/s, last speculation state) per column of [start, end); an empty column holds the
    previous sample for `hold` seconds, so 1 Hz data drawn at finer columns has no holes."""
    width = (end - start) / columns
    sums = [0.0] * columns
    counts = [0] * columns
    states: list[bool | None] = [None] * columns
    seen = [False] * columns
    for p in points:
        if p.time < start or p.time >= end:
            continue
        i = min(columns - 1, int((p.time - start) / width))
        seen[i] = True
        states[i] = p.speculation
        v = value(p)
        if v is not None:
            sums[i] += v
            counts[i] += 1
    out: list[tuple[float | None, bool | None]] = []
    last: tuple[float | None, bool | None, float] | None = None  # value, state, time
    for i in range(columns):
        col_start = start + i * width
        if counts[i]:
            value = sums[i] / counts[i]
            out.append((value, states[i]))
            last = (value, states[i], col_start + width)
        elif seen[i]:
            out.append((None, states[i]))
            last = None
        elif last is not None and col_start - last[2] <= hold:
            out.append((last[0], last[1]))
        else:
            out.append((None, None))
    return out


def render_chart(points: Sequence[Point], switches: Sequence[Switch], width: int, height: int, *,
                 now: float | None, window_s: float = 300.0) -> Text:
    """`height` rows of `width` cells: y labels, the columns, and an axis row with ▲ on / ▼ off marks."""
    text = Text(no_wrap=True, overflow="crop")
    if width < 12 or height < 2:
        return text
    if now is None or not points:
        text.append("waiting for samples …", style=AXIS_STYLE)
        return text
    rows = height - 1
    values = [p.gen_throughput for p in points if p.gen_throughput is not None and p.time >= now - window_s]
    top = nice_ceiling(max(values) * 1.05 if values else 1.0)
    label_w = max(len(short_number(top)), 1) + 1
    cols = width - label_w - 1
    if cols < 4:
        return text
    # the newest sample belongs to the rightmost column: end just after `now`
    end = now + window_s / cols * 0.5
    start = end - window_s
    binned = bin_points(points, start, end, cols)
    marks: dict[int, Switch] = {}
    flapping: set[int] = set()  # columns where speculation went both ways
    for s in switches:
        if start <= s.time < end:
            col = min(cols - 1, int((s.time - start) / (window_s / cols)))
            if col in marks and marks[col].enabled != s.enabled:
                flapping.add(col)
            marks[col] = s
    levels = [None if v is None else max(0, min(rows * 8, round(v / top * rows * 8))) for v, _ in binned]
    for r in range(rows):
        label = short_number(top) if r == 0 else ("0" if r == rows - 1 else "")
        text.append(label.rjust(label_w - 1) + " ", style=AXIS_STYLE)
        text.append("┤" if r in (0, rows - 1) else "│", style=AXIS_STYLE)
        floor = (rows - 1 - r) * 8
        for i in range(cols):
            level = levels[i]
            fill = 0 if level is None else max(0, min(8, level - floor))
            if fill == 0 and level is not None and level > 0 and r == rows - 1:
                fill = 1
            if fill:
                text.append(BLOCKS[fill], style=_style(binned[i][1]))
            elif i in marks:
                text.append("┊", style=_style(marks[i].enabled))
            else:
                text.append(" ")
        text.append("\n")
    text.append(" " * label_w + "└", style=AXIS_STYLE)
    for i in range(cols):
        if i in flapping:
            text.append("◆", style="bold yellow")
        elif i in marks:
            text.append("▲" if marks[i].enabled else "▼", style="bold " + _style(marks[i].enabled))
        else:
            text.append("─", style=AXIS_STYLE)
    return text


def _batch(p: Point) -> float | None:
    return None if p.running_reqs is None else float(p.running_reqs)


def render_batch_history(points: Sequence[Point], width: int, height: int, *, now: float | None,
                         window_s: float = 300.0) -> Text:
    """Batch size over time against the threshold line (─), columns green at or below it, orange above."""
    text = Text(no_wrap=True, overflow="crop")
    if now is None or not points or width < 4 or height < 1:
        return text
    end = now + window_s / width * 0.5
    binned = bin_points(points, end - window_s, end, width, value=_batch)
    recent = [p for p in points if p.time >= end - window_s]
    threshold = next((p.threshold for p in reversed(recent) if p.threshold is not None and p.threshold >= 0), None)
    peak = max([v for v, _ in binned if v is not None] + [1.0])
    top = max(peak, threshold * 1.5 if threshold is not None else 0, 4.0)
    levels = [None if v is None else round(v / top * height * 8) for v, _ in binned]
    thr_level = None if threshold is None else threshold / top * height * 8
    for r in range(height):
        floor = (height - 1 - r) * 8
        for i in range(width):
            level = levels[i]
            fill = 0 if level is None else max(0, min(8, level - floor))
            over = threshold is not None and binned[i][0] is not None and binned[i][0] > threshold
            on_line = thr_level is not None and floor <= thr_level < floor + 8
            if fill:
                text.append(BLOCKS[fill], style=OFF_STYLE if over else ON_STYLE)
            elif on_line:
                text.append("─", style="white")
            else:
                text.append(" ")
        if r < height - 1:
            text.append("\n")
    return text
