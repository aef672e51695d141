"""The agent's streaming `watch` verb through a Local AgentClient, against a real HTTP server on 127.0.0.1
serving sglang-format /metrics and /server_info, a server log being appended, and a pidfile."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from dynctl.agent.client import AgentClient, AgentError
from dynctl.base.config import HostConfig
from dynctl.live.snapshot import build_snapshot
from dynctl.transport.local import Local
from watch_items import decode_line, log_stamp, transition_line
from lifecycle_harness import wait_for
from polling import finishes
from watch_server import SglangLikeServer, install_fake_nvidia_smi, path_with, record_as_server

pytestmark = pytest.mark.slow


def first(stream: Iterator[dict[str, Any]], check: Callable[[dict[str, Any]], Any], timeout: float = 10.0,
          what: str = "item") -> dict[str, Any]:
    """The first item of a live stream that passes `check` (items come every interval, so the deadline holds)."""
    deadline = time.monotonic() + timeout
    for item in stream:
        if check(item):
            return item
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no {what} within {timeout} s")




@pytest.fixture
def server() -> Iterator[SglangLikeServer]:
    with SglangLikeServer() as s:
        yield s


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    wd = tmp_path / "work"
    wd.mkdir()
    return wd


def client(workdir: Path, port: int, env: dict[str, str] | None = None) -> AgentClient:
    host = HostConfig(name="box", python=sys.executable, workdir=str(workdir), port=port, env=env or {})
    agent = AgentClient(Local(), host)
    # Upload first: Local's open_stream can raise BrokenPipeError when the boot stub exits 97 (agent
    # missing) before it reads the request (seen under CPU load; reported). These tests are about watch.
    agent.upload()
    return agent


def append(path: Path, *lines: str) -> None:
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))


def test_first_item_has_metrics_info_process_and_log_backlog(server: SglangLikeServer, workdir: Path) -> None:
    record_as_server(workdir)  # this process serves the HTTP, as if `dynctl start` had started it
    old = [decode_line(time.time() - 60 + i, 2, 190.0) for i in range(30)]
    switch = transition_line(time.time() - 5, False, 7, 5)
    append(workdir / "server.log", *old, switch)
    stream = client(workdir, server.port, env={"PATH": "/nonexistent"}).stream(
        "watch", interval=0.2, log_lines=10, max_items=1)
    item = next(stream)
    assert item["ok"] is True and item["seq"] == 0
    assert item["process"]["pid"] == os.getpid() and item["process"]["alive"] is True
    assert item["process"]["source"] == "pidfile"
    assert abs(item["process"]["started"] - psutil.Process().create_time()) < 1.5
    text = item["metrics"]["text"]
    assert "sglang:num_running_reqs{" in text and "sglang:spec_enabled{" in text
    assert "_bucket" not in text and "python_gc" not in text and "# HELP" not in text  # trimmed on the host
    assert "sglang:time_to_first_token_seconds_count" in text
    info = item["server_info"]["data"]
    assert info["version"] == "0.5.9" and info["speculative_algorithm"] == "EAGLE3"
    assert info["internal_state"]["speculative_disable_batch_threshold"] == 5
    assert "huge_unrelated_field" not in info and "memory_usage" not in info["internal_state"]
    log = item["log"]
    assert len(log["lines"]) == 10 and log["dropped"] == 21  # the backlog is capped at log_lines
    assert log["marks"] == [switch]  # marks come from the whole backlog scan, not only the lines sent
    assert log["decode"] == old[-1]
    assert item["gpus"] == {"ok": False, "error": "nvidia-smi not found on the server's PATH"}
    assert item["utc_offset"] == time.localtime().tm_gmtoff
    assert list(stream) == []  # max_items=1: the agent says done and the stream ends cleanly


def test_a_change_on_the_server_reaches_the_stream_and_the_snapshot(server: SglangLikeServer, workdir: Path) -> None:
    record_as_server(workdir)
    log = workdir / "server.log"
    log.write_text("")
    stream = client(workdir, server.port).stream("watch", interval=0.2, log_lines=50)
    snap = None
    try:
        item = next(stream)
        snap = build_snapshot(item, "box")
        assert snap.state == "ready" and snap.speculation is True and snap.running_reqs == 2
        assert snap.threshold == 5 and snap.sglang_version == "0.5.9" and snap.strategy == "patch"
        # load rises above the threshold: the server flips its gauge and logs the transition
        server.state.update(running=7, spec=False, tps=490.0)
        t_switch = time.time()
        append(log, transition_line(t_switch, False, 7, 5), decode_line(t_switch, 7, 490.0))
        changed = time.time()  # from here on, every sample the agent starts must see it
        deadline = time.monotonic() + 60
        for item in stream:
            snap = build_snapshot(item, "box", snap)
            if snap.speculation is False and snap.log_lines:
                break
            assert item["t"] < changed, "a sample taken after the change missed it"
            assert time.monotonic() < deadline, "the change never arrived"
        assert snap.running_reqs == 7 and snap.gen_throughput == pytest.approx(490.0)
        assert snap.last_switch is not None and snap.last_switch.enabled is False
        assert snap.last_switch.batch_size == 7 and abs(snap.last_switch.time - int(t_switch)) < 1.01
        assert any("Speculation disabled" in line for line in snap.log_lines)
    finally:
        stream.close()


def test_a_listener_that_is_not_an_sglang_launch_is_named_never_called_the_server(
        server: SglangLikeServer, workdir: Path) -> None:
    """Without our pidfile, a listener counts as the server only when it runs sglang's (or the configured)
    launcher, as `dynctl stop` and `deploy` decide; this one (pytest) is foreign, and its HTTP is not read."""
    before = len(server.requests)
    item = next(client(workdir, server.port).stream("watch", interval=0.2, max_items=1))
    assert item["process"]["pid"] is None and item["process"]["source"] is None
    assert item["process"]["not_ours"]["kind"] == "foreign" and item["process"]["not_ours"]["pid"] == os.getpid()
    assert f"port {server.port} is held by pid {os.getpid()}" in item["process"]["not_ours"]["text"]
    assert len(server.requests) == before  # not ours: no /metrics, no /server_info
    snap = build_snapshot(item, "box")
    assert snap.state == "down" and snap.pid is None and snap.threshold is None
    assert snap.not_ours and f"pid {os.getpid()}" in snap.not_ours


def test_nothing_there_is_down_not_an_error(workdir: Path) -> None:
    free_port = 1  # nothing listens on port 1 here, and nobody may
    item = next(client(workdir, free_port).stream("watch", interval=0.2, max_items=1))
    assert item["process"] == {"pid": None, "alive": False, "source": None}
    assert item["metrics"]["ok"] is False and item["metrics"]["error"]
    assert item["log"]["error"].startswith(str(workdir / "server.log"))
    snap = build_snapshot(item, "box")
    assert snap.state == "down" and snap.running_reqs is None and snap.speculation is None


def test_metrics_off_still_counts_as_answering(server: SglangLikeServer, workdir: Path) -> None:
    server.state["metrics_status"] = 404  # a server started without --enable-metrics
    record_as_server(workdir)
    item = next(client(workdir, server.port).stream("watch", interval=0.2, max_items=1))
    assert item["metrics"] == {"ok": False, "error": "HTTP 404"}
    assert build_snapshot(item, "box").state == "ready"


def test_a_hung_server_never_blocks_the_stream(server: SglangLikeServer, workdir: Path) -> None:
    server.state["metrics_delay"] = 600.0  # blocked on the server, four samples would take 40 minutes
    record_as_server(workdir)
    stream = client(workdir, server.port).stream("watch", interval=0.3, max_items=4)
    items = finishes(lambda: list(stream), 120, "four samples of a server that never answers /metrics")
    assert [item["metrics"] for item in items] == [{"ok": False, "error": "timed out"}] * 4


def test_a_slow_server_info_is_asked_again_and_a_status_waits_for_its_first_answer(server: SglangLikeServer,
                                                                                    workdir: Path) -> None:
    record_as_server(workdir)
    server.info_answers.clear()  # held: no answer comes within any sample
    items = list(client(workdir, server.port).stream("watch", interval=0.3, max_items=3, gpus=False))
    server.info_answers.set()
    # not answered within its sample: asked again at the next one, not info_every (5 s) later
    assert [item["server_info"] for item in items] == [{"ok": False, "error": "timed out"}] * 3
    server.state["info_delay"] = 0.6  # answers, later than a 0.3 s sample's budget
    items = list(client(workdir, server.port).stream("watch", interval=0.3, max_items=3, gpus=False,
                                                     info_timeout=3))
    assert items[0]["server_info"]["ok"]
    assert items[0]["server_info"]["data"]["internal_state"]["speculative_disable_batch_threshold"] == 5
    assert "server_info" not in items[1] and "server_info" not in items[2]  # answered: due again in 5 s


def test_log_truncation_and_floods(server: SglangLikeServer, workdir: Path) -> None:
    log = workdir / "server.log"
    append(log, "[2026-01-01 00:00:00] old run")
    stream = client(workdir, server.port).stream("watch", interval=0.15, log_lines=20)
    try:
        assert next(stream)["log"]["lines"] == ["[2026-01-01 00:00:00] old run"]
        log.write_text("")  # a new server run truncates its log
        append(log, "[2026-01-01 00:01:00] new run")
        resets = []  # a sample between the truncation and the new line says reset with no lines yet

        def new_run(item: dict[str, Any]) -> bool:
            resets.append(item["log"]["reset"])
            return bool(item["log"]["lines"])

        item = first(stream, new_run, what="the new run's line")
        assert True in resets and item["log"]["lines"] == ["[2026-01-01 00:01:00] new run"]
        stamp = log_stamp(time.time())
        flood = [f"[{stamp}] line {n}" for n in range(3000)]
        append(log, *flood[:1500], transition_line(time.time(), True, 3, 5), *flood[1500:])
        got = first(stream, lambda i: i["log"]["lines"], what="flood")
        assert got["log"]["lines"] == flood[-20:]
        assert got["log"]["dropped"] == 3001 - 20
        assert len(got["log"]["marks"]) == 1 and "Speculation enabled" in got["log"]["marks"][0]
    finally:
        stream.close()


def test_partial_lines_wait_for_their_newline(server: SglangLikeServer, workdir: Path) -> None:
    log = workdir / "server.log"
    log.write_text("")
    stream = client(workdir, server.port).stream("watch", interval=0.15)
    try:
        next(stream)
        with open(log, "a") as f:
            f.write("[2026-01-01 00:00:00] half a li")
            f.flush()
            assert next(stream)["log"]["lines"] == []
            f.write("ne\n")
        line = first(stream, lambda i: i["log"]["lines"], what="line")["log"]["lines"]
        assert line == ["[2026-01-01 00:00:00] half a line"]
    finally:
        stream.close()


def test_gpus_from_one_long_lived_nvidia_smi_and_clean_exit(server: SglangLikeServer, workdir: Path,
                                                            tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    state = install_fake_nvidia_smi(bindir, [{"util": 10, "used": 1000}, {"util": 20, "used": 2000}])
    stream = client(workdir, server.port, env={"PATH": path_with(bindir)}).stream("watch", interval=0.2)
    csv = first(stream, lambda i: i["gpus"]["ok"], what="GPU rows")["gpus"]["csv"]
    assert csv.splitlines()[0].startswith("0, GPU-") and csv.count("\n") == 2
    snap = build_snapshot(next(stream), "box")
    assert [(g.index, g.util_pct, g.mem_used_mib) for g in snap.gpus] == [(0, 10.0, 1000.0), (1, 20.0, 2000.0)]
    tmp = state.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"util": 99, "used": 5000}, {"util": 98, "used": 6000}]))
    os.replace(tmp, state)
    first(stream, lambda i: i["gpus"].get("csv", "").startswith("0, GPU-00000000-0000, NVIDIA H200, 99"),
          what="new GPU values")
    smi_pid, agent_pid = map(int, Path(str(state) + ".pid").read_text().split())
    assert psutil.Process(smi_pid).is_running()
    assert sum(1 for p in psutil.Process(agent_pid).children() if p.pid == smi_pid) == 1  # one, not one per sample
    stream.close()  # the client goes away: the agent stops its nvidia-smi and exits
    wait_for(lambda: not psutil.pid_exists(smi_pid) or psutil.Process(smi_pid).status() == psutil.STATUS_ZOMBIE,
             what="nvidia-smi to end")
    wait_for(lambda: not psutil.pid_exists(agent_pid) or psutil.Process(agent_pid).status() == psutil.STATUS_ZOMBIE,
             what="the agent to end")


def test_the_first_sample_has_the_gpus_without_waiting_for_nvidia_smis_next_period(
        server: SglangLikeServer, workdir: Path, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    install_fake_nvidia_smi(bindir, [{"util": 10, "used": 1000}, {"util": 20, "used": 2000}])
    # nvidia-smi's period is the interval: a first block read only when the second starts would miss item 0
    items = list(client(workdir, server.port, env={"PATH": path_with(bindir)}).stream("watch", interval=5.0,
                                                                                   max_items=1))
    assert items[0]["gpus"]["ok"], items[0]["gpus"]
    snap = build_snapshot(items[0], "box")
    assert [(g.index, g.util_pct, g.mem_used_mib) for g in snap.gpus] == [(0, 10.0, 1000.0), (1, 20.0, 2000.0)]


def test_bad_parameters_are_usage_errors(workdir: Path) -> None:
    with pytest.raises(AgentError, match="watch: interval must be between") as err:
        list(client(workdir, 1).stream("watch", interval=0))
    assert err.value.kind == "usage" and err.value.exit_code == 2
    with pytest.raises(AgentError, match="log_lines must be a number"):
        list(client(workdir, 1).stream("watch", log_lines="lots"))
    with pytest.raises(AgentError, match="watch: info_timeout must be between 0.05 and 60"):
        list(client(workdir, 1).stream("watch", info_timeout=600))


@pytest.mark.gpu
def test_real_nvidia_smi(server: SglangLikeServer, workdir: Path) -> None:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi on this machine (runs on GPU hosts)")
    stream = client(workdir, server.port).stream("watch", interval=0.5)
    try:
        item = first(stream, lambda i: i["gpus"]["ok"], timeout=15, what="real GPU rows")
        gpus = build_snapshot(item, "box").gpus
        assert gpus and all(g.mem_total_mib and g.mem_total_mib > 1000 for g in gpus)
        assert [g.index for g in gpus] == list(range(len(gpus)))
    finally:
        stream.close()


def test_lifecycle_record_release_and_drain(server: SglangLikeServer, workdir: Path) -> None:
    record = record_as_server(workdir, release="0002-20261129T120000Z")
    (workdir / "current").write_text("0002-20261129T120000Z\n")
    rel = workdir / "releases" / "0002-20261129T120000Z"
    rel.mkdir(parents=True)
    (rel / "manifest.json").write_text(json.dumps({"id": rel.name, "strategy": "patch", "threshold": 5,
                                                   "sglang_version": "0.5.9", "state": "applied"}))
    item = next(client(workdir, server.port).stream("watch", interval=0.2, max_items=1))
    assert item["process"]["source"] == "pidfile" and not item["process"]["stopping"]
    assert item["release"]["id"] == rel.name and item["release"]["strategy"] == "patch"
    snap = build_snapshot(item, "box")
    assert (snap.state, snap.release, snap.strategy) == ("ready", rel.name, "patch")
    # `dynctl stop` marks the record before it sends SIGTERM: the server is draining
    (workdir / "server.json").write_text(json.dumps(dict(record, stopping="2026-11-29T12:00:00Z")))
    item = next(client(workdir, server.port).stream("watch", interval=0.2, max_items=1))
    assert build_snapshot(item, "box", snap).state == "draining"
    # a record whose pid was recycled is not believed, and the listener (pytest, no sglang launch) is not ours
    (workdir / "server.json").write_text(json.dumps(dict(record, pid_start=record["pid_start"] + 1)))
    item = next(client(workdir, server.port).stream("watch", interval=0.2, max_items=1))
    assert item["process"]["pid"] is None and item["process"]["not_ours"]["kind"] == "foreign"
    assert build_snapshot(item, "box", snap).state == "down"


def test_sigterm_drain_in_the_log_is_draining(server: SglangLikeServer, workdir: Path) -> None:
    record_as_server(workdir)
    log = workdir / "server.log"
    log.write_text("")
    stream = client(workdir, server.port).stream("watch", interval=0.15)
    try:
        snap = build_snapshot(next(stream), "box")
        assert snap.state == "ready"
        # sglang 0.5.9 tokenizer_manager.py:2502 (logged by the main process, no rank prefix)
        append(log, f"[{log_stamp(time.time())}] SIGTERM received. signum=None frame=None. "
                    "Draining requests and shutting down...")
        item = first(stream, lambda i: i["log"]["marks"], what="drain mark")
        assert build_snapshot(item, "box", snap).state == "draining"
    finally:
        stream.close()


def test_live_loads_beat_stale_gauges_and_idle_means_the_next_request(server: SglangLikeServer,
                                                                      workdir: Path) -> None:
    record_as_server(workdir)
    # a burst of 12 was aborted at once: the gauges still say 12 running and speculation off
    server.state.update(running=12, spec=False, loads=(12, 0))
    stream = client(workdir, server.port).stream("watch", interval=0.15)
    try:
        snap = build_snapshot(next(stream), "box")
        assert (snap.running_reqs, snap.speculation, snap.idle) == (12, False, False)
        server.state["loads"] = (0, 0)  # the scheduler is empty; the gauges are not rewritten until 30 s idle
        item = first(stream, lambda i: i.get("loads", {}).get("loads", [{}])[0].get("num_running_reqs") == 0,
                     what="idle loads")
        snap = build_snapshot(item, "box", snap)
        assert snap.running_reqs == 0 and snap.idle and snap.speculation is True  # a batch of one speculates
        assert snap.switches == ()  # going idle is not a switch
    finally:
        stream.close()
    server.state["loads"] = None  # sglang < 0.5.8: the agent asks once, then only every minute
    stream = client(workdir, server.port).stream("watch", interval=0.1, max_items=5)
    before = server.requests.count("/v1/loads?include=core")
    items = list(stream)
    assert server.requests.count("/v1/loads?include=core") - before == 1
    assert build_snapshot(items[-1], "box").running_reqs == 12
