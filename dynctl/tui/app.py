"""`dynctl tui`: the live dashboard of SPEC §6, built by `create_app` so tests inject the feed and actions.

Data arrives from the feed's threads as `HostUpdated` messages, a newer one replacing a queued one of
the same host (toolong's pattern); actions run in thread workers and report through `ActionProgress`.
Nothing here waits on the network.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.screen import Screen
from textual.widgets import ContentSwitcher, Footer

from dynctl.base import events
from dynctl.base.events import EventSink
from dynctl.live.feed import Feed, OnUpdate, describe_error
from dynctl.live.snapshot import HostHistory, HostSnapshot
from dynctl.tui.actions import ActionsFactory, HostActions
from dynctl.tui.fulllog import FullLogScreen
from dynctl.tui.help import HelpScreen
from dynctl.tui.modals import ConfirmModal, ThresholdModal
from dynctl.tui.progress import describe
from dynctl.tui.widgets import (
    ActionLog,
    Banner,
    ChartPanel,
    GpuPanel,
    HeaderBar,
    HostsBar,
    LoadPanel,
    LogTail,
    SpeculationPanel,
)

FeedFactory = Callable[[OnUpdate], Feed]
ActionCall = Callable[[HostActions, EventSink, Callable[[str], None]], Any]  # (actions, on_event, confirm)


class Declined(Exception):
    """The operator answered no to an action's own question (asked after its plan): nothing was changed."""

# Actions that change a host: hidden in read-only mode.
CHANGING = {"deploy", "rollback", "threshold", "stop_server", "start_server", "restart_server", "bench"}


class HostUpdated(Message):
    def __init__(self, snapshot: HostSnapshot, history: HostHistory) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.history = history

    def can_replace(self, message: Message) -> bool:
        # the history holds every sample, so a queued update of the same host carries nothing extra
        return isinstance(message, HostUpdated) and message.snapshot.host == self.snapshot.host


class ActionProgress(Message):
    def __init__(self, host: str, action: str, event: Any) -> None:
        super().__init__()
        self.host, self.action, self.event = host, action, event


class ActionFinished(Message):
    """`text` None: the action's own events already said how it ended."""

    def __init__(self, host: str, action: str, ok: bool, text: str | None) -> None:
        super().__init__()
        self.host, self.action, self.ok, self.text = host, action, ok, text


class Dashboard(Screen):
    BINDINGS = [
        # the actions are the app's (they span hosts and screens); DynctlApp.check_action enables them
        Binding("d", "app.deploy", "Deploy"),
        Binding("r", "app.rollback", "Rollback"),
        Binding("t", "app.threshold", "Threshold"),
        Binding("s", "app.stop_server", "Stop"),
        Binding("S", "app.start_server", "Start"),
        Binding("R", "app.restart_server", "Restart"),
        Binding("b", "app.bench", "Bench"),
        Binding("h,tab", "app.switch_host(1)", "Host"),
        Binding("shift+tab", "app.switch_host(-1)", "Previous host", show=False),
        Binding("l", "toggle_log", "Log/actions", show=False),
        Binding("L", "full_log", "Full log", show=False),
        Binding("question_mark", "help", "Help", show=False),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, hosts: Sequence[str], read_only: bool, window_s: float) -> None:
        super().__init__()
        self.hosts = list(hosts)
        self.read_only = read_only
        self.window_s = window_s

    def compose(self) -> ComposeResult:
        bar = HostsBar(self.hosts, id="hosts")
        bar.display = len(self.hosts) > 1
        yield bar
        yield HeaderBar(self.hosts[0], self.read_only, id="header")
        yield Banner(id="banner")
        with Horizontal(id="top"):
            yield SpeculationPanel(id="spec")
            yield LoadPanel(id="load")
        yield ChartPanel(self.window_s, id="chart")
        with Horizontal(id="bottom"):
            yield GpuPanel(id="gpus")
            with ContentSwitcher(initial="log", id="tail"):
                yield LogTail(id="log")
                yield ActionLog(id="actions")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one("#spec").border_title = "speculation"
        self.query_one("#load").border_title = "batch vs threshold"
        self.query_one("#gpus").border_title = "GPUs"
        self.query_one("#log").border_title = "server log · 2xx hidden · l: actions"
        self.query_one("#actions").border_title = "actions  (l: log)"
        self.query_one(Banner).display = False

    def on_resize(self) -> None:
        self.set_class(self.size.height >= 40, "-tall")
        self.set_class(self.size.width >= 140, "-wide")

    def show_tail(self, which: str) -> None:
        """"log" or "actions" in the bottom right; on a narrow screen the actions take the GPUs' place too."""
        self.query_one(ContentSwitcher).current = which
        self.set_class(which == "actions", "-actions")

    def action_toggle_log(self) -> None:
        self.show_tail("actions" if self.query_one(ContentSwitcher).current == "log" else "log")

    def action_help(self) -> None:
        app = self.app
        app.push_screen(HelpScreen([b for b in self.BINDINGS if isinstance(b, Binding)], self.read_only,
                                   app.latest.get(app.current)))  # type: ignore[attr-defined]

    def action_full_log(self) -> None:
        app = self.app
        app.push_screen(FullLogScreen(app.current, app.histories.get(app.current)))  # type: ignore[attr-defined]

    async def action_quit(self) -> None:
        await self.app.action_quit()


class DynctlApp(App[int]):
    CSS_PATH = "dynctl.tcss"
    TITLE = "dynctl"
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, hosts: Sequence[str], feed_factory: FeedFactory, actions: ActionsFactory,
                 read_only: bool = False, window_s: float = 300.0, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.clock = clock  # this machine's time, for "since …" counters (tests pin it)
        if not hosts:
            raise ValueError("dynctl tui needs at least one host")
        self.hosts = list(hosts)
        self.current = self.hosts[0]
        self.read_only = read_only
        self.window_s = window_s
        self.latest: dict[str, HostSnapshot | None] = {h: None for h in self.hosts}
        self.histories: dict[str, HostHistory | None] = {h: None for h in self.hosts}
        self.running: dict[str, str] = {}  # host -> action in progress
        self.updates = 0
        self._feed_factory = feed_factory
        self._actions_factory = actions
        self._actions: dict[str, HostActions] = {}
        self.feed: Feed | None = None

    # ------------------------------------------------------------------ lifecycle

    def on_mount(self) -> None:
        self.dashboard = Dashboard(self.hosts, self.read_only, self.window_s)
        self.push_screen(self.dashboard)
        self.feed = self._feed_factory(self._from_feed)
        self.feed.start()
        self.set_interval(1.0, self._tick)

    def on_unmount(self) -> None:
        if self.feed is not None:
            self.feed.stop()

    def _from_feed(self, snap: HostSnapshot, history: HostHistory) -> None:
        """Called on the feed's threads: hand over to the UI thread as a message."""
        self.post_message(HostUpdated(snap, history))

    # ------------------------------------------------------------------ data

    def on_host_updated(self, message: HostUpdated) -> None:
        snap = message.snapshot
        if snap.host not in self.latest:
            return
        self.updates += 1
        self.latest[snap.host] = snap
        self.histories[snap.host] = message.history
        self.dashboard.query_one(HostsBar).show(self.current, self.latest)
        if snap.host == self.current:
            self._show(snap, message.history)
            self.dashboard.query_one(LogTail).follow(message.history, snap.utc_offset)
            if isinstance(self.screen, FullLogScreen) and self.screen.host == snap.host:
                self.screen.follow(message.history)

    def _show(self, snap: HostSnapshot | None, history: HostHistory | None) -> None:
        d = self.dashboard
        header = d.query_one(HeaderBar)
        header.host = self.current
        for panel in (header, d.query_one(Banner), d.query_one(SpeculationPanel), d.query_one(LoadPanel),
                      d.query_one(ChartPanel), d.query_one(GpuPanel)):
            panel.show(snap, history)

    def _tick(self) -> None:
        """Once a second: keep the "since …" of a disconnected host counting without new data."""
        # the timer can fire while the dashboard is being torn down (or not composed yet): nothing to refresh
        for banner in self.dashboard.query(Banner):
            if banner.display:
                banner.refresh()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in CHANGING and self.read_only:
            return False
        if action == "switch_host" and len(self.hosts) < 2:
            return False
        return True

    def action_switch_host(self, step: int) -> None:
        i = self.hosts.index(self.current)
        self.current = self.hosts[(i + step) % len(self.hosts)]
        snap, history = self.latest[self.current], self.histories[self.current]
        self._show(snap, history)
        self.dashboard.query_one(LogTail).follow(history, snap.utc_offset if snap else None, restart=True)
        self.dashboard.query_one(HostsBar).show(self.current, self.latest)

    # ------------------------------------------------------------------ actions

    def actions_for(self, host: str) -> HostActions:
        if host not in self._actions:
            self._actions[host] = self._actions_factory(host)
        return self._actions[host]

    def _refuse_if_busy(self, host: str) -> bool:
        if self.read_only:
            self.notify("read-only mode: actions are disabled", severity="warning")
            return True
        if host in self.running:
            self.notify(f"{host}: {self.running[host]} is still running", severity="warning")
            return True
        return False

    def _ask_threshold(self, title: str, prompt: str, label: str, then: Callable[[int], None]) -> None:
        host = self.current
        if self._refuse_if_busy(host):
            return
        snap = self.latest[host]
        initial = snap.threshold if snap is not None and snap.threshold is not None and snap.threshold >= 0 else None

        def chosen(n: int | None) -> None:
            if n is not None:
                then(n)

        self.push_screen(ThresholdModal(title, prompt, label, initial), chosen)

    def _confirm(self, question: str, detail: str, label: str, then: Callable[[], None]) -> None:
        if self._refuse_if_busy(self.current):
            return
        self.push_screen(ConfirmModal(question, detail, label), lambda ok: then() if ok else None)

    def action_deploy(self) -> None:
        host = self.current
        self._ask_threshold(
            f"Deploy to {host}",
            "Speculation is skipped while more requests than this run at once.\n"
            "The server is restarted with the new threshold; a failed health gate rolls back.",
            "Deploy",
            lambda n: self.start_action(host, "deploy", lambda a, ev, ask: a.deploy(n, ev, ask), f"threshold {n}"),
        )

    def action_threshold(self) -> None:
        host = self.current
        self._ask_threshold(
            f"Live threshold on {host}",
            "Changes the running server's threshold without a restart, then reads it back.",
            "Apply",
            lambda n: self.start_action(host, "threshold", lambda a, ev, ask: a.set_threshold(n, ev), f"to {n}"),
        )

    def action_rollback(self) -> None:
        host = self.current
        self._confirm(f"Roll back {host}?", "Restores the previous release and restarts the server.", "Roll back",
                      lambda: self.start_action(host, "rollback", lambda a, ev, ask: a.rollback(ev)))

    def action_stop_server(self) -> None:
        host = self.current
        self._confirm(f"Stop the server on {host}?", "In-flight requests drain first; then it is gone.", "Stop",
                      lambda: self.start_action(host, "stop", lambda a, ev, ask: a.stop(ev)))

    def action_start_server(self) -> None:
        host = self.current
        if not self._refuse_if_busy(host):
            self.start_action(host, "start", lambda a, ev, ask: a.start(ev))

    def action_restart_server(self) -> None:
        host = self.current
        self._confirm(f"Restart the server on {host}?", "It drains, stops, and starts with the same release.",
                      "Restart", lambda: self.start_action(host, "restart", lambda a, ev, ask: a.restart(ev)))

    def action_bench(self) -> None:
        host = self.current
        self._confirm(f"Benchmark {host}?", "Sends a concurrency sweep of real requests to the server.", "Bench",
                      lambda: self.start_action(host, "bench", lambda a, ev, ask: a.bench(ev)))

    def start_action(self, host: str, name: str, call: ActionCall, detail: str = "") -> None:
        self.running[host] = name
        self.dashboard.show_tail("actions")
        self.dashboard.query_one(ActionLog).add(host, "info", f"▶ {name} {detail}".rstrip())
        self._run_action(host, name, call)

    @work(thread=True, exit_on_error=False, group="actions")
    def _run_action(self, host: str, name: str, call: ActionCall) -> None:
        concluded = False
        warnings: list[str] = []

        def on_event(event: Any) -> None:
            nonlocal concluded
            concluded = concluded or isinstance(event, (events.Finished, events.Unchanged))
            if isinstance(event, events.Warning):
                warnings.append(event.text)
            self.post_message(ActionProgress(host, name, event))

        def confirm(question: str) -> None:
            """The action's own question, once it has planned: asked from this worker, the plan's warnings in
            the dialog, so the operator commits knowing them."""
            detail = "\n".join(f"⚠ {text}" for text in warnings) or "The plan raised no warnings."
            answer: Future[bool] = Future()
            self.call_from_thread(self.push_screen, ConfirmModal(question, detail, name.capitalize()),
                                  answer.set_result)
            if not answer.result():
                raise Declined(f"{name} cancelled on {host}: nothing was changed")

        try:
            call(self.actions_for(host), on_event, confirm)
        except Declined as declined:
            self.post_message(ActionFinished(host, name, True, str(declined)))
            return
        except Exception as err:  # the panel shows every failure; the app keeps running
            self.post_message(ActionFinished(host, name, False, f"{name} failed: {describe_error(err)}"))
            return
        self.post_message(ActionFinished(host, name, True, None if concluded else f"{name} done"))

    def on_action_progress(self, message: ActionProgress) -> None:
        line = describe(message.event)
        if line is not None:
            self.dashboard.query_one(ActionLog).add(message.host, *line)

    def on_action_finished(self, message: ActionFinished) -> None:
        self.running.pop(message.host, None)
        if message.text is None:
            return
        self.dashboard.query_one(ActionLog).add(message.host, "ok" if message.ok else "error", message.text)
        if not message.ok:
            self.notify(message.text, severity="error", timeout=6)

    async def action_quit(self) -> None:
        if self.running:
            busy = ", ".join(f"{a} on {h}" for h, a in self.running.items())
            self.push_screen(
                ConfirmModal("Quit while an action runs?", f"{busy} continues on the host; progress is in its journal.",
                             "Quit"),
                lambda ok: self.exit(0) if ok else None,
            )
            return
        self.exit(0)


def create_app(hosts: Sequence[str], feed_factory: FeedFactory, actions: ActionsFactory,
               read_only: bool = False, window_s: float = 300.0, clock: Callable[[], float] = time.time) -> DynctlApp:
    """The dashboard for `hosts`; `feed_factory(on_update)` builds the feed, `actions(host)` what the keys call
    (`dynctl.actions.host.actions_for` in the product)."""
    return DynctlApp(hosts, feed_factory, actions, read_only=read_only, window_s=window_s, clock=clock)


__all__ = ["DynctlApp", "create_app", "HostUpdated", "ActionProgress", "ActionFinished", "FeedFactory"]
