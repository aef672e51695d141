"""`dynctl tui --host GROUP`: a row per host, fleet totals on top, a rollout host by host; Enter opens the host's
dashboard, Escape comes back. `d` / `r` run the rolling deploy / rollback behind the same confirm dialogs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from dynctl.base import events
from dynctl.live.feed import describe_error
from dynctl.live.snapshot import HostSnapshot
from dynctl.tui.app import DynctlApp, FeedFactory
from dynctl.tui.actions import ActionsFactory
from dynctl.tui.fleet_table import FleetTable
from dynctl.tui.modals import ConfirmModal, ThresholdModal

COLUMNS = ("host", "state", "release", "threshold", "batch", "spec", "tok/s", "GPU mem", "gateway", "rollout")
GatewayReader = Callable[[], dict[str, dict[str, Any]]]  # host -> {"status", "load"} (or {"error"})
RolloutRunner = Callable[[str, Any, Callable[[Any], None]], list[Any]]  # (action, arg, on_event) -> HostResults


def _num(value: Any, spec: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}"


def host_row(host: str, snap: HostSnapshot | None, gateway: dict[str, Any] | None, rollout: str) -> tuple[str, ...]:
    """One row of the fleet table, from the host's latest snapshot and its gateway entry."""
    gw = "-" if gateway is None else ("unreachable" if gateway.get("error") else
                                      f"{gateway.get('status')} load {_num(gateway.get('load'))}")
    if snap is None:
        return (host, "waiting", "", "", "", "", "", "", gw, rollout)
    if not snap.connected:
        return (host, "disconnected", "", "", "", "", "", "", gw, rollout)
    spec = "-" if snap.speculation is None else ("ON" if snap.speculation else "OFF")
    used = sum(g.mem_used_mib or 0 for g in snap.gpus)
    total = sum(g.mem_total_mib or 0 for g in snap.gpus)
    mem = f"{used / 1024:.0f}/{total / 1024:.0f} GiB" if snap.gpus else "-"
    batch = f"{_num(snap.running_reqs)} / {_num(snap.threshold)}"
    return (host, snap.state, (snap.release or "baseline")[:22], _num(snap.threshold), batch, spec,
            _num(snap.gen_throughput, ".0f"), mem, gw, rollout)


def fleet_totals(name: str, latest: dict[str, HostSnapshot | None]) -> str:
    snaps = [s for s in latest.values() if s is not None and s.connected]
    ready = sum(s.state == "ready" for s in snaps)
    tok = sum(s.gen_throughput or 0 for s in snaps)
    running = sum(s.running_reqs or 0 for s in snaps)
    spec_on = sum(bool(s.speculation) for s in snaps)
    return (f"fleet {name}: {len(latest)} hosts, {ready} ready, {len(latest) - len(snaps)} not answering · "
            f"{tok:,.0f} tok/s · {running} running · speculation on at {spec_on}")


class FleetScreen(Screen):
    BINDINGS = [
        Binding("enter", "open", "Open host"),
        Binding("d", "deploy", "Rolling deploy"),
        Binding("r", "rollback", "Rolling rollback"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, name: str, hosts: Sequence[str], read_only: bool) -> None:
        super().__init__()
        self.fleet_name, self.hosts, self.read_only = name, list(hosts), read_only
        self._shown: dict[str, tuple[str, ...]] = {}  # what each row shows now

    def compose(self) -> ComposeResult:
        yield Static(fleet_totals(self.fleet_name, {h: None for h in self.hosts}), id="fleet-totals")
        table: DataTable = FleetTable(id="fleet-table", cursor_type="row", zebra_stripes=True)
        for column in COLUMNS:
            table.add_column(column, key=column)
        for h in self.hosts:
            table.add_row(*host_row(h, None, None, ""), key=h)
        yield table
        yield Static("", id="fleet-status")
        yield Footer(compact=True, show_command_palette=False)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return not (self.read_only and action in ("deploy", "rollback"))

    def show(self, latest: dict[str, HostSnapshot | None], gateways: dict[str, dict[str, Any]],
             rollout: dict[str, str], hosts: set[str] | None = None) -> None:
        """Redraw the totals and the rows of `hosts` (all by default), touching only the cells that changed."""
        try:
            totals, table = self.query_one("#fleet-totals", Static), self.query_one(DataTable)
        except NoMatches:  # a timer that fires while the app is being torn down: nothing to draw on
            return
        totals.update(fleet_totals(self.fleet_name, latest))
        for h in self.hosts if hosts is None else [h for h in self.hosts if h in hosts]:
            row = host_row(h, latest.get(h), gateways.get(h), rollout.get(h, ""))
            if self._shown.get(h) == row:
                continue
            before = self._shown.get(h) or ("",) * len(COLUMNS)
            for column, value, old in zip(COLUMNS, row, before):
                if value != old:
                    table.update_cell(h, column, value)
            self._shown[h] = row

    def selected(self) -> str:
        table = self.query_one(DataTable)
        return self.hosts[max(0, min(table.cursor_row, len(self.hosts) - 1))]

    def action_open(self) -> None:
        self.app.open_host(self.selected())  # type: ignore[attr-defined]

    def on_data_table_row_selected(self, message: DataTable.RowSelected) -> None:
        self.app.open_host(str(message.row_key.value))  # type: ignore[attr-defined]

    def action_deploy(self) -> None:
        self.app.rolling_deploy()  # type: ignore[attr-defined]

    def action_rollback(self) -> None:
        self.app.rolling_rollback()  # type: ignore[attr-defined]

    async def action_quit(self) -> None:
        await self.app.action_quit()


class FleetApp(DynctlApp):
    """The dashboard app with the fleet screen on top of it."""

    BINDINGS = [Binding("escape", "fleet", "Fleet", show=False)]

    def __init__(self, name: str, hosts: Sequence[str], feed_factory: FeedFactory, actions: ActionsFactory, *,
                 gateways: GatewayReader | None = None, rollout: RolloutRunner | None = None,
                 read_only: bool = False, interval: float = 1.0, **kw: Any) -> None:
        super().__init__(hosts, feed_factory, actions, read_only=read_only, **kw)
        self.fleet_name = name
        self._read_gateways = gateways
        self._run_rollout = rollout
        self.interval = interval
        self.gateway_rows: dict[str, dict[str, Any]] = {}
        self.rollout_state: dict[str, str] = {}
        self.rollout_running: str | None = None
        self._dirty: set[str] = set()  # hosts whose row waits for the next redraw

    # Textual runs the handlers of every class in the MRO, this one first: what needs the dashboard (mounted by
    # DynctlApp.on_mount) or the latest snapshot (kept by DynctlApp.on_host_updated) runs after them.
    def on_mount(self) -> None:
        self.fleet = FleetScreen(self.fleet_name, self.hosts, self.read_only)
        self.call_after_refresh(self._mount_fleet)

    def _mount_fleet(self) -> None:
        self.install_screen(self.fleet, "fleet")
        self.push_screen("fleet")
        self.set_interval(max(self.interval, 0.5), self._redraw_dirty)  # one redraw of the table per sample interval
        if self._read_gateways is not None:
            self._poll_gateways()
            self.set_interval(max(self.interval, 1.0), self._poll_gateways)

    @work(thread=True, exclusive=True, group="gateways", exit_on_error=False)
    def _poll_gateways(self) -> None:
        try:
            rows = self._read_gateways() if self._read_gateways else {}
        except Exception as err:  # noqa: BLE001 - a gateway that fails is shown, the screen keeps going
            rows = {h: {"error": describe_error(err)} for h in self.hosts}
        self.call_from_thread(self._gateways_read, rows)

    def _gateways_read(self, rows: dict[str, dict[str, Any]]) -> None:
        self.gateway_rows = rows
        self._dirty |= set(self.hosts)

    def _show_fleet(self, hosts: set[str] | None = None) -> None:
        if getattr(self, "fleet", None) is not None and self.fleet.is_mounted:
            self.fleet.show(self.latest, self.gateway_rows, self.rollout_state, hosts)

    def on_host_updated(self, message: Any) -> None:
        # The dashboard below draws each update only while it is on screen; the fleet's rows are redrawn
        # together on the screen's own beat, since many hosts report every second.
        message.prevent_default()
        if self.screen is self.dashboard:
            DynctlApp.on_host_updated(self, message)
        else:
            snap = message.snapshot
            if snap.host in self.latest:
                self.latest[snap.host] = snap
                self.histories[snap.host] = message.history
        self._dirty.add(message.snapshot.host)

    def _redraw_dirty(self) -> None:
        if self._dirty:
            dirty, self._dirty = self._dirty, set()
            self._show_fleet(dirty)

    def open_host(self, host: str) -> None:
        if self.screen is self.fleet:
            self.current = host
            self.pop_screen()
            self.action_switch_host(0)  # draws the host from its latest snapshot and history

    def action_fleet(self) -> None:
        if self.screen is self.dashboard:
            self.push_screen("fleet")

    # ------------------------------------------------------------------ rolling operations

    def _refuse_rollout(self) -> bool:
        if self.read_only or self._run_rollout is None:
            self.notify("read-only mode: actions are disabled", severity="warning")
            return True
        if self.rollout_running or self.running:
            self.notify(f"{self.rollout_running or 'an action'} is still running", severity="warning")
            return True
        return False

    def rolling_deploy(self) -> None:
        if self._refuse_rollout():
            return

        def chosen(n: int | None) -> None:
            if n is not None:
                self._start_rollout("deploy", n)

        self.push_screen(ThresholdModal(
            f"Rolling deploy to {self.fleet_name}",
            "Host by host: out of the gateway, drained, deployed, back in, one request through the gateway.\n"
            "A host that fails is rolled back and the rollout stops.", "Deploy", None), chosen)

    def rolling_rollback(self) -> None:
        if self._refuse_rollout():
            return
        self.push_screen(ConfirmModal(f"Roll {self.fleet_name} back?",
                                      "Host by host through the gateway, each to its previous release.", "Roll back"),
                         lambda ok: self._start_rollout("rollback", None) if ok else None)

    def _start_rollout(self, action: str, arg: Any) -> None:
        self.rollout_running = f"rolling {action}"
        self.rollout_state = {h: "pending" for h in self.hosts}
        self._show_fleet()
        self._rollout_worker(action, arg)

    @work(thread=True, exit_on_error=False, group="rollout")
    def _rollout_worker(self, action: str, arg: Any) -> None:
        def on_event(event: Any) -> None:
            text = getattr(event, "detail", None) or getattr(event, "text", None) or ""
            host = text.split(": ", 1)[0] if ": " in text else None
            if host in self.rollout_state:
                step = getattr(event, "step", None)
                label = f"{step}…" if isinstance(event, events.StepStarted) else (f"{step} ✓" if step else None)
                if label:
                    self.call_from_thread(self._rollout_step, host, label)

        try:
            results = self._run_rollout(action, arg, on_event) if self._run_rollout else []
        except Exception as err:  # noqa: BLE001 - shown; nothing else to do on the screen
            self.call_from_thread(self._rollout_done, [], describe_error(err))
            return
        self.call_from_thread(self._rollout_done, results, None)

    def _rollout_step(self, host: str, label: str) -> None:
        self.rollout_state[host] = label
        self._show_fleet()

    def _rollout_done(self, results: list[Any], error: str | None) -> None:
        for r in results:
            self.rollout_state[r.host] = r.outcome
        self.rollout_running = None
        self._show_fleet()
        if error:
            self.notify(f"rollout: {error}", severity="error", timeout=8)
        elif any(r.outcome == "failed" for r in results):
            self.notify("rollout stopped: a host failed and was rolled back", severity="error", timeout=8)
        else:
            self.notify("rollout done")


def create_fleet_app(name: str, hosts: Sequence[str], feed_factory: FeedFactory, actions: ActionsFactory, *,
                     gateways: GatewayReader | None = None, rollout: RolloutRunner | None = None,
                     read_only: bool = False, interval: float = 1.0, **kw: Any) -> FleetApp:
    return FleetApp(name, hosts, feed_factory, actions, gateways=gateways, rollout=rollout, read_only=read_only,
                    interval=interval, **kw)
