"""The TUI's `?` screen lists every key of the dashboard, and the load panel says when a number is stale or the
live threshold is not the release's."""

from __future__ import annotations

import pytest

from dynctl.live.snapshot import disconnected
from dynctl.tui.app import Dashboard
from dynctl.tui.help import HelpScreen
from dynctl.tui.widgets import GpuPanel, LoadPanel
from tui_harness import T0, Harness
from watch_items import decode_line, item

pytestmark = pytest.mark.asyncio


async def test_question_mark_opens_the_keys_and_escape_closes_them():
    harness = Harness(["glm5"])
    async with harness.app.run_test(size=(100, 40)) as pilot:
        harness.push(item(T0, 0, 3, loads=(3, 0)))
        await pilot.pause()
        await pilot.press("question_mark")
        await pilot.pause()
        screen = harness.app.screen
        assert isinstance(screen, HelpScreen)
        text = "\n".join(f"{k} {what}" for k, what in screen.rows)
        for binding in Dashboard.BINDINGS:  # every key, none forgotten
            assert binding.key.split(",")[0].replace("question_mark", "?") in text
        assert "deploy a threshold" in text and "? this screen" in text
        sources = "\n".join(screen.sources)
        assert "batch        /v1/loads, 0 s" in sources and "threshold    /server_info" in sources
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


async def test_the_gpu_panel_lists_who_holds_each_gpu():
    harness = Harness(["glm5"])
    async with harness.app.run_test(size=(120, 40)) as pilot:
        raw = item(T0, 0, 3, gpus=2)
        uuid0, uuid1 = (f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in (0, 1))
        raw["gpu_procs"] = {"ok": True, "t": T0, "csv": f"{uuid0}, 4242, python3, 117000\n"
                                                        f"{uuid1}, 4243, python3, 116000\n{uuid1}, 777, [N/A], 900\n",
                            "owners": {"4242": {"user": "root", "command": "python3 -m sglang.launch_server --tp 2"},
                                       "4243": {"user": "root", "command": "sglang::scheduler_TP1"},
                                       "777": {"user": "alice", "command": "python train.py"}}}
        harness.push(raw)
        await pilot.pause()
        text = harness.panel(GpuPanel).text()
        lines = text.splitlines()
        assert any(line.split()[:4] == ["0", "4242", "root", "114G"] for line in lines), text
        assert any(line.split()[:3] == ["1", "777", "alice"] and "train.py" in line for line in lines), text
        harness.push(item(T0 + 1, 1, 3, gpus=2))  # a sample without a new list keeps the last one
        await pilot.pause()
        assert "alice" in harness.panel(GpuPanel).text()
        assert "STALE" not in harness.panel(GpuPanel).text()
        kept = harness.push(item(T0 + 40, 2, 3, gpus=2))  # ... and says how old it has grown
        await pilot.pause()
        header = next(line for line in harness.panel(GpuPanel).text().splitlines() if "COMMAND" in line)
        assert "STALE 40s" in header and "alice" in harness.panel(GpuPanel).text()
        assert kept.readings["gpu_processes"].age_s == 40.0 and not kept.readings["gpus"].stale
        assert not harness.panel(GpuPanel).has_class("-stale")
        assert harness.feed is not None
        harness.feed.push(disconnected("glm5", T0 + 55, "ssh: connection reset", kept))
        await pilot.pause()
        panel = harness.panel(GpuPanel)
        assert panel.has_class("-stale"), "the GPU panel of a host we cannot hear is dimmed"
        first = panel.text().splitlines()[0]
        assert "STALE" in first, first  # the utilisation read 15 s before now is not live either


async def test_the_full_log_shows_every_line_and_follows_until_paused():
    from dynctl.tui.fulllog import FullLogScreen
    from textual.widgets import RichLog

    harness = Harness(["glm5"])
    routine = '[2026-11-29 11:00:00] INFO:     127.0.0.1:5555 - "GET /health HTTP/1.1" 200 OK'
    async with harness.app.run_test(size=(120, 30)) as pilot:
        harness.push(item(T0, 0, 3, log=["a line no release of sglang writes", routine]))
        await pilot.pause()
        await pilot.press("L")
        await pilot.pause()
        screen = harness.app.screen
        assert isinstance(screen, FullLogScreen)
        assert screen.lines_written == ["a line no release of sglang writes", routine]  # raw, routine ones too
        harness.push(item(T0 + 1, 1, 3, log=["the next line"]))
        await pilot.pause()
        assert screen.lines_written[-1] == "the next line"
        await pilot.press("f")
        assert screen.query_one(RichLog).auto_scroll is False
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(harness.app.screen, FullLogScreen)
