"""`dynctl stop|start|restart|logs` end to end: typer CLI → real sshd → `pct` stand-in → agent → real server."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest
import typer
from typer.testing import CliRunner

from dynctl.cli import lifecycle as lifecycle_cli
from lifecycle_harness import SHIM, alive, listening, wait_for
from sshd_harness import FakeHost, free_port

pytestmark = pytest.mark.slow

CTID = 129


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    lifecycle_cli.register(app)
    return app


@pytest.fixture
def ct_host(sshd: FakeHost, tmp_path: Path):
    """A config whose host `box` is reached as ssh → pct 129, plus clean-up of the server by its pidfile."""
    sshd.make_ct(CTID)
    port = free_port()
    workdir = tmp_path / "work"

    def write(**extra):
        host = {"ssh": sshd.target, "pct": CTID, "python": sys.executable, "workdir": str(workdir), "port": port,
                "env": {"PYTHONPATH": str(SHIM)}}
        host.update(extra)
        return str(sshd.write_config(tmp_path / "dynctl.toml", {"box": host}, default_host="box"))

    state = {"config": write(), "port": port, "workdir": workdir, "write": write}
    yield state
    rec = workdir / "server.json"
    if rec.exists():
        marker = json.loads(rec.read_text()).get("marker")
        for p in psutil.process_iter():
            try:
                if p.environ().get("DYNCTL_SERVER_ID") == marker:
                    p.kill()
            except psutil.Error:
                continue


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status
    except OSError:
        return None


def test_start_logs_stop_over_ssh_and_pct(app, ct_host, sshd: FakeHost):
    cli = CliRunner()
    cfg, port = ct_host["config"], ct_host["port"]

    res = cli.invoke(app, ["start", "--config", cfg])
    assert res.exit_code == 2 and "refusing without --yes" in res.output  # stdin is not a TTY
    assert not listening(port)

    res = cli.invoke(app, ["start", "--config", cfg, "--yes", "--ready-timeout", "60"])
    assert res.exit_code == 0, res.output
    assert "fired up and ready to roll" in res.output and "returned 4 tokens" in res.output
    pid = json.loads((ct_host["workdir"] / "server.json").read_text())["pid"]
    # the command is over and its SSH connection closed: the server must not have noticed
    assert alive(pid) and health(port) == 200
    assert psutil.Process(pid).ppid() != psutil.Process().pid
    assert any(call.startswith(f"pct exec {CTID} ") for call in sshd.pct_calls())

    res = cli.invoke(app, ["logs", "--config", cfg, "-n", "3"])
    assert res.exit_code == 0 and len(res.output.splitlines()) == 3

    res = cli.invoke(app, ["start", "--config", cfg, "--yes"])
    assert res.exit_code == 0 and f"already running: ready, pid {pid}" in res.output

    res = cli.invoke(app, ["stop", "--config", cfg])
    assert res.exit_code == 2 and alive(pid)

    res = cli.invoke(app, ["stop", "--config", cfg, "--yes", "--grace", "10", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["stopped"] is True and out["pid"] == pid and not out["escalated"]
    assert not alive(pid) and not listening(port)

    res = cli.invoke(app, ["stop", "--config", cfg, "--yes"])
    assert res.exit_code == 0 and "already stopped" in res.output


def test_restart_over_ssh_and_pct_keeps_arguments(app, ct_host):
    cli = CliRunner()
    cfg = ct_host["write"](args=["--tokens", "2"])
    res = cli.invoke(app, ["start", "--config", cfg, "--yes"])
    assert res.exit_code == 0, res.output
    old = json.loads((ct_host["workdir"] / "server.json").read_text())
    res = cli.invoke(app, ["restart", "--config", cfg, "--yes", "--grace", "10"])
    assert res.exit_code == 0, res.output
    new = json.loads((ct_host["workdir"] / "server.json").read_text())
    assert new["pid"] != old["pid"] and new["argv"] == old["argv"] and not alive(old["pid"])
    assert "returned 2 tokens" in res.output
    cli.invoke(app, ["stop", "--config", cfg, "--yes"])


def test_start_crash_exits_1_with_the_traceback(app, ct_host):
    cfg = ct_host["write"](args=["--crash-after", "0.2"])
    res = CliRunner().invoke(app, ["start", "--config", cfg, "--yes", "--ready-timeout", "120"])
    assert res.exit_code == 1, res.output
    assert "Traceback (most recent call last)" in res.output and "simulated crash" in res.output


def test_foreign_listener_refuses_start_with_exit_3(app, ct_host, tmp_path):
    port = ct_host["port"]
    foreign = psutil.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: listening(port), what="the foreign listener")
        res = CliRunner().invoke(app, ["start", "--config", ct_host["config"], "--yes"])
        assert res.exit_code == 3
        assert f"held by pid {foreign.pid}" in res.output and "nothing was killed" in res.output
        res = CliRunner().invoke(app, ["stop", "--config", ct_host["config"], "--yes"])
        assert res.exit_code == 0 and "already stopped" in res.output and f"pid {foreign.pid}" in res.output
        assert foreign.is_running() and foreign.status() != psutil.STATUS_ZOMBIE
    finally:
        foreign.kill()
        foreign.wait(10)


def test_log_follow_ends_on_the_host_once_the_client_is_gone(ct_host):
    """`logs -f` must not leave an agent running in the container after the client disconnects."""
    from dynctl.core import lifecycle
    from dynctl.cli.common import open_host
    from dynctl.transport import close_all

    session = open_host("box", ct_host["config"])
    try:
        lifecycle.start_server(session.agent, lifecycle.server_argv(session.host))
        lifecycle.wait_ready(session.agent, 60)
        follow = lifecycle.follow_log(session.agent, lines=1)
        assert next(follow)

        def followers():
            return [p for p in psutil.process_iter(["cmdline"])
                    if (p.info["cmdline"] or [])[:3] == [sys.executable, "-S", "-c"]
                    and str(ct_host["workdir"]) in p.info["cmdline"]]

        (agent_proc,) = wait_for(followers, what="the follow agent on the host")
        follow.close()
        close_all()
        wait_for(lambda: not alive(agent_proc.pid), 20, "the follow agent to notice the client is gone")
        lifecycle.stop_server(open_host("box", ct_host["config"]).agent, grace=10)
    finally:
        close_all()
