"""The dashboard without hosts: a feed whose snapshots the test hands in, and keys that record what they asked.

    h = Harness(["glm5"])                       # the app, a PushFeed and RecordingActions behind it
    async with h.app.run_test() as pilot:
        h.push(item(T0, 0, 3))                  # a raw `watch` item, parsed as the live feed parses it
        await pilot.press("S")
        assert h.calls == [("glm5", "start", None)]
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from dynctl.base import events
from dynctl.live.feed import OnUpdate
from dynctl.live.snapshot import HostHistory, HostSnapshot, build_snapshot
from dynctl.tui.app import DynctlApp, create_app
from dynctl.tui.widgets import ActionLog, LogTail

T0 = 1_795_950_000.0  # a fixed host time (UTC) for the watch items the tests push


class PushFeed:
    """A feed whose snapshots are handed in (tests, the TUI benchmark): same histories, same callback as LiveFeed."""

    def __init__(self, hosts: Sequence[str], on_update: OnUpdate, history_s: float = 600.0) -> None:
        self.histories = {h: HostHistory(h, window_s=history_s) for h in hosts}
        self._on_update = on_update
        self.started = False
        self.stopped = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def push(self, snap: HostSnapshot) -> None:
        history = self.histories[snap.host]
        history.add(snap)
        self._on_update(snap, history)

    def push_item(self, item: dict[str, Any], host: str, simulated: bool = False) -> HostSnapshot:
        """Build the snapshot of a raw `watch` item as the live feed would, and push it."""
        history = self.histories[host]
        snap = build_snapshot(item, host, history.last_live, simulated=simulated)
        self.push(snap)
        return snap


class RecordingActions:
    """HostActions that record what the keys asked for and report progress as the core's commands do."""

    def __init__(self, host: str, calls: list[tuple[str, str, Any]], gate: threading.Event | None = None) -> None:
        self.host, self.calls, self.gate = host, calls, gate

    def _run(self, name: str, arg: Any, on_event: Callable[[Any], None]) -> None:
        self.calls.append((self.host, name, arg))
        on_event(events.StepStarted(f"{name} step", "first"))
        if self.gate is not None:
            assert self.gate.wait(10)
        on_event(events.StepDone(f"{name} step", 0.25))

    def deploy(self, threshold: int, on_event: Callable[[Any], None], confirm: Callable[[str], None]) -> None:
        """As the core's deploy_threshold: the plan's warnings, then the question, then the deploy."""
        on_event(events.Warning(f"{threshold} is not a CUDA-graph batch size"))
        confirm(f"Deploy threshold {threshold} to {self.host}?")
        self._run("deploy", threshold, on_event)

    def rollback(self, on_event: Callable[[Any], None]) -> None:
        self._run("rollback", None, on_event)

    def set_threshold(self, n: int, on_event: Callable[[Any], None]) -> None:
        self.calls.append((self.host, "set_threshold", n))
        on_event(events.Finished("threshold", f"threshold {n} in force", f"on {self.host} (read back)"))

    def stop(self, on_event: Callable[[Any], None]) -> None:
        self._run("stop", None, on_event)

    def start(self, on_event: Callable[[Any], None]) -> None:
        self._run("start", None, on_event)

    def restart(self, on_event: Callable[[Any], None]) -> None:
        self._run("restart", None, on_event)

    def bench(self, on_event: Callable[[Any], None]) -> None:
        self._run("bench", None, on_event)


class Harness:
    def __init__(self, hosts: list[str], read_only: bool = False, gate: threading.Event | None = None,
                 now: float = T0 + 30) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.feed: PushFeed | None = None

        def feed_factory(on_update: OnUpdate) -> PushFeed:
            self.feed = PushFeed(hosts, on_update)
            return self.feed

        self.app: DynctlApp = create_app(hosts, feed_factory, lambda h: RecordingActions(h, self.calls, gate),
                                         read_only=read_only, clock=lambda: now)

    def push(self, raw: dict[str, Any], host: str | None = None) -> HostSnapshot:
        assert self.feed is not None
        return self.feed.push_item(raw, host or self.app.hosts[0])

    def panel(self, cls: type) -> Any:
        return self.app.dashboard.query_one(cls)


def log_text(log: LogTail | ActionLog) -> list[str]:
    return [strip.text.rstrip() for strip in log.lines]
