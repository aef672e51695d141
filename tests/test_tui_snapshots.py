"""How the dashboard looks, at 80×24 and 160×48, with deterministic data (pytest-textual-snapshot).

Regenerate after an intended change: `pytest tests/test_tui_snapshots.py --snapshot-update`, then look at
the SVGs in tests/__snapshots__/test_tui_snapshots/ before committing them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import Input

from tui_harness import T0, Harness
from watch_items import ramp

from dynctl.live.snapshot import disconnected


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Times on screen are local: pin the zone so the pictures do not depend on the machine."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


class Scene(Harness):
    def __init__(self, hosts: list[str], read_only: bool = False) -> None:
        super().__init__(hosts, read_only=read_only, now=T0 + 200)

    def load_ramp(self, host: str, seconds: int = 150, peak: int = 16, threshold: int = 5,
                  upto: int | None = None) -> None:
        """Push a 1 → peak → 1 ramp of `seconds` samples (only the first `upto`)."""
        assert self.feed is not None
        for raw in ramp(T0, seconds, threshold=threshold, peak=peak)[:upto]:
            self.feed.push_item(raw, host)


async def settle(pilot: Pilot) -> None:
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()


class TestDashboard:
    def test_speculation_off_under_load_80x24(self, snap_compare: Any) -> None:
        scene = Scene(["glm5"])

        async def run_before(pilot: Pilot) -> None:
            scene.load_ramp("glm5", seconds=150, upto=60)  # still climbing: batch 13, speculation off
            await settle(pilot)

        assert snap_compare(scene.app, terminal_size=(80, 24), run_before=run_before)

    def test_back_on_after_the_ramp_160x48_two_hosts(self, snap_compare: Any) -> None:
        scene = Scene(["glm5", "demo"])

        async def run_before(pilot: Pilot) -> None:
            scene.load_ramp("demo", seconds=150, peak=40, threshold=8)
            scene.load_ramp("glm5", seconds=150)
            await settle(pilot)

        assert snap_compare(scene.app, terminal_size=(160, 48), run_before=run_before)

    def test_disconnected_80x24(self, snap_compare: Any) -> None:
        scene = Scene(["glm5"])

        async def run_before(pilot: Pilot) -> None:
            scene.load_ramp("glm5", seconds=60)
            assert scene.feed is not None
            last = scene.feed.histories["glm5"].latest
            scene.feed.push(disconnected("glm5", T0 + 185, "ssh root@pve: connection reset by peer", last,
                                         retry_at=T0 + 208))
            await settle(pilot)

        assert snap_compare(scene.app, terminal_size=(80, 24), run_before=run_before)


class TestDialogs:
    def test_deploy_threshold_dialog_80x24(self, snap_compare: Any) -> None:
        scene = Scene(["glm5"])

        async def run_before(pilot: Pilot) -> None:
            scene.load_ramp("glm5", seconds=30)
            await settle(pilot)
            await pilot.press("d")
            # the input's cursor blinks every 0.5 s: held steady (shown), the picture does not depend on
            # how long the machine took from the key press to the screenshot
            pilot.app.screen.query_one(Input).cursor_blink = False
            await settle(pilot)

        assert snap_compare(scene.app, terminal_size=(80, 24), run_before=run_before)

    def test_read_only_160x48(self, snap_compare: Any) -> None:
        scene = Scene(["glm5"], read_only=True)

        async def run_before(pilot: Pilot) -> None:
            scene.load_ramp("glm5", seconds=100)
            await settle(pilot)

        assert snap_compare(scene.app, terminal_size=(160, 48), run_before=run_before)
