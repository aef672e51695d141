"""The live feed: real agent processes over the Local transport, really killed, stopped and starved."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from dynctl.agent.client import AgentClient
from dynctl.base.config import HostConfig
from dynctl.transport.local import Local
from dynctl.live.feed import LiveFeed
from dynctl.live.snapshot import HostHistory, HostSnapshot
from lifecycle_harness import wait_for as wait_until
from watch_server import SglangLikeServer, record_as_server

pytestmark = pytest.mark.slow


class Recorder:
    """The feed's callback: keeps every snapshot, lets the test wait for one."""

    def __init__(self) -> None:
        self.snaps: list[HostSnapshot] = []
        self.cond = threading.Condition()

    def __call__(self, snap: HostSnapshot, history: HostHistory) -> None:
        with self.cond:
            self.snaps.append(snap)
            self.cond.notify_all()

    def wait(self, check: Callable[[HostSnapshot], bool], timeout: float = 15.0, after: int = 0) -> HostSnapshot:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for snap in self.snaps[after:]:
                    if check(snap):
                        return snap
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching snapshot in {timeout} s; last: {self.snaps[-1:]}")
                self.cond.wait(left)


def agents_of(workdir: Path) -> list[psutil.Process]:
    """This test's own agent processes: children of this process running the agent from `workdir`."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and str(workdir) in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:  # exited between the listing and the look
            continue
    return found




@pytest.fixture
def server() -> Iterator[SglangLikeServer]:
    with SglangLikeServer() as s:
        yield s


def make_feed(tmp_path: Path, port: int, rec: Recorder, **kw: Any) -> tuple[LiveFeed, Path]:
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    record_as_server(workdir)  # this process serves the HTTP
    host = HostConfig(name="box", python=kw.pop("python", sys.executable), workdir=str(workdir), port=port)
    if host.python == sys.executable:  # see test_watch_agent.client: keep the upload race out of these tests
        AgentClient(Local(), host).upload()
    kw.setdefault("backoff", (0.1, 0.2, 0.4))
    return LiveFeed([host], rec, interval=0.2, **kw), workdir


def test_snapshots_flow_and_stop_ends_the_agent(tmp_path: Path, server: SglangLikeServer) -> None:
    rec = Recorder()
    feed, workdir = make_feed(tmp_path, server.port, rec)
    feed.start()
    try:
        rec.wait(lambda s: s.connected and s.state == "ready" and s.running_reqs == 2)
        server.state.update(running=9, spec=False)
        snap = rec.wait(lambda s: s.running_reqs == 9)
        assert snap.speculation is False and snap.last_switch is not None
        assert len(feed.history("box").points()) >= 2
        assert len(agents_of(workdir)) == 1  # one long-lived call, not one per sample
    finally:
        feed.stop()
    wait_until(lambda: not agents_of(workdir), what="the agent to exit after stop()")
    assert not any(t.is_alive() for t in feed.hosts["box"]._threads)


def test_a_killed_connection_shows_disconnected_and_reconnects(tmp_path: Path, server: SglangLikeServer) -> None:
    rec = Recorder()
    feed, workdir = make_feed(tmp_path, server.port, rec)
    feed.start()
    try:
        rec.wait(lambda s: s.connected)
        victim = wait_until(lambda: agents_of(workdir), what="the agent")[0]
        t_kill = time.time()
        victim.send_signal(signal.SIGKILL)
        down = rec.wait(lambda s: not s.connected)
        assert down.disconnected_since is not None and down.disconnected_since >= t_kill - 0.01
        assert "watch" in (down.error or "")  # the agent client names the stream that broke
        assert down.running_reqs == 2 and down.state == "ready"  # the last known values stay on screen
        back = rec.wait(lambda s: s.connected, after=rec.snaps.index(down))
        assert back.time >= t_kill and feed.hosts["box"].reconnects == 1
        assert len(agents_of(workdir)) == 1
    finally:
        feed.stop()


def test_an_unreachable_host_backs_off_and_keeps_its_since(tmp_path: Path) -> None:
    rec = Recorder()
    feed, _ = make_feed(tmp_path, 1, rec, python=str(tmp_path / "no-such-python"), backoff=(0.05, 0.1, 0.2, 0.3))
    feed.start()
    try:
        rec.wait(lambda s: len(rec.snaps) >= 5, timeout=10)
    finally:
        feed.stop()
    downs = rec.snaps[:5]
    assert all(not s.connected for s in downs)
    assert "no-such-python" in (downs[0].error or "")  # the error names what is missing
    assert len({s.disconnected_since for s in downs}) == 1  # since the first failure, not the latest
    waits = [round(s.retry_at - s.time, 2) for s in downs]
    assert waits == [0.05, 0.1, 0.2, 0.3, 0.3]  # doubles, then holds at the cap


def test_a_stalled_channel_is_noticed_and_replaced(tmp_path: Path, server: SglangLikeServer) -> None:
    rec = Recorder()
    feed, workdir = make_feed(tmp_path, server.port, rec, stall_after=1.0)
    feed.start()
    stalled: list[psutil.Process] = []
    try:
        rec.wait(lambda s: s.connected)
        stalled = wait_until(lambda: agents_of(workdir), what="the agent")
        stalled[0].send_signal(signal.SIGSTOP)  # alive, connected, silent: a hung SSH channel looks like this
        down = rec.wait(lambda s: not s.connected)
        assert "stalled" in (down.error or "")
        back = rec.wait(lambda s: s.connected, after=rec.snaps.index(down))
        assert back.time > down.time - 0.5 and feed.hosts["box"].reconnects == 1
    finally:
        feed.stop()
        for p in stalled:  # the abandoned agent is ours: end it by pid
            p.send_signal(signal.SIGKILL)
    wait_until(lambda: not agents_of(workdir), what="every agent to end")
