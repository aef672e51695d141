"""The threshold to deploy: speculation where it measured faster than no speculation, off from the crossover on.

The patched server speculates while its batch size is <= threshold, and a closed loop of C workers keeps
the batch near C, so the largest concurrency level below the first level where no-spec wins is the
threshold: speculation runs only where it was measured to pay. Any value up to the next level measures
the same; the lower end is the safe one. A level counts as a speculation win only when always-spec beat
no-spec by more than MIN_GAIN_PCT: inside that band the two are the same measurement, and no speculation
is the mode that cannot collapse under load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from dynctl.base import sglang
from dynctl.bench.plan import Mode

MIN_GAIN_PCT = 1.0


class _Run(Protocol):
    mode: Mode
    levels: list[dict[str, Any]]


def _pct(value: float, base: float) -> float | None:
    return (value / base - 1.0) * 100.0 if base > 0 else None


def _by_level(run: _Run) -> dict[int, float]:
    return {lv["max_concurrency"]: float(lv["output_throughput"]) for lv in run.levels}


def recommend(runs: Sequence[_Run]) -> dict[str, Any] | None:
    """Recommendation from a --compare run; None without both a no-spec and an always-spec sweep."""
    nospec = next((r for r in runs if r.mode.threshold == 0), None)
    spec = next((r for r in runs if r.mode.threshold == -1), None)
    if nospec is None or spec is None:
        return None
    off, on = _by_level(nospec), _by_level(spec)
    levels = sorted(set(off) & set(on))
    if not levels:
        return None
    threshold, first_loss = 0, None
    for c in levels:
        if on[c] > off[c] * (1 + MIN_GAIN_PCT / 100):
            threshold = c
        else:
            first_loss = c
            break
    notes = []
    if first_loss is None:
        notes.append(f"speculation was faster at every measured level; no crossover up to concurrency {levels[-1]}")
    elif threshold == 0:
        notes.append(f"speculation did not beat no-spec by more than {MIN_GAIN_PCT:g} % even at concurrency "
                     f"{levels[0]}: threshold 0 keeps it off")
    later_wins = [c for c in levels if first_loss is not None and c > first_loss
                  and on[c] > off[c] * (1 + MIN_GAIN_PCT / 100)]
    if later_wins:
        notes.append(f"speculation won again above the crossover at concurrency {', '.join(map(str, later_wins))}"
                     " (noise? lengthen --duration)")
    measured = {r.mode.threshold: _by_level(r) for r in runs if r.mode.threshold not in (None, 0, -1)}
    rows = []
    for c in levels:
        use_spec = c <= threshold
        expected = on[c] if use_spec else off[c]
        row: dict[str, Any] = {
            "max_concurrency": c,
            "no_spec_output_throughput": off[c],
            "always_spec_output_throughput": on[c],
            "speculation": use_spec,
            "expected_output_throughput": expected,
            "margin_vs_no_spec_pct": _pct(expected, off[c]),
            "margin_vs_always_spec_pct": _pct(expected, on[c]),
        }
        if threshold in measured and c in measured[threshold]:
            got = measured[threshold][c]
            row["measured_output_throughput"] = got
            row["measured_margin_vs_no_spec_pct"] = _pct(got, off[c])
            row["measured_margin_vs_always_spec_pct"] = _pct(got, on[c])
        rows.append(row)
    return {
        "threshold": threshold,
        "crossover": {"last_spec_win": threshold or None, "first_no_spec_win": first_loss},
        "flag": f"{sglang.THRESHOLD_FLAG} {threshold}",
        "levels": rows,
        "thresholds_measured": {str(t): v for t, v in sorted(measured.items())},
        "notes": notes,
    }
