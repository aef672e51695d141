"""The dashboard's panels: thin widgets that hold the current snapshot and draw it with `panels`/`chart`."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from rich.text import Text
from textual.widget import Widget
from textual.widgets import RichLog

from dynctl.live.snapshot import HostHistory, HostSnapshot
from dynctl.tui import panels
from dynctl.tui.chart import render_batch_history, render_chart


class SnapshotPanel(Widget):
    """A panel drawn from the current host's snapshot; `show` swaps the data and redraws."""

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.snapshot: HostSnapshot | None = None
        self.history: HostHistory | None = None

    def show(self, snap: HostSnapshot | None, history: HostHistory | None) -> None:
        self.snapshot, self.history = snap, history
        self.refresh()

    def text(self) -> str:
        """The panel as plain text (for tests and screen readers of the test log)."""
        rendered = self.render()
        return rendered.plain if isinstance(rendered, Text) else str(rendered)


class HeaderBar(SnapshotPanel):
    def __init__(self, host: str, read_only: bool, **kw: str) -> None:
        super().__init__(**kw)
        self.host = host
        self.read_only = read_only

    def render(self) -> Text:
        return panels.render_header(self.snapshot, self.host, self.read_only)


class HostsBar(Widget):
    def __init__(self, hosts: Sequence[str], **kw: str) -> None:
        super().__init__(**kw)
        self.hosts = list(hosts)
        self.current = self.hosts[0] if self.hosts else ""
        self.latest: Mapping[str, HostSnapshot | None] = {}

    def show(self, current: str, latest: Mapping[str, HostSnapshot | None]) -> None:
        self.current, self.latest = current, latest
        self.refresh()

    def render(self) -> Text:
        return panels.render_hosts(self.hosts, self.current, self.latest)

    def text(self) -> str:
        return self.render().plain


def _now(widget: Widget) -> float:
    return getattr(widget.app, "clock", time.time)()


class Banner(SnapshotPanel):
    """Disconnected / operation-in-progress line; hidden when there is nothing to say."""

    def show(self, snap: HostSnapshot | None, history: HostHistory | None) -> None:
        super().show(snap, history)
        banner = panels.render_banner(snap, _now(self))
        self.display = banner is not None
        self.set_class(snap is not None and not snap.connected, "-disconnected")

    def render(self) -> Text:
        return panels.render_banner(self.snapshot, _now(self)) or Text()


class SpeculationPanel(SnapshotPanel):
    def show(self, snap: HostSnapshot | None, history: HostHistory | None) -> None:
        super().show(snap, history)
        _, state = panels.speculation_word(snap)
        for name in ("on", "off", "unknown", "none"):
            self.set_class(name == state, f"-{name}")
        self.set_class(snap is not None and not snap.connected, "-stale")

    def render(self) -> Text:
        return panels.render_speculation(self.snapshot, self.content_size.width, self.content_size.height)


class LoadPanel(SnapshotPanel):
    def show(self, snap: HostSnapshot | None, history: HostHistory | None) -> None:
        super().show(snap, history)
        self.set_class(snap is not None and not snap.connected, "-stale")

    def render(self) -> Text:
        """Three lines of numbers; on a tall screen the batch history fills the rest."""
        text = panels.render_load(self.snapshot, self.content_size.width)
        spare = self.content_size.height - 4
        h = self.history
        live = h.last_live if h is not None else None
        if spare >= 2 and live is not None:
            text.append("\n\n")
            window = getattr(self.app, "window_s", 300.0)
            text.append_text(render_batch_history(h.points(), self.content_size.width, spare, now=live.time,
                                                  window_s=window))
        return text


class ChartPanel(SnapshotPanel):
    def __init__(self, window_s: float = 300.0, **kw: str) -> None:
        super().__init__(**kw)
        self.window_s = window_s
        self.border_title = self._title()

    def _title(self) -> str:
        minutes = self.window_s / 60
        return f"gen tok/s · last {minutes:g} min · ▲ spec on  ▼ spec off"

    def render(self) -> Text:
        h = self.history
        live = h.last_live if h is not None else None
        return render_chart(h.points() if h else [], h.switches() if h else [], self.content_size.width,
                            self.content_size.height, now=live.time if live else None, window_s=self.window_s)


class GpuPanel(SnapshotPanel):
    def show(self, snap: HostSnapshot | None, history: HostHistory | None) -> None:
        super().show(snap, history)
        self.set_class(snap is not None and not snap.connected, "-stale")

    def render(self) -> Text:
        s = self.snapshot
        if s is None:
            return Text("waiting for data", style=panels.DIM)
        return panels.render_gpus(s.gpus, s.gpu_error, self.content_size.width, self.content_size.height,
                                  s.gpu_processes, s)


class LogTail(RichLog):
    """The server log of the current host; only new lines are written, so a 1 Hz tail costs little."""

    def __init__(self, **kw: str) -> None:
        super().__init__(max_lines=500, wrap=False, markup=False, highlight=False, auto_scroll=True, **kw)
        self._mark: tuple[int, int] | None = None

    def follow(self, history: HostHistory | None, utc_offset: float | None, restart: bool = False) -> None:
        """Write what the history gained since the last call; updates dropped in the queue lose nothing."""
        if history is None:
            self.clear()
            self._mark = None
            return
        lines, self._mark, reset = history.log_since(None if restart else self._mark)
        if reset:
            self.clear()
        for line in lines:
            if not panels.is_routine(line):
                self.write(panels.render_log_line(line, utc_offset))


class ActionLog(RichLog):
    """Progress of the actions started from this screen, in the order the events came."""

    STYLES = {"ok": "green", "error": "bold red", "warning": "yellow", "log": "grey50", "info": ""}

    def __init__(self, **kw: str) -> None:
        super().__init__(max_lines=2000, wrap=True, markup=False, highlight=False, auto_scroll=True, **kw)
        self.lines_written: list[str] = []

    def add(self, host: str, level: str, text: str) -> None:
        line = Text(no_wrap=False)
        line.append(panels.clock(_now(self)) + " ", style=panels.DIM)
        line.append(f"{host} ", style="bold")
        line.append(text, style=self.STYLES.get(level, ""))
        self.lines_written.append(line.plain)
        self.write(line)
