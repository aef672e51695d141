"""The lifecycle against the simulated SGLang host (`python -m dynctl.sim` on a real sglang 0.5.9 tree),
reached the way a real box is: SSH to a real sshd, then `pct exec` into the "container" holding it.

The simulator behaves like sglang from the outside: TP scheduler children with PDEATHSIG, SIGTERM drain,
tracebacks behind a log prefix, and a fake nvidia-smi listing the schedulers as holding GPU memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import typer
from typer.testing import CliRunner

from dynctl import events, lifecycle
from dynctl.cli import lifecycle as lifecycle_cli
from dynctl.cli.common import HostSession, open_host
from dynctl.sim.hostsetup import prepare_demo_host
from dynctl.transport import close_all
from lifecycle_harness import alive, wait_for
from sglang_trees import sglang_wheel
from sshd_harness import FakeHost, free_port

CTID = 131


@pytest.fixture(scope="module")
def demo_root(sshd: FakeHost) -> Path:
    """One demo host (sglang 0.5.9 installed, fake nvidia-smi) inside container 131, shared by these tests."""
    sshd.make_ct(CTID)
    root = sshd.ct_root(CTID) / "demo"
    prepare_demo_host(root, "0.5.9", cache_dir=sglang_wheel("0.5.9").parent, time_scale=50)
    return root


@pytest.fixture
def demo(demo_root: Path, sshd: FakeHost, tmp_path: Path) -> Iterator[tuple[HostSession, str]]:
    """(session, config path) for a fresh port and workdir on the demo host; the server is killed after."""
    entry = prepare_demo_host(demo_root, "0.5.9", free_port(), cache_dir=sglang_wheel("0.5.9").parent,
                              time_scale=50)
    entry.update(ssh=sshd.target, pct=CTID, workdir=str(tmp_path / "work"))
    cfg = str(sshd.write_config(tmp_path / "dynctl.toml", {"demo": entry}, default_host="demo"))
    session = open_host("demo", cfg)
    try:
        yield session, cfg
    finally:
        close_all()
        rec = tmp_path / "work" / "server.json"
        marker = json.loads(rec.read_text()).get("marker") if rec.exists() else None
        for p in psutil.process_iter():
            try:
                if marker and p.environ().get("DYNCTL_SERVER_ID") == marker:
                    p.kill()
            except psutil.Error:
                continue


def start(session: HostSession, *flags: str, evs: list | None = None) -> int:
    argv = lifecycle.server_argv(session.host, flags)
    return lifecycle.start_server(session.agent, argv, on_event=(evs.append if evs is not None else events.ignore))["pid"]


def tree_of(pid: int) -> list[int]:
    return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]


def test_graceful_stop_waits_for_the_schedulers_gpu_memory(demo):
    session, _ = demo
    pid = start(session)
    ready = lifecycle.wait_ready(session.agent, 120)
    assert ready["generate"]["tokens"] > 0
    tree = tree_of(pid)
    assert len(tree) >= 9  # the main process and 8 TP schedulers
    result = lifecycle.stop_server(session.agent, grace=30)
    assert not result["escalated"] and result["gpu"]["checked"] is True
    assert len(result["gpu"]["held_before"]) == 8 and set(result["gpu"]["held_before"]) <= set(tree)
    assert not any(alive(p) for p in tree)
    assert lifecycle.find_server(session.agent).state == "down"


def test_crash_on_start_is_reported_with_the_schedulers_traceback(demo):
    session, _ = demo
    evs: list = []
    start(session, "--sim-crash-after", "0.3", evs=evs)
    with pytest.raises(lifecycle.ServerStartFailed) as err:
        lifecycle.wait_ready(session.agent, 120, on_event=evs.append)
    tail = "\n".join(err.value.log_tail)
    assert err.value.reason in ("crash", "traceback")
    assert "Scheduler hit an exception: Traceback (most recent call last)" in tail
    assert isinstance(evs[-1], events.Failed)
    wait_for(lambda: lifecycle.find_server(session.agent).state == "down", what="the crashed server to be down")
    state = lifecycle.find_server(session.agent)
    assert state.leftovers == () and state.port_owner is None


def test_hang_on_start_times_out_and_stops_cleanly(demo):
    session, _ = demo
    pid = start(session, "--sim-hang-on-start")
    with pytest.raises(lifecycle.ServerStartFailed, match="not ready within 2s") as err:
        lifecycle.wait_ready(session.agent, 2)
    assert err.value.reason == "timeout"
    tree = tree_of(pid)
    lifecycle.stop_server(session.agent, grace=10)
    assert not any(alive(p) for p in tree)


def test_cli_start_restart_stop_on_the_demo_host(demo):
    _, cfg = demo
    app = typer.Typer()
    lifecycle_cli.register(app)
    cli = CliRunner()
    res = cli.invoke(app, ["start", "--config", cfg, "--yes", "--ready-timeout", "120"])
    assert res.exit_code == 0, res.output
    assert "fired up and ready to roll" in res.output
    res = cli.invoke(app, ["restart", "--config", cfg, "--yes", "--grace", "10"])
    assert res.exit_code == 0, res.output
    res = cli.invoke(app, ["stop", "--config", cfg, "--yes", "--grace", "10"])
    assert res.exit_code == 0, res.output
    assert "GPU memory released" in res.output
