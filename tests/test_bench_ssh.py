"""Bench through a real OpenSSH server on loopback: the load generator runs on the far side as an agent verb."""

from __future__ import annotations

import contextlib
import json
import sys

import psutil
import pytest
from polling import wait_for
from test_bench_cli import make_app
from test_bench_server import TokenServer
from typer.testing import CliRunner

from dynctl.agent.client import AgentClient
from dynctl.base.config import HostConfig

pytestmark = pytest.mark.slow


@pytest.fixture
def server():
    s = TokenServer(interval=0.005).start()
    try:
        yield s
    finally:
        s.close()


def test_bench_over_ssh(sshd, server, tmp_path):
    cfg = sshd.write_config(tmp_path / "dynctl.toml", {"box": {
        "ssh": sshd.target, "python": sys.executable, "port": server.port, "workdir": str(tmp_path / "w")}})
    out = tmp_path / "ssh.json"
    result = CliRunner().invoke(make_app(), ["bench", "--config", str(cfg), "--host", "box", "--concurrency", "2",
                                             "--num-prompts", "6", "--input-len", "4", "--output-len", "5",
                                             "--json", str(out)])
    assert result.exit_code == 0, result.output
    level = json.loads(out.read_text())["runs"][0]["levels"][0]
    assert level["completed"] == 6 and level["total_output_tokens"] == 30 and level["failed"] == 0


def test_closing_the_channel_stops_the_load_on_the_host(sshd, server, tmp_path):
    """Ctrl-C or a dropped connection: the agent's next tick hits a closed pipe and the level ends there."""
    workdir = str(tmp_path / "w")
    host = HostConfig(name="box", port=server.port, python=sys.executable, workdir=workdir)
    agent = AgentClient(sshd.ssh(), host)

    def generators() -> list[psutil.Process]:
        found = []
        for p in sshd.server.session_processes():
            with contextlib.suppress(psutil.Error):
                if workdir in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        return found

    with contextlib.closing(agent.stream("bench_level", concurrency=3, input_len=4, output_len=50,
                                         duration=60, warmup=0, tick_s=0.2)) as items:
        assert next(iter(items))["type"] == "tick"
        wait_for(lambda: server.requests >= 3, 10, "the three streams to reach the server")
        assert generators()
    wait_for(lambda: not (generators() or server.running), 10, "the host to stop sending load after the channel closed")
