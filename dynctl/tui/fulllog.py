"""The full server log of one host (`L`): every line the live view kept, raw, nothing left out, following
new lines until `f` pauses it (to read back) and resumes."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Label, RichLog

from dynctl.live.snapshot import HostHistory


class FullLogScreen(Screen[None]):
    BINDINGS = [Binding("escape,L", "close", "Back"), Binding("f", "toggle_follow", "Follow/pause")]

    def __init__(self, host: str, history: HostHistory | None) -> None:
        super().__init__()
        self.host = host
        self.history = history
        self._mark: tuple[int, int] | None = None
        self.lines_written: list[str] = []

    def compose(self) -> ComposeResult:
        yield Label(self._title(True), id="full-log-title")
        yield RichLog(id="full-log", max_lines=None, wrap=False, markup=False, highlight=False, auto_scroll=True)
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.follow(self.history)

    def _title(self, following: bool) -> str:
        return f"{self.host}: server log — " + ("following new lines (f pauses)" if following else
                                                 "paused (f follows again)")

    def follow(self, history: HostHistory | None) -> None:
        """Write the lines the history gained since the last call, raw."""
        self.history = history
        log = self.query_one(RichLog)
        if history is None:
            return
        lines, self._mark, reset = history.log_since(self._mark)
        if reset:
            log.clear()
            self.lines_written = []
        for line in lines:
            log.write(line)
            self.lines_written.append(line)

    def action_toggle_follow(self) -> None:
        log = self.query_one(RichLog)
        log.auto_scroll = not log.auto_scroll
        if log.auto_scroll:
            log.scroll_end(animate=False)
        self.query_one("#full-log-title", Label).update(self._title(log.auto_scroll))

    def action_close(self) -> None:
        self.app.pop_screen()
