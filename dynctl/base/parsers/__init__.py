"""Parsers for what an SGLang host tells us (`prometheus`, `serverlog`, `nvidia_smi`), UI-free and I/O-free:
`dynctl status`, the TUI feed and bench all read the same values the same way."""

from __future__ import annotations

from typing import Any


class MetricsFormatError(ValueError):
    """Text that is not what the named source emits; the message says where."""


def number(value: str | None, kind: type) -> Any:
    """`kind(value)`, or None where the value is missing or not a number of that kind."""
    if value is None:
        return None
    try:
        return kind(value.strip())
    except ValueError:
        return None
