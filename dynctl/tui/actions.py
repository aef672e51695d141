"""What the TUI's keys do to a host: a protocol the core implements, so the screen never holds the logic.

Every method runs in a thread worker and may block; progress goes to `on_event` as the same events the
CLI prints (any object: the panel renders dicts, dataclasses and strings, see `describe_event`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

OnEvent = Callable[[Any], None]


class HostActions(Protocol):
    def deploy(self, threshold: int, on_event: OnEvent) -> Any: ...

    def rollback(self, on_event: OnEvent) -> Any: ...

    def set_threshold(self, n: int) -> int:
        """Change the threshold of the running server; return the value read back."""
        ...

    def stop(self, on_event: OnEvent) -> Any: ...

    def start(self, on_event: OnEvent) -> Any: ...

    def restart(self, on_event: OnEvent) -> Any: ...

    def bench(self, on_event: OnEvent) -> Any: ...


ActionsFactory = Callable[[str], HostActions]


class UnwiredActions:
    """Stands in until the core's operations are wired to the TUI."""

    def __init__(self, host: str) -> None:
        self.host = host

    def _missing(self) -> Any:
        raise NotImplementedError("arrives with issue 5")

    def deploy(self, threshold: int, on_event: OnEvent) -> Any:
        return self._missing()

    def rollback(self, on_event: OnEvent) -> Any:
        return self._missing()

    def set_threshold(self, n: int) -> int:
        return self._missing()

    def stop(self, on_event: OnEvent) -> Any:
        return self._missing()

    def start(self, on_event: OnEvent) -> Any:
        return self._missing()

    def restart(self, on_event: OnEvent) -> Any:
        return self._missing()

    def bench(self, on_event: OnEvent) -> Any:
        return self._missing()


def _fields(event: Any) -> dict[str, Any] | None:
    if isinstance(event, dict):
        return event
    if dataclasses.is_dataclass(event) and not isinstance(event, type):
        return {**dataclasses.asdict(event), "type": getattr(event, "type", None) or type(event).__name__}
    return None


def describe_event(event: Any) -> tuple[str, str]:
    """(level, text) of one progress event; level is info, ok, warning, error or log."""
    data = _fields(event)
    if data is None:
        return "info", str(event)
    kind = str(data.get("type") or data.get("kind") or data.get("event") or "")
    step = data.get("step")
    text = data.get("text") or data.get("message") or data.get("msg") or data.get("line")
    lowered = kind.lower()
    if "final" in lowered or data.get("final"):
        ok = data.get("ok", True)
        return ("ok" if ok else "error"), (text or ("done" if ok else str(data.get("error") or "failed")))
    if "started" in lowered and step:
        detail = data.get("detail")
        return "info", f"▶ {step}" + (f" — {detail}" if detail else "")
    if "done" in lowered and step:
        seconds = data.get("seconds", data.get("elapsed"))
        return "ok", f"✔ {step}" + (f" ({seconds:.1f} s)" if isinstance(seconds, (int, float)) else "")
    if "warn" in lowered:
        return "warning", f"⚠ {text or step or ''}".rstrip()
    if "fail" in lowered or "error" in lowered:
        return "error", f"✘ {text or data.get('error') or step or kind}"
    if lowered == "log" or (text and not step):
        return "log", str(text or "")
    return "info", str(text or step or kind or data)
