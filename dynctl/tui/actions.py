"""What the TUI's keys do to a host: a protocol the core implements (`dynctl.actions.host`), so the screen
never holds the logic.

Every method runs in a thread worker and may block; progress goes to `on_event` as the same typed events
the CLI prints (`dynctl.base.events`, and bench's `dynctl.bench.events`), ending in a `Finished` or `Unchanged`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from dynctl.base.events import EventSink


class HostActions(Protocol):
    def deploy(self, threshold: int, on_event: EventSink, confirm: Callable[[str], None]) -> Any:
        """Plan, report the plan's warnings to on_event, then ask `confirm` (which raises to decline), then deploy."""

    def rollback(self, on_event: EventSink) -> Any: ...

    def set_threshold(self, n: int, on_event: EventSink) -> Any: ...

    def stop(self, on_event: EventSink) -> Any: ...

    def start(self, on_event: EventSink) -> Any: ...

    def restart(self, on_event: EventSink) -> Any: ...

    def bench(self, on_event: EventSink) -> Any: ...


ActionsFactory = Callable[[str], HostActions]
