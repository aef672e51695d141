"""The dashboard's behaviour with Pilot: snapshots in, indicators, banner, keys, modals, read-only, hosts.

The feed is a PushFeed (the same histories and callback as the live one) fed with `watch` items in the
agent's exact shape; actions are recorded by a small HostActions implementation (tests/tui_harness.py).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from textual.widgets import Input
from tui_harness import T0, Harness, log_text
from watch_items import decode_line, item, ramp, transition_line

from dynctl.live.snapshot import HostSnapshot, disconnected
from dynctl.tui.app import HostUpdated
from dynctl.tui.modals import ConfirmModal, ThresholdModal
from dynctl.tui.widgets import ActionLog, Banner, ChartPanel, HeaderBar, HostsBar, LoadPanel, LogTail, SpeculationPanel



@pytest.fixture
def harness() -> Harness:
    return Harness(["glm5"])


@pytest.mark.asyncio
class TestIndicators:
    async def test_speculation_flips_off_and_on_with_the_switch_time(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            harness.push(item(T0, 0, 3, tps=290.0))
            await pilot.pause()
            spec = harness.panel(SpeculationPanel)
            assert "SPECULATION ON" in spec.text() and spec.has_class("-on")
            assert "batch    3" in harness.panel(LoadPanel).text() and "thr 5" in harness.panel(LoadPanel).text()
            harness.push(item(T0 + 1, 1, 7, marks=[transition_line(T0 + 0.6, False, 7, 5)]))
            await pilot.pause()
            assert "SPECULATION OFF" in spec.text() and spec.has_class("-off") and not spec.has_class("-on")
            assert "since 11:00:00" in spec.text() and "batch 7 > threshold 5" in spec.text()
            harness.push(item(T0 + 20, 2, 4, marks=[transition_line(T0 + 19.7, True, 4, 5)]))
            await pilot.pause()
            assert "SPECULATION ON" in spec.text() and "since 11:00:19 (1s ago)" in spec.text()  # host clock
            axis = harness.panel(ChartPanel).text().splitlines()[-1]
            assert axis.index("▼") < axis.index("▲")  # off, then on, in time order

    async def test_idle_shows_what_the_next_request_gets(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            harness.push(item(T0, 0, 12, spec=False, marks=[transition_line(T0 - 1, False, 12, 5)], loads=(12, 0)))
            await pilot.pause()
            assert "SPECULATION OFF" in harness.panel(SpeculationPanel).text()
            harness.push(item(T0 + 1, 1, 12, spec=False, loads=(0, 0)))  # gauges stale, scheduler empty
            await pilot.pause()
            text = harness.panel(SpeculationPanel).text()
            assert "SPECULATION ON" in text and "idle: the next request speculates" in text
            assert "batch    0" in harness.panel(LoadPanel).text()

    async def test_header_shows_host_version_strategy_release_state_uptime(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(120, 30)) as pilot:
            assert "waiting for the first sample" in harness.panel(HeaderBar).text()
            harness.push(item(T0, 0, 3))
            await pilot.pause()
            text = harness.panel(HeaderBar).text()
            for part in ("glm5", "sglang 0.5.9", "patch", "rel 20261129T120000-deploy", "READY", "up 2h03m", "pid 4242"):
                assert part in text

    async def test_server_down_and_no_speculation_configured(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            harness.push(item(T0, 0, 0, pid=None, http=False))
            await pilot.pause()
            assert "DOWN" in harness.panel(HeaderBar).text()
            assert "SPECULATION ?" in harness.panel(SpeculationPanel).text()
            assert "batch    —" in harness.panel(LoadPanel).text()

    async def test_disconnected_banner_appears_counts_and_goes(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            live = harness.push(item(T0, 0, 3))
            await pilot.pause()
            banner = harness.panel(Banner)
            assert not banner.display
            assert harness.feed is not None
            harness.feed.push(disconnected("glm5", T0 + 10, "ssh: connection reset", live, retry_at=T0 + 34))
            await pilot.pause()
            assert banner.display and banner.has_class("-disconnected")
            text = banner.text()
            assert "DISCONNECTED since 11:00:10 (20s)" in text and "retry in 4s" in text and "connection reset" in text
            assert harness.panel(SpeculationPanel).has_class("-stale")
            assert "batch    3" in harness.panel(LoadPanel).text()  # last known values stay
            harness.push(item(T0 + 40, 0, 5))
            await pilot.pause()
            assert not banner.display

    async def test_log_tail_follows_even_when_updates_are_merged(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(100, 30)) as pilot:
            for i in range(5):  # five updates before the UI runs: merged into one message, no line lost
                harness.push(item(T0 + i, i, 3, log=[decode_line(T0 + i, 3, 290.0 + i)]))
            await pilot.pause()
            lines = log_text(harness.panel(LogTail))
            assert len(lines) == 5
            assert lines[0] == "11:00:00 TP0 decode run 3 · 290 tok/s · acc 2.50 · kv 10% · queue 0"
            assert lines[-1].startswith("11:00:04 TP0 decode run 3 · 294 tok/s")
            assert harness.app.updates < 5  # the newer update replaced queued ones

    async def test_chart_draws_the_ramp(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            for raw in ramp(T0, 120, threshold=5, peak=16):
                harness.push(raw)
            await pilot.pause()
            chart = harness.panel(ChartPanel).text()
            assert chart.count("▼") == 1 and chart.count("▲") == 1
            assert "█" in chart and chart.splitlines()[0].lstrip().startswith("1.2k")  # peak 1120 tok/s


async def screen_of(pilot, cls: type, deadline_s: float = 10.0):
    """The screen of type `cls` once the app shows it (a worker pushes it from its thread)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not isinstance(pilot.app.screen, cls):
        assert loop.time() < end, f"no {cls.__name__} within {deadline_s} s (screen: {pilot.app.screen!r})"
        await pilot.pause(0.02)
    return pilot.app.screen


@pytest.mark.asyncio
class TestKeysAndModals:
    async def test_deploy_asks_a_valid_threshold_then_runs_with_progress(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            harness.push(item(T0, 0, 3))
            await pilot.pause()
            await pilot.press("d")
            modal = harness.app.screen
            assert isinstance(modal, ThresholdModal)
            field = modal.query_one(Input)
            assert field.value == "5"  # the threshold in force
            field.value = ""
            await pilot.press("minus", "3", "enter")
            await pilot.pause()
            assert isinstance(harness.app.screen, ThresholdModal)  # refused
            assert "threshold must be" in str(modal.query_one("#dialog-error").content)
            field.value = ""
            await pilot.press("1", "2", "enter")
            confirm = await screen_of(pilot, ConfirmModal)  # the deploy's own question, once it has planned
            assert "Deploy threshold 12 to glm5?" in str(confirm.query_one("#dialog-title").content)
            assert "12 is not a CUDA-graph batch size" in str(confirm.query_one("#dialog-prompt").content)
            assert harness.calls == []  # nothing runs before the operator commits
            await pilot.press("y")
            await harness.app.workers.wait_for_complete()
            await pilot.pause()
            assert harness.calls == [("glm5", "deploy", 12)]
            lines = log_text(harness.panel(ActionLog))
            assert any("▶ deploy threshold 12" in ln for ln in lines)
            assert any("▶ deploy step — first" in ln for ln in lines)
            assert any("✔ deploy step (0.2 s)" in ln or "✔ deploy step (0.3 s)" in ln for ln in lines)
            assert "deploy done" in lines[-1]
            assert harness.app.running == {}

    async def test_no_to_the_planned_deploy_changes_nothing(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            harness.push(item(T0, 0, 3))
            await pilot.pause()
            await pilot.press("d", "enter")
            await screen_of(pilot, ConfirmModal)
            await pilot.press("n")
            await harness.app.workers.wait_for_complete()
            await pilot.pause()
            assert harness.calls == [] and harness.app.running == {}
            assert "deploy cancelled on glm5: nothing was changed" in log_text(harness.panel(ActionLog))[-1]

    async def test_escape_cancels_the_threshold_dialog(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            await pilot.press("t")
            assert isinstance(harness.app.screen, ThresholdModal)
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(harness.app.screen, ThresholdModal) and harness.calls == []

    async def test_live_threshold_reports_the_value_read_back(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            harness.push(item(T0, 0, 3))
            await pilot.pause()
            await pilot.press("t")
            harness.app.screen.query_one(Input).value = "8"
            await pilot.press("enter")
            await harness.app.workers.wait_for_complete()
            await pilot.pause()
            assert harness.calls == [("glm5", "set_threshold", 8)]
            assert log_text(harness.panel(ActionLog))[-1].endswith("threshold 8 in force on glm5 (read back)")

    @pytest.mark.parametrize("key,action", [("r", "rollback"), ("s", "stop"), ("R", "restart"), ("b", "bench")])
    async def test_destructive_keys_confirm_first(self, harness: Harness, key: str, action: str) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            await pilot.press(key)
            assert isinstance(harness.app.screen, ConfirmModal)
            assert harness.app.screen.focused is not None and harness.app.screen.focused.id == "cancel"
            await pilot.press("n")
            await pilot.pause()
            assert harness.calls == []
            await pilot.press(key)
            await pilot.press("enter")  # Enter on the focused Cancel button cancels too
            await pilot.pause()
            assert harness.calls == []
            await pilot.press(key, "y")
            await harness.app.workers.wait_for_complete()
            await pilot.pause()
            assert harness.calls == [("glm5", action, None)]

    async def test_start_needs_no_confirmation(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            await pilot.press("S")
            await harness.app.workers.wait_for_complete()
            assert harness.calls == [("glm5", "start", None)]

    async def test_one_action_at_a_time_per_host(self) -> None:
        gate = threading.Event()
        h = Harness(["glm5"], gate=gate)
        async with h.app.run_test(size=(80, 24)) as pilot:
            await pilot.press("S")
            await pilot.pause()
            assert h.app.running == {"glm5": "start"}
            await pilot.press("d")
            assert not isinstance(h.app.screen, ThresholdModal)  # refused, with a notification
            gate.set()
            await h.app.workers.wait_for_complete()
            await pilot.pause()
            assert h.app.running == {} and [c[1] for c in h.calls] == ["start"]

    async def test_quit(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            await pilot.press("q")
            await pilot.pause()
        assert harness.app.return_code == 0
        assert harness.feed is not None and harness.feed.stopped

    async def test_quit_during_an_action_asks(self) -> None:
        gate = threading.Event()
        h = Harness(["glm5"], gate=gate)
        async with h.app.run_test(size=(80, 24)) as pilot:
            await pilot.press("S")
            await pilot.pause()
            await pilot.press("q")
            assert isinstance(h.app.screen, ConfirmModal)
            await pilot.press("n")
            assert h.app.is_running
            gate.set()
            await h.app.workers.wait_for_complete()


@pytest.mark.asyncio
class TestReadOnly:
    async def test_read_only_hides_and_disables_actions(self) -> None:
        h = Harness(["glm5"], read_only=True)
        async with h.app.run_test(size=(80, 24)) as pilot:
            h.push(item(T0, 0, 3))
            await pilot.pause()
            for key in ("d", "r", "t", "s", "S", "R", "b"):
                await pilot.press(key)
                await pilot.pause()
                assert not isinstance(h.app.screen, (ThresholdModal, ConfirmModal)), key
            assert h.calls == []
            shown = {b.binding.action for b in h.app.screen.active_bindings.values() if b.enabled and b.binding.show}
            assert shown == {"quit"}
            assert "[read-only]" in h.panel(HeaderBar).text()


@pytest.mark.asyncio
class TestHosts:
    async def test_switching_hosts_swaps_every_panel(self) -> None:
        h = Harness(["glm5", "demo"])
        async with h.app.run_test(size=(100, 30)) as pilot:
            h.push(item(T0, 0, 3, log=["[2026-11-29 11:00:00] glm5 line"]), "glm5")
            h.push(item(T0, 0, 9, threshold=4, pid=777, log=["[2026-11-29 11:00:00] demo line"]), "demo")
            await pilot.pause()
            assert "glm5" in h.panel(HeaderBar).text() and "SPECULATION ON" in h.panel(SpeculationPanel).text()
            assert "● glm5" in h.panel(HostsBar).text() and "● demo" in h.panel(HostsBar).text()
            await pilot.press("h")
            await pilot.pause()
            assert h.app.current == "demo"
            assert "pid 777" in h.panel(HeaderBar).text() and "SPECULATION OFF" in h.panel(SpeculationPanel).text()
            assert log_text(h.panel(LogTail))[-1].endswith("demo line")
            await pilot.press("tab")
            await pilot.pause()
            assert h.app.current == "glm5" and log_text(h.panel(LogTail))[-1].endswith("glm5 line")
            await pilot.press("shift+tab")
            assert h.app.current == "demo"

    async def test_actions_go_to_the_shown_host(self) -> None:
        h = Harness(["glm5", "demo"])
        async with h.app.run_test(size=(100, 30)) as pilot:
            await pilot.press("h", "S")
            await h.app.workers.wait_for_complete()
            assert h.calls == [("demo", "start", None)]

    async def test_a_single_host_hides_the_host_bar_and_key(self, harness: Harness) -> None:
        async with harness.app.run_test(size=(80, 24)) as pilot:
            await pilot.press("h")
            assert harness.app.current == "glm5"
            assert not harness.panel(HostsBar).display


def test_updates_of_the_same_host_replace_each_other() -> None:
    a = HostUpdated(HostSnapshot(host="a", time=1.0), None)  # type: ignore[arg-type]
    b = HostUpdated(HostSnapshot(host="b", time=1.0), None)  # type: ignore[arg-type]
    newer = HostUpdated(HostSnapshot(host="a", time=2.0), None)  # type: ignore[arg-type]
    assert newer.can_replace(a) and not newer.can_replace(b)


def test_every_event_reads_as_one_line_by_its_type() -> None:
    from dynctl.base import events
    from dynctl.bench import events as bench
    from dynctl.bench.plan import Mode
    from dynctl.tui.progress import describe

    assert describe(events.StepStarted("validate", "py_compile")) == ("info", "▶ validate — py_compile")
    assert describe(events.StepDone("validate", 1.234)) == ("ok", "✔ validate (1.2 s)")
    assert describe(events.StepDone("stop", 0.5, "pid 7 exited after 115 ms")) == (
        "ok", "✔ stop (0.5 s) — pid 7 exited after 115 ms")
    assert describe(events.LogLine("[x] compiling")) == ("log", "[x] compiling")
    assert describe(events.Note("release R in force")) == ("info", "release R in force")
    assert describe(events.Warning("tree drifted")) == ("warning", "⚠ tree drifted")
    assert describe(events.Failed("health", "503 for 900 s")) == ("error", "✘ 503 for 900 s")
    assert describe(events.Finished("deploy", "deployed", "release R on glm5", 3.21)) == (
        "ok", "deployed release R on glm5 (3.2 s)")
    assert describe(events.Unchanged("stop", "server on glm5 is already stopped")) == (
        "ok", "server on glm5 is already stopped")
    no_spec = Mode.no_spec()
    assert describe(bench.LevelStarted(no_spec, 4, 2, 7)) == ("info", "▶ no-spec c=4 — level 2/7")
    assert describe(bench.LevelProgress(no_spec, 4, "measure", 1.0, 0.5, 3, 0, 4.0)) is None  # ticks: too many
    level = {"max_concurrency": 4, "output_throughput": 512.3, "median_ttft_ms": 12.0,
             "server": {"spec_on_share": 0.0, "mean_batch_size": 4.0}}
    assert describe(bench.LevelDone(no_spec, level)) == (
        "info", "no-spec c=4: 512 tok/s, TTFT p50 12 ms, batch 4.0, speculation 0% of steps")
    assert describe(bench.ThresholdRestored(5)) == ("info", "threshold 5 put back")


@pytest.mark.parametrize("raw", [{"type": "final", "ok": True}, "done", {"stopped": True, "pid": 7}])
def test_what_is_not_an_event_is_refused_not_printed(raw) -> None:
    """The panel once printed `stop done: {'stopped': True, ...}`: untyped values have no line of their own."""
    from dynctl.tui.progress import describe

    with pytest.raises(TypeError, match="not a progress event"):
        describe(raw)
