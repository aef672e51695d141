"""build_snapshot and HostHistory as pure functions of `watch` items (no processes, no terminal)."""

from __future__ import annotations

from dynctl.live.snapshot import HostHistory, Switch, build_snapshot, disconnected, latest_switch
from dynctl.tui.chart import nice_ceiling, render_chart
from watch_items import item, transition_line

T0 = 1_795_950_000.0


def test_same_second_switches_keep_log_order() -> None:
    # log stamps have 1 s resolution: off then on within one second must end ON
    raw = item(T0, 0, 4, spec=True, marks=[transition_line(T0, False, 12, 5), transition_line(T0, True, 5, 5)])
    snap = build_snapshot(raw, "h")
    assert snap.last_switch == Switch(T0, True, 5, 5)
    assert latest_switch([Switch(1.0, False), Switch(1.0, True)]) == Switch(1.0, True)


def test_gauge_only_change_is_a_switch_at_the_sample_time() -> None:
    first = build_snapshot(item(T0, 0, 3), "h")
    second = build_snapshot(item(T0 + 1, 1, 9), "h", first)  # no log line came (say, the tail was cut)
    assert second.speculation is False and second.switches == (Switch(T0 + 1, False, source="gauge"),)


def test_the_log_line_of_a_flip_the_gauge_showed_first_takes_its_place() -> None:
    # the sample at T0+2 sees the gauge OFF; the log's line of that step (stamped T0+1) comes one sample later
    h = HostHistory("h")
    first = build_snapshot(item(T0, 0, 3), "h")
    gauge = build_snapshot(item(T0 + 2, 1, 9), "h", first)
    logged = build_snapshot(item(T0 + 3, 2, 9, marks=[transition_line(T0 + 1, False, 9, 5)]), "h", gauge)
    later = build_snapshot(item(T0 + 4, 3, 9), "h", logged)
    for snap in (first, gauge, logged, later):
        h.add(snap)
    assert gauge.last_switch == Switch(T0 + 2, False, source="gauge")
    assert logged.last_switch == later.last_switch == Switch(T0 + 1, False, 9, 5)
    assert h.switches() == [Switch(T0 + 1, False, 9, 5)]  # one mark on the chart, not two
    # an older line of the other way does not displace a newer flip the gauge showed
    back = build_snapshot(item(T0 + 5, 4, 3), "h", later)
    stale = build_snapshot(item(T0 + 6, 5, 3, marks=[transition_line(T0 + 1, False, 9, 5)]), "h", back)
    assert stale.last_switch == back.last_switch == Switch(T0 + 5, True, source="gauge")


def test_a_gauge_catching_up_with_a_line_already_read_keeps_the_lines_switch() -> None:
    # the agent reads /metrics, then the log: the step at T0+1 flipped OFF in between, so the sample at T0+1
    # has the gauge still ON beside the line, and the next one the gauge OFF with no line
    h = HostHistory("h")
    first = build_snapshot(item(T0, 0, 3), "h")
    logged = build_snapshot(item(T0 + 1, 1, 9, spec=True, marks=[transition_line(T0 + 1, False, 9, 5)]), "h", first)
    caught_up = build_snapshot(item(T0 + 2, 2, 9), "h", logged)
    for snap in (first, logged, caught_up):
        h.add(snap)
    assert logged.speculation is False and logged.readings["speculation"].source == "log"
    assert caught_up.speculation is False and caught_up.readings["speculation"].source == "metrics"
    assert logged.last_switch == caught_up.last_switch == Switch(T0 + 1, False, 9, 5)
    assert h.switches() == [Switch(T0 + 1, False, 9, 5)]
    # a log whose new bytes were skipped may lack a later flip: then the gauge is the better word
    cut = item(T0 + 3, 3, 3, spec=True, marks=[transition_line(T0 + 1, False, 9, 5)])
    cut["log"]["skipped_bytes"] = 2 << 20
    assert build_snapshot(cut, "h", caught_up).speculation is True


def test_a_restarted_server_forgets_its_drain_and_warnings() -> None:
    warn = ("[2026-11-29 11:00:00 TP0] speculative_disable_batch_threshold=5 is not armed: DP attention is "
            "enabled (batch sizes differ). Speculation is never disabled.")
    a = build_snapshot(item(T0, 0, 3, marks=[warn], started=T0 - 10), "h")
    assert a.spec_warning == "threshold 5 is not armed: DP attention is enabled (batch sizes differ)"
    drain = "[2026-11-29 11:00:05] SIGTERM received. signum=None frame=None. Draining requests and shutting down..."
    b = build_snapshot(item(T0 + 5, 1, 3, marks=[drain]), "h", a)
    assert b.state == "draining"
    c = build_snapshot(item(T0 + 30, 0, 0, pid=5151, started=T0 + 20), "h", b)  # new pid: a new run
    assert c.state == "ready" and c.spec_warning is None


def test_unresponsive_versus_starting() -> None:
    up = build_snapshot(item(T0, 0, 3), "h")
    hung = build_snapshot(item(T0 + 1, 1, 3, http=False), "h", up)
    assert hung.state == "unresponsive" and hung.running_reqs is None
    fresh = build_snapshot(item(T0, 0, 0, http=False), "h")
    assert fresh.state == "starting"


def test_disconnected_keeps_values_and_first_since() -> None:
    live = build_snapshot(item(T0, 0, 3), "h")
    d1 = disconnected("h", T0 + 5, "reset", live, retry_at=T0 + 6)
    d2 = disconnected("h", T0 + 9, "refused", d1, retry_at=T0 + 11)
    assert (d2.connected, d2.disconnected_since, d2.error, d2.running_reqs) == (False, T0 + 5, "refused", 3)


def test_history_trims_dedupes_and_tails() -> None:
    h = HostHistory("h", window_s=60, log_lines=5)
    prev = None
    for i in range(100):
        marks = [transition_line(T0 + 10, False, 7, 5)] if i in (10, 11) else []  # a reconnect re-sends a mark
        prev = build_snapshot(item(T0 + i, i if i != 50 else 0, 3, log=[f"line {i}"], marks=marks), "h", prev)
        h.add(prev)
    points = h.points()
    assert points[0].time == T0 + 39 and points[-1].time == T0 + 99  # the last 60 s
    assert h.switches() == []  # the one switch at T0+10 left the window
    assert h.log_tail() == [f"line {i}" for i in range(95, 100)]
    lines, mark, reset = h.log_since(None)
    assert reset and lines == h.log_tail()
    h.add(build_snapshot(item(T0 + 100, 101, 3, log=["new"]), "h", prev))
    assert h.log_since(mark) == (["new"], (mark[0], mark[1] + 1), False)
    h.add(disconnected("h", T0 + 101, "gone", h.latest))
    assert h.latest is not None and not h.latest.connected and h.last_live is not None and h.last_live.connected


def test_chart_scales_and_marks() -> None:
    assert [nice_ceiling(v) for v in (0, 0.7, 9, 11, 1176, 4300)] == [1.0, 0.8, 10.0, 12.0, 1200.0, 5000.0]
    h = HostHistory("h")
    prev = None
    for i in range(60):
        marks = [transition_line(T0 + 30, False, 9, 5)] if i == 30 else []
        prev = build_snapshot(item(T0 + i, i, 3 if i < 30 else 9, marks=marks), "h", prev)
        h.add(prev)
    text = render_chart(h.points(), h.switches(), 40, 6, now=T0 + 59, window_s=60).plain.splitlines()
    assert len(text) == 6 and text[0].startswith("800 ┤") and text[-1].count("▼") == 1
    assert text[-1].index("▼") in range(len(text[-1]) // 2 - 2, len(text[-1]) // 2 + 4)  # half way along


def test_a_live_change_on_an_idle_server_shows_the_read_back_not_the_stale_gauge() -> None:
    # the patch writes its gauge on decode steps only: after `dynctl threshold 5` on an idle server the gauge
    # still says -1 while /server_info already says 5
    raw = item(T0, 0, 0, threshold=-1)
    raw["server_info"]["data"]["internal_state"]["speculative_disable_batch_threshold"] = 5
    assert build_snapshot(raw, "h").threshold == 5


def test_an_idle_server_shows_what_its_threshold_gives_the_next_request_and_says_so() -> None:
    # the gauge keeps the burst's OFF; idle, a batch of one speculates at threshold 5, from the threshold
    busy = build_snapshot(item(T0, 0, 9, loads=(9, 0)), "h")
    idle = build_snapshot(item(T0 + 1, 1, 0, spec=False, loads=(0, 0)), "h", busy)
    assert idle.idle and idle.speculation is True
    assert idle.readings["speculation"].source == "threshold"
    assert idle.readings["speculation"].age_s == idle.readings["threshold"].age_s
    assert busy.readings["speculation"].source == "metrics"  # a running server's value is the gauge's


def test_a_new_server_run_does_not_carry_the_last_runs_switch() -> None:
    # the old run switched OFF at batch 9; the new one (pid 5151, up 10 s) has logged no switch yet
    old = build_snapshot(item(T0, 0, 9, marks=[transition_line(T0, False, 9, 5)]), "h")
    new = build_snapshot(item(T0 + 60, 0, 3, pid=5151, started=T0 + 50), "h", old)
    assert new.speculation is True and new.last_switch is None


def test_a_native_flip_seen_in_its_gauge_is_not_labelled_as_read_from_the_log() -> None:
    def native(t: float, seq: int, steps: int) -> dict:
        raw = item(t, seq, 9, threshold=None, release={"id": "r", "strategy": "native"})
        raw["metrics"]["text"] += f"# TYPE sglang:spec_num_steps gauge\nsglang:spec_num_steps {steps}\n"
        return raw
    on = build_snapshot(native(T0, 0, 3), "h")
    off = build_snapshot(native(T0 + 1, 1, 0), "h", on)
    assert off.speculation is False and off.switches == (Switch(T0 + 1, False, source="gauge"),)
    assert off.readings["speculation"].source == on.readings["speculation"].source != "log"


def test_a_threshold_kept_from_the_gauge_keeps_the_gauge_as_its_source() -> None:
    # /server_info never answered in this run; the gauge gave 5, then /metrics stopped answering too
    first = build_snapshot(item(T0, 0, 3, server_info=False), "h")
    hung_raw = item(T0 + 1, 1, 3, server_info=False)
    hung_raw["metrics"] = {"ok": False, "error": "timed out"}
    hung = build_snapshot(hung_raw, "h", first)
    assert first.readings["threshold"].source == "metrics"
    assert hung.threshold == 5 and hung.readings["threshold"].source == "metrics"


def test_a_disconnected_hosts_readings_age_with_the_disconnection() -> None:
    live = build_snapshot(item(T0, 0, 3, loads=(3, 0)), "h")
    gone = disconnected("h", T0 + 30, "reset", live)
    assert live.readings["running_reqs"].age_s == 0.0
    assert gone.readings["running_reqs"].age_s == 30.0 and gone.readings["running_reqs"].stale
    assert gone.readings["threshold"].age_s == 30.0
