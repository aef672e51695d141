"""Live means live: tok/s is the rate of sglang:generation_tokens_total over the sampling window, and every
number says where it came from and how old it is, so a gauge that stopped moving is shown as stale.

The watch items here are the agent's exact shape (tests/watch_items.py) with sglang's counter added; the last
test runs the simulator, whose gen_throughput gauge, like sglang's, keeps its last value once load stops.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from demo_box import dynctl, session
from dynctl.base.parsers.prometheus import read_server_metrics
from dynctl.live.snapshot import RATE_WINDOW_S, STALE_AFTER_S, build_snapshot
from polling import wait_for
from watch_items import LABELS, decode_line, item

T0 = 1_780_000_000.0
RATE = 480.0  # tokens per second while the load runs
LOAD_ENDS = 10


def sample(i: int, loads: bool = False) -> dict:
    """Second i of a run whose load stops at LOAD_ENDS: the counter stops, the gauge keeps saying 480."""
    t = T0 + i
    busy = i < LOAD_ENDS
    out = item(t, i, 8, tps=RATE, log=[decode_line(t, 8, RATE)] if busy else [],
               loads=((8 if busy else 0), 0) if loads else None)
    if busy:
        out["log"]["decode"] = decode_line(t, 8, RATE)
    tokens = RATE * min(i, LOAD_ENDS)
    out["metrics"]["text"] += ("# TYPE sglang:generation_tokens_total counter\n"
                               f"sglang:generation_tokens_total{{{LABELS.format(tp=0)}}} {tokens}\n")
    return out


def run(n: int, loads: bool = False) -> list:
    snaps, prev = [], None
    for i in range(n):
        prev = build_snapshot(sample(i, loads), "box", prev)
        snaps.append(prev)
    return snaps


def test_tok_s_is_the_counters_rate_and_falls_to_zero_within_one_window_after_load_stops():
    snaps = run(LOAD_ENDS + int(RATE_WINDOW_S) + 12)
    busy = snaps[LOAD_ENDS - 1]
    assert busy.gen_throughput == pytest.approx(RATE) and busy.readings["gen_throughput"].source == "counter"
    assert not busy.readings["running_reqs"].stale
    settled = snaps[LOAD_ENDS + int(RATE_WINDOW_S)]
    assert settled.gen_throughput == 0.0 and settled.readings["gen_throughput"].source == "counter"
    # the gauge still says 8 running: it is shown with its age, and as stale once older than STALE_AFTER_S
    last = snaps[-1]
    assert last.running_reqs == 8 and last.readings["running_reqs"].source == "metrics"
    assert last.readings["running_reqs"].age_s > STALE_AFTER_S and last.readings["running_reqs"].stale
    # every live number says where it came from
    assert {"running_reqs", "queue_reqs", "gen_throughput", "token_usage", "accept_length", "speculation",
            "threshold"} <= set(last.readings)
    assert last.readings["threshold"].source == "/server_info" and last.readings["speculation"].source == "metrics"


def test_running_and_queue_come_from_v1_loads_when_it_answers():
    last = run(LOAD_ENDS + 15, loads=True)[-1]
    assert (last.running_reqs, last.queue_reqs) == (0, 0)
    assert last.readings["running_reqs"].to_dict() == {"source": "/v1/loads", "age_s": 0.0, "stale": False}


def test_a_restarted_server_starts_a_new_window():
    snaps, prev = [], None
    for i in range(4):
        raw = sample(i)
        if i >= 2:  # a new server run: a new pid, its counter back near zero
            raw["process"]["pid"] = 5151
            raw["metrics"]["text"] = raw["metrics"]["text"].replace(f"}} {RATE * i}\n", "} 3.0\n")
        prev = build_snapshot(raw, "box", prev)
        snaps.append(prev)
    assert snaps[2].readings["gen_throughput"].source == "metrics"  # one reading of the new run: no rate yet
    assert snaps[2].gen_throughput == RATE and snaps[3].gen_throughput == 0.0


def status(config) -> dict:
    res = dynctl("status", "--json", config=config)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)["server"]


@pytest.mark.slow
def test_on_the_simulator_idle_tok_s_is_zero_while_the_gauge_keeps_its_last_value_and_restart_says_threshold(
        demo_box):
    config = demo_box(via="local")
    port = session(config).host.port
    res = dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
    assert res.returncode == 0, res.stdout + res.stderr

    def load() -> None:
        with httpx.Client(timeout=60) as client:
            client.post(f"http://127.0.0.1:{port}/generate",
                        json={"text": "The capital city of France is", "sampling_params": {"max_new_tokens": 300}})

    workers = [threading.Thread(target=load) for _ in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    gauge = read_server_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text).gen_throughput
    assert gauge and gauge > 0  # the simulator, like sglang, leaves its last value in the gauge
    now = status(config)
    assert now["gen_throughput"] == 0.0 and now["sources"]["gen_throughput"]["source"] == "counter"

    def truthful_batch() -> bool:  # live from /v1/loads, or the gauge's last word shown as stale
        running = status(config)["sources"]["running_reqs"]
        return running["source"] == "/v1/loads" or running["stale"]

    wait_for(truthful_batch, 60, what="the running-requests gauge to be shown as stale")
    if status(config)["sources"]["running_reqs"]["stale"]:  # read from the gauge: the text says so
        assert "STALE" in dynctl("status", config=config).stdout

    assert dynctl("threshold", "7", "--yes", config=config).returncode == 0
    wait_for(lambda: status(config)["threshold"] == 7, 30, what="the live threshold 7")
    text = dynctl("status", config=config).stdout
    assert "differs from release" in " ".join(text.split())
    res = dynctl("restart", "--yes", config=config)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "goes back to the launch's 5" in " ".join((res.stdout + res.stderr).split())
    assert status(config)["threshold"] == 5

    assert dynctl("threshold", "7", "--yes", config=config).returncode == 0
    res = dynctl("restart", "--yes", "--keep-live-threshold", config=config)
    assert res.returncode == 0, res.stdout + res.stderr
    after = status(config)
    assert (after["threshold"], after["release_threshold"]) == (7, 5)
