"""The actions panel's reading of progress events: one line each, chosen by the event's type."""

from __future__ import annotations

from typing import Any

from dynctl.base import events
from dynctl.bench import events as bench

Line = tuple[str, str]  # (level, text); level is info, ok, warning, error or log


def describe(event: Any) -> Line | None:
    """The panel's line for `event`, or None for the ones too frequent to show (bench ticks)."""
    match event:
        case events.StepStarted(step=step, detail=detail):
            return "info", f"▶ {step}" + (f" — {detail}" if detail else "")
        case events.StepDone(step=step, elapsed=elapsed, detail=detail):
            return "ok", f"✔ {step} ({elapsed:.1f} s)" + (f" — {detail}" if detail else "")
        case events.LogLine(text=text):
            return "log", text
        case events.Note(text=text):
            return "info", text
        case events.Warning(text=text):
            return "warning", f"⚠ {text}"
        case events.Failed(message=message):
            return "error", f"✘ {message}"
        case events.Finished(elapsed=elapsed):
            return "ok", event.text + (f" ({elapsed:.1f} s)" if elapsed is not None else "")
        case events.Unchanged(reason=reason):
            return "ok", reason
        case bench.BenchStarted():
            return "info", (f"bench {event.host} → server {event.where}: levels {','.join(map(str, event.levels))}, "
                            f"{event.budget} each")
        case bench.ModeStarted(mode=mode, threshold_in_force=threshold):
            return "info", f"mode {mode.name}" + ("" if threshold is None else f" (threshold {threshold} in force)")
        case bench.LevelStarted():
            return "info", f"▶ {event.mode.name} c={event.concurrency} — level {event.index}/{event.total}"
        case bench.LevelProgress():
            return None
        case bench.LevelDone(mode=mode, level=level):
            return "info", _level_line(mode.name, level)
        case bench.ThresholdRestored(threshold=threshold):
            return "info", f"threshold {threshold} put back"
    raise TypeError(f"not a progress event: {event!r}")


def _level_line(mode: str, level: dict[str, Any]) -> str:
    server = level.get("server") or {}
    share = server.get("spec_on_share")
    spec = "" if share is None else f", speculation {share:.0%} of steps"
    return (f"{mode} c={level['max_concurrency']}: {level['output_throughput']:.0f} tok/s, TTFT p50 "
            f"{level.get('median_ttft_ms') or 0:.0f} ms, batch {server.get('mean_batch_size') or 0:.1f}{spec}")
