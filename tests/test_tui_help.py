"""The TUI's `?` screen lists every key of the dashboard, and the load panel says when a number is stale or the
live threshold is not the release's."""

from __future__ import annotations

import pytest

from dynctl.tui.app import Dashboard
from dynctl.tui.help import HelpScreen
from dynctl.tui.widgets import LoadPanel
from tui_harness import T0, Harness
from watch_items import decode_line, item

pytestmark = pytest.mark.asyncio


async def test_question_mark_opens_the_keys_and_escape_closes_them():
    harness = Harness(["glm5"])
    async with harness.app.run_test(size=(100, 30)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        screen = harness.app.screen
        assert isinstance(screen, HelpScreen)
        text = "\n".join(f"{k} {what}" for k, what in screen.rows)
        for binding in Dashboard.BINDINGS:  # every key, none forgotten
            assert binding.key.split(",")[0].replace("question_mark", "?") in text
        assert "deploy a threshold" in text and "? this screen" in text
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(harness.app.screen, HelpScreen) and harness.calls == []


async def test_a_gauge_older_than_the_stale_limit_is_marked_and_a_live_threshold_is_set_apart():
    harness = Harness(["glm5"])
    async with harness.app.run_test(size=(120, 30)) as pilot:
        first = item(T0, 0, 6, log=[decode_line(T0, 6, 500.0)])
        first["log"]["decode"] = decode_line(T0, 6, 500.0)
        harness.push(first)
        later = item(T0 + 30, 1, 6)  # no decode line for 30 s: the gauges are that old
        later["server_info"]["data"]["internal_state"]["speculative_disable_batch_threshold"] = 7
        harness.push(later)
        await pilot.pause()
        text = harness.panel(LoadPanel).text()
        assert "STALE 30s" in text and "(release 5)" in text
