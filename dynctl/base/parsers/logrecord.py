"""Server log lines as records (`dynctl logs --json`): the raw line always, and what dynctl reads in it."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from dynctl.base.parsers.serverlog import parse_decode_line, parse_transition_line, split_log_prefix


def log_record(line: str, utc_offset: float | None = None) -> dict[str, Any]:
    """{"line": raw, "time", "ranks", "message", "kind", and the decode / transition fields where it is one}.

    A line dynctl does not know is kept whole, with kind "other": nothing is ever dropped."""
    prefix = split_log_prefix(line, utc_offset)
    out: dict[str, Any] = {"line": line, "time": prefix.time, "ranks": prefix.ranks, "message": prefix.message,
                           "kind": "other"}
    decode = parse_decode_line(line, utc_offset)
    if decode is not None:
        out["kind"] = "decode"
        out["decode"] = {k: v for k, v in asdict(decode).items() if k not in ("time", "fields")}
        return out
    transition = parse_transition_line(line, utc_offset)
    if transition is not None:
        out["kind"] = "speculation"
        out["speculation"] = {"enabled": transition.enabled, "batch_size": transition.batch_size,
                              "threshold": transition.threshold}
    return out
