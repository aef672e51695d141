"""Progress of a host operation as small typed events: the CLI renders them with rich, the TUI in a panel."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepStarted:
    step: str
    detail: str = ""


@dataclass(frozen=True)
class StepDone:
    step: str
    elapsed: float
    detail: str = ""


@dataclass(frozen=True)
class LogLine:
    text: str


@dataclass(frozen=True)
class Warning:  # noqa: A001 - the event's name; use it as `events.Warning`
    text: str


@dataclass(frozen=True)
class Failed:
    step: str
    message: str
    log_tail: tuple[str, ...] = ()


Event = StepStarted | StepDone | LogLine | Warning | Failed
EventSink = Callable[[Event], None]


def ignore(event: Event) -> None:
    """The sink for callers that do not show progress."""
