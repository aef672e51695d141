"""The lifecycle against the simulated SGLang host (`python -m dynctl.sim` on a real sglang 0.5.9 tree),
reached the way a real box is: SSH to a real sshd, then `pct exec` into the "container" holding it.

The simulator behaves like sglang from the outside: TP scheduler children with PDEATHSIG, SIGTERM drain,
tracebacks behind a log prefix, and a fake nvidia-smi listing the schedulers as holding GPU memory.
"""

from __future__ import annotations

import psutil
import pytest
import typer
from demo_box import session as open_session
from typer.testing import CliRunner

from dynctl.base import events
from dynctl.core import lifecycle
from dynctl.cli import lifecycle as lifecycle_cli
from dynctl.cli.common import HostSession
from lifecycle_harness import alive, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def demo(demo_box) -> tuple[HostSession, str]:
    """(session, config path) of a demo host inside container 129, its server not started."""
    config = demo_box(time_scale=50)
    return open_session(config), str(config)


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
