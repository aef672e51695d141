"""`dynctl bench` end to end against the tiny streaming server: bad input, unreachable, errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import typer
from polling import wait_for
from test_bench_server import TokenServer
from typer.testing import CliRunner
from watch_server import record_as_server

from dynctl.cli import bench as bench_cli

# A terminal's foreground process gets SIGINT as KeyboardInterrupt; a test runner started in the background
# (nohup, `&`) hands its children SIGINT ignored, so the launcher puts Python's own handler back.
LAUNCHER = (
    "import signal, sys, typer\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "from dynctl.cli import bench\n"
    "app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)\n"
    "@app.callback()\n"
    "def _root(): pass\n"
    "bench.register(app)\n"
    "app(prog_name='dynctl')\n"
)


def make_app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        pass

    bench_cli.register(app)
    return app


def write_config(tmp_path: Path, port: int, *, launch: list[str] | None = None, serves_here: bool = False) -> Path:
    """A host `tiny` on this machine. The server on `port` must be ours for bench to switch its threshold:
    `launch` names the command it was started with (a simulator), `serves_here` records this process
    (which serves a test server's HTTP) as if `dynctl start` had started it."""
    path = tmp_path / "dynctl.toml"
    text = ('default_host = "tiny"\n[hosts.tiny]\n'
            f"port = {port}\npython = {json.dumps(sys.executable)}\nworkdir = {json.dumps(str(tmp_path / 'work'))}\n")
    if launch is not None:
        text += f"launch = {json.dumps(launch)}\n"
    path.write_text(text)
    if serves_here:
        (tmp_path / "work").mkdir(exist_ok=True)
        record_as_server(tmp_path / "work")
    return path


@pytest.fixture
def server():
    s = TokenServer(interval=0.005).start()
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("args, fragment", [
    (["--concurrency", "0"], "item 1 '0'"),
    (["--concurrency", "1,,4"], "item 2 is empty"),
    (["--concurrency", "abc"], "'abc' is not a positive integer"),
    (["--goodput", "ttft:x"], "--goodput 'ttft:x'"),
    (["--duration", "5", "--num-prompts", "3"], "either --duration or --num-prompts"),
    (["--input-len", "0"], "--input-len"),
    (["--threshold", "x"], "--threshold 'x'"),
    (["--threshold", "4,2000000"], "2000000 is larger than 1,000,000"),  # the bounds of deploy --threshold
    (["stray"], "unexpected argument 'stray'"),
])
def test_bad_input_exits_2_naming_the_item(args, fragment, tmp_path):
    result = CliRunner().invoke(make_app(), ["bench", "--config", str(tmp_path / "absent.toml"), *args])
    assert result.exit_code == 2, result.output
    assert fragment in result.output


def test_unreachable_server_exits_4(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound but not listening: refused
        cfg = write_config(tmp_path, s.getsockname()[1])
        result = CliRunner().invoke(make_app(), ["bench", "--config", str(cfg), "--concurrency", "1",
                                                 "--duration", "1"])
    assert result.exit_code == 4, result.output
    assert "not answering" in result.output and "tiny" in result.output


@pytest.mark.slow
def test_errors_are_counted_and_vllm_names_written(server, tmp_path):
    server.fail_every = 4
    cfg = write_config(tmp_path, server.port, serves_here=True)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(make_app(), [
        "bench", "--config", str(cfg), "--concurrency", "2,3", "--num-prompts", "12", "--warmup", "0",
        "--input-len", "8", "--output-len", "4", "--goodput", "ttft:500", "tpot:500", "--json", str(out),
        "--png", str(tmp_path / "bench.png")])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    levels = doc["runs"][0]["levels"]
    assert [lv["max_concurrency"] for lv in levels] == [2, 3]
    for lv in levels:
        assert lv["completed"] + lv["failed"] == 12 and lv["failed"] >= 2
        assert any(k.startswith("HTTP 500") for k in lv["errors"])
        for key in ("output_throughput", "request_throughput", "total_token_throughput", "mean_ttft_ms",
                    "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
                    "median_e2el_ms", "request_goodput", "max_concurrency", "completed", "failed"):
            assert key in lv
        assert lv["request_goodput"] == pytest.approx(lv["request_throughput"])  # generous SLOs: all good
    assert doc["goodput_config"] == {"ttft": 500.0, "tpot": 500.0}
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "failed (most often: HTTP 500" in result.output


@pytest.mark.slow
def test_compare_never_switches_a_server_that_is_not_ours(server, tmp_path):
    """A listener on the port that dynctl did not start is measured at most, never reconfigured."""
    cfg = write_config(tmp_path, server.port)  # the test server, not recorded as started by dynctl
    result = CliRunner().invoke(make_app(), [
        "bench", "--config", str(cfg), "--concurrency", "1", "--num-prompts", "2", "--input-len", "4",
        "--output-len", "4", "--compare", "--yes", "--no-chart"])
    assert result.exit_code == 3, result.output
    assert "which dynctl does not manage" in " ".join(result.output.split())
    assert server.threshold == 4  # never changed


@pytest.mark.slow
def test_compare_switches_live_and_restores_the_threshold(server, tmp_path):
    cfg = write_config(tmp_path, server.port, serves_here=True)
    out = tmp_path / "cmp.json"
    result = CliRunner().invoke(make_app(), [
        "bench", "--config", str(cfg), "--concurrency", "1,2", "--num-prompts", "4", "--input-len", "4",
        "--output-len", "4", "--compare", "--threshold", "1", "--json", str(out), "--no-chart"])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [(r["mode"], r["threshold"]) for r in doc["runs"]] == [("no-spec", 0), ("always-spec", -1),
                                                                 ("threshold 1", 1)]
    assert server.threshold == 4 and "threshold restored to 4" in result.output
    assert doc["recommendation"] is not None and "recommended" in result.output
    shares = {r["mode"]: [lv["server"]["spec_on_share"] for lv in r["levels"]] for r in doc["runs"]}
    assert shares["no-spec"] == [0.0, 0.0] and shares["always-spec"] == [1.0, 1.0]


@pytest.mark.slow
def test_compare_refuses_a_server_without_speculation(server, tmp_path):
    server.spec = None
    cfg = write_config(tmp_path, server.port, serves_here=True)
    result = CliRunner().invoke(make_app(), ["bench", "--config", str(cfg), "--concurrency", "1",
                                             "--num-prompts", "1", "--compare"])
    assert result.exit_code == 3 and "without speculative decoding" in result.output
    assert server.requests == 0  # refused before any load


@pytest.mark.slow
def test_unpatched_server_needs_consent_to_redeploy_for_each_mode(server, tmp_path):
    server.threshold = None  # /server_info has no threshold: not patched, so modes need a redeploy
    cfg = write_config(tmp_path, server.port, serves_here=True)
    result = CliRunner().invoke(make_app(), ["bench", "--config", str(cfg), "--concurrency", "1",
                                             "--num-prompts", "1", "--compare"])
    assert result.exit_code == 2, result.output
    assert "cannot change live" in result.output and "refusing without --yes" in result.output
    assert server.requests == 0


def _read_until(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} within {timeout} s; output so far:\n{seen}"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536).decode()
            assert chunk or proc.poll() is None, f"exited early:\n{seen}"
            seen += chunk
    return seen


@pytest.mark.slow
def test_ctrl_c_mid_sweep_writes_what_was_measured_and_exits_130(server, tmp_path):
    cfg = write_config(tmp_path, server.port, serves_here=True)
    out = tmp_path / "partial.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, "bench", "--config", str(cfg), "--concurrency", "1,2,4,8",
         "--duration", "1.5", "--input-len", "4", "--output-len", "4", "--compare", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        _read_until(proc, "no-spec c=1:", timeout=30)  # one level measured, the next one running
        assert server.threshold == 0  # switched live to no-spec
        agents = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest
    assert b"interrupted" in rest
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and doc["runs"][0]["mode"] == "no-spec"
    assert 1 <= len(doc["runs"][0]["levels"]) < 4
    assert doc["runs"][0]["levels"][0]["max_concurrency"] == 1
    assert server.threshold == 4  # put back even on Ctrl-C
    # the level's generator is stopped; one caught while starting up exits at its next tick (closed pipe)
    wait_for(lambda: not [p for p in agents if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 5,
             "the load generators to end with dynctl bench")


@pytest.mark.slow
def test_core_run_stops_when_asked_and_restores(server, tmp_path):
    """The TUI's stop key: should_stop() ends the run after the current level, threshold put back."""
    from test_bench_server import local_agent

    from dynctl.bench import (
        BenchInterrupted,
        BenchPlan,
        LevelDone,
        Mode,
        ThresholdRestored,
        run_bench,
    )

    events: list = []
    plan = BenchPlan(concurrency=(1, 2, 4), num_prompts=3, input_len=4, output_len=3,
                     modes=(Mode.no_spec(), Mode.always_spec()), compare=True)
    with pytest.raises(BenchInterrupted) as info:
        run_bench(local_agent(server.port, serves_here=True), "tiny", plan, events.append,
                  should_stop=lambda: any(isinstance(e, LevelDone) for e in events))
    result = info.value.result
    assert result.interrupted and result.levels_measured == 1 and result.runs[0].levels[0]["completed"] == 3
    assert server.threshold == 4 and isinstance(events[-1], ThresholdRestored)
