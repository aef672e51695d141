"""The fleet screen of `dynctl tui --host GROUP` under Pilot: a row per host with its gateway entry, totals,
Enter to a host's dashboard and Escape back, a rolling deploy behind the threshold dialog, host by host."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from textual.coordinate import Coordinate
from textual.widgets import DataTable, Static
from tui_harness import T0, PushFeed, RecordingActions
from watch_items import item

from dynctl.base import events
from dynctl.core.rollout import HostResult
from dynctl.tui.fleet import create_fleet_app, fleet_totals, host_row
from dynctl.tui.modals import ThresholdModal
from dynctl.tui.widgets import HeaderBar

HOSTS = ["h1", "h2", "h3"]


class World:
    def __init__(self, read_only: bool = False) -> None:
        self.feed: PushFeed | None = None
        self.calls: list[Any] = []
        self.rollouts: list[tuple[str, Any]] = []
        self.gate = threading.Event()

        def feed_factory(on_update):
            self.feed = PushFeed(HOSTS, on_update)
            return self.feed

        def rollout(action: str, arg: Any, on_event) -> list[HostResult]:
            self.rollouts.append((action, arg))
            on_event(events.StepStarted("drain", "h1: out of http://gw"))
            assert self.gate.wait(10)
            on_event(events.StepDone("deploy", 1.0, "h1: threshold 5"))
            return [HostResult("h1", "deployed"), HostResult("h2", "failed"), HostResult("h3", "untouched")]

        self.app = create_fleet_app(
            "prod", HOSTS, feed_factory, lambda h: RecordingActions(h, self.calls),
            gateways=lambda: {"h1": {"status": "ready", "load": 2}, "h2": {"status": "draining", "load": 0},
                              "h3": {"error": "gateway down"}},
            rollout=rollout, read_only=read_only, clock=lambda: T0 + 30)

    def push(self, host: str, running: int, threshold: int = 5) -> None:
        assert self.feed is not None
        self.feed.push_item(item(T0, 1, running, threshold=threshold), host)


def cells(app, host: str) -> list[str]:
    table = app.fleet.query_one(DataTable)
    return [str(c) for c in table.get_row(host)]


async def settle(pilot, cond, what: str) -> None:
    for _ in range(200):
        if cond():
            return
        await pilot.pause(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def on_the_fleet_screen(w: World) -> AsyncIterator[Any]:
    """The app under Pilot, once its fleet screen is on top."""
    async with w.app.run_test(size=(160, 40)) as pilot:
        await settle(pilot, lambda: w.app.screen is getattr(w.app, "fleet", None), "the fleet screen on top")
        yield pilot


@pytest.mark.asyncio
async def test_a_row_per_host_with_its_gateway_and_totals_on_top():
    w = World()
    async with on_the_fleet_screen(w) as pilot:
        w.push("h1", 7)
        w.push("h2", 3)
        await settle(pilot, lambda: cells(w.app, "h1")[4] == "7 / 5" and "load 2" in cells(w.app, "h1")[8],
                     "h1's row")
        row = cells(w.app, "h1")
        assert row[:2] == ["h1", "ready"] and row[3] == "5"
        assert cells(w.app, "h2")[8] == "draining load 0"
        assert cells(w.app, "h3")[1] == "waiting" and cells(w.app, "h3")[8] == "unreachable"
        totals = str(w.app.fleet.query_one("#fleet-totals", Static).render())
        assert "3 hosts, 2 ready, 1 not answering" in totals and "10 running" in totals


@pytest.mark.asyncio
async def test_enter_opens_the_host_dashboard_and_escape_returns():
    w = World()
    async with on_the_fleet_screen(w) as pilot:
        w.push("h2", 3)
        assert w.app.screen is w.app.fleet
        await pilot.press("down", "enter")
        await settle(pilot, lambda: w.app.screen is w.app.dashboard, "the dashboard")
        assert w.app.current == "h2" and w.app.dashboard.query_one(HeaderBar).host == "h2"
        await pilot.press("escape")
        await settle(pilot, lambda: w.app.screen is w.app.fleet, "the fleet screen")


@pytest.mark.asyncio
async def test_rolling_deploy_asks_the_threshold_and_shows_each_host():
    w = World()
    async with on_the_fleet_screen(w) as pilot:
        await pilot.press("d")
        await settle(pilot, lambda: isinstance(w.app.screen, ThresholdModal), "the threshold dialog")
        await pilot.press("5", "enter")
        await settle(pilot, lambda: cells(w.app, "h1")[9] == "drain…", "h1 draining")
        assert cells(w.app, "h2")[9] == "pending"
        w.gate.set()
        await settle(pilot, lambda: cells(w.app, "h2")[9] == "failed", "the rollout's end")
        assert w.rollouts == [("deploy", 5)]
        assert [cells(w.app, h)[9] for h in HOSTS] == ["deployed", "failed", "untouched"]
        assert w.calls == []  # the one-host actions were not used


@pytest.mark.asyncio
async def test_read_only_has_no_rollout_keys():
    w = World(read_only=True)
    async with on_the_fleet_screen(w) as pilot:
        await pilot.press("d")
        await pilot.pause(0.1)
        assert w.app.screen is w.app.fleet and w.rollouts == []


def test_rows_and_totals_are_pure_functions_of_the_snapshots():
    from dynctl.live.snapshot import HostSnapshot

    snap = HostSnapshot("a", T0, state="ready", threshold=5, running_reqs=2, speculation=True, gen_throughput=812.4,
                        release="20261201T1200-abc")
    assert host_row("a", snap, {"status": "ready", "load": 1}, "") == (
        "a", "ready", "20261201T1200-abc", "5", "2 / 5", "ON", "812", "-", "ready load 1", "")
    assert host_row("b", None, None, "pending")[1] == "waiting"
    down = HostSnapshot("c", T0, connected=False)
    assert host_row("c", down, None, "")[1] == "disconnected"
    assert fleet_totals("prod", {"a": snap, "c": down}).startswith("fleet prod: 2 hosts, 1 ready, 1 not answering")


def shown_line(app, host: str) -> str:
    """The text of host's row as the table draws it now (the header is line 0)."""
    table = app.fleet.query_one(DataTable)
    return table.render_line(1 + HOSTS.index(host)).text


@pytest.mark.asyncio
async def test_a_changed_cell_is_drawn_again_alone_and_shows_the_new_value(monkeypatch):
    rendered: list[tuple[int, int, str]] = []  # (row, column, text) of every body cell rendered
    original = DataTable._render_cell

    def counting(self, row_index, column_index, *args, **kw):
        if row_index >= 0:  # the header row (-1) is not the table's body
            text = str(self.get_cell_at(Coordinate(row_index, column_index))) if column_index >= 0 else ""
            rendered.append((row_index, column_index, text))
        return original(self, row_index, column_index, *args, **kw)

    monkeypatch.setattr(DataTable, "_render_cell", counting)
    updated: list[tuple[str, str]] = []
    original_update = DataTable.update_cell

    def updating(self, row_key, column_key, value, *args, **kw):
        updated.append((str(getattr(row_key, "value", row_key)), str(getattr(column_key, "value", column_key))))
        return original_update(self, row_key, column_key, value, *args, **kw)

    monkeypatch.setattr(DataTable, "update_cell", updating)
    w = World()
    async with on_the_fleet_screen(w) as pilot:
        for h in HOSTS:
            w.push(h, 7)
        # Waited for on the cells the app itself draws, with their text: until its paint has drawn every row's
        # new batch, a paint still to come would draw whole rows and be counted against the change below.
        await settle(pilot, lambda: all((r, 4, "7 / 5") in rendered for r in range(len(HOSTS))), "every row drawn")
        await settle(pilot, lambda: w.app.fleet.query_one(DataTable).has_focus, "the table focused")
        before = cells(w.app, "h2")
        rendered.clear()
        updated.clear()
        w.push("h2", 9)
        await settle(pilot, lambda: (1, 4, "9 / 5") in rendered, "h2's new batch drawn")
        body = {(row, column) for row, column, _ in rendered}
        changed = {(1, i) for i, (old, new) in enumerate(zip(before, cells(w.app, "h2"))) if old != new}
        assert (1, 4) in changed and body == changed, f"cells drawn again: {sorted(body)}, changed: {sorted(changed)}"
        assert "9 / 5" in shown_line(w.app, "h2") and "7 / 5" in shown_line(w.app, "h1")
        # what the screen asked the table to change: the changed cells of h2, nothing else (the table's
        # own render cache would hide a screen that sets every cell again)
        columns = [str(c.key.value) for c in w.app.fleet.query_one(DataTable).ordered_columns]
        assert sorted(updated) == sorted(("h2", columns[i]) for _, i in changed), updated
