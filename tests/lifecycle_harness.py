"""Real servers for the lifecycle tests: a host whose launch runs tests/servers, and clean-up by pid.

`Box` is one host (Local transport by default) with its own workdir and port. Everything a test
starts is killed afterwards strictly by pid: processes the test spawned itself, and processes that
carry the marker dynctl put into a server's environment.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from polling import alive, wait_for
from sshd_harness import free_port

from dynctl.base import events
from dynctl.core import lifecycle
from dynctl.agent.client import AgentClient
from dynctl.base.config import HostConfig
from dynctl.transport.local import Local

HERE = Path(__file__).resolve().parent
SERVERS = HERE / "servers"
SHIM = SERVERS / "sglang_shim"
FAKE_BIN = SERVERS / "bin"
SERVER_SCRIPT = SERVERS / "lifecycle_server.py"
SLEEPER = "import time\nwhile True: time.sleep(60)\n"


def listening(port: int) -> bool:
    return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections(kind="tcp"))


@dataclass
class Box:
    host: HostConfig
    agent: AgentClient
    tmp: Path
    events: list[events.Event] = field(default_factory=list)
    _procs: list[psutil.Process] = field(default_factory=list)
    _markers: set[str] = field(default_factory=set)

    @property
    def port(self) -> int:
        return self.host.port

    @property
    def workdir(self) -> Path:
        return Path(self.host.workdir)

    def argv(self, *flags: str) -> list[str]:
        return lifecycle.server_argv(self.host, flags)

    def start(self, *flags: str) -> dict[str, Any]:
        result = lifecycle.start_server(self.agent, self.argv(*flags), on_event=self.events.append)
        self.remember_server()
        return result

    def start_ready(self, *flags: str, ready_timeout: float = 60.0) -> dict[str, Any]:
        started = self.start(*flags)
        lifecycle.wait_ready(self.agent, ready_timeout, on_event=self.events.append)
        return started

    def remember_server(self) -> None:
        rec = self.pidfile()
        if rec and rec.get("marker"):
            self._markers.add(rec["marker"])

    def pidfile(self) -> dict[str, Any] | None:
        path = self.workdir / "server.json"
        return json.loads(path.read_text()) if path.exists() else None

    def journal(self) -> list[dict[str, Any]]:
        path = self.workdir / "journal.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def children(self) -> dict[str, int]:
        """Pids the current server says it spawned ("children: plain=1 setsid=2", "port-holder=3")."""
        found: dict[str, int] = {}
        for line in (self.workdir / "server.log").read_text().splitlines():
            if "==== dynctl start" in line:
                found = {}
            if "children:" in line:
                found.update({k: int(v) for k, v in re.findall(r"([\w-]+)=(\d+)", line.split("children:", 1)[1])})
        return found

    def spawn(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        """A process the test owns (decoy, foreign listener, hand-started server); killed at teardown."""
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.DEVNULL)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, **kw)
        self._procs.append(psutil.Process(proc.pid))
        return proc

    def spawn_server(self, port: int, *flags: str) -> subprocess.Popen:
        """A real test server started by hand, the way an operator would, outside dynctl."""
        env = dict(os.environ, PYTHONPATH=str(SHIM))
        return self.spawn([sys.executable, "-m", "sglang.launch_server", "--port", str(port), *flags],
                          env=env, start_new_session=True)

    def cleanup(self) -> None:
        victims: dict[int, psutil.Process] = {}
        for proc in self._procs:
            try:
                for p in [proc, *proc.children(recursive=True)]:
                    victims[p.pid] = p
            except psutil.Error:
                continue
        if self._markers:
            wanted = {f"{m}" for m in self._markers}
            for p in psutil.process_iter():
                try:
                    if p.environ().get("DYNCTL_SERVER_ID") in wanted:
                        victims[p.pid] = p
                except psutil.Error:
                    continue
        for p in victims.values():
            try:
                p.kill()  # same psutil.Process object: psutil refuses if the pid was reused
            except psutil.Error:
                pass
        # zombies count as gone: init may reap them a second late
        wait_for(lambda: not any(alive(p.pid) for p in victims.values()), 10, "test processes to die")


def make_box(tmp: Path, transport: Any = None, **overrides: Any) -> Box:
    fields: dict[str, Any] = {
        "name": "box", "python": sys.executable, "workdir": str(tmp / "work"), "port": free_port(),
        "env": {"PYTHONPATH": str(SHIM)},
    }
    fields.update(overrides)
    host = HostConfig(**fields)
    return Box(host, AgentClient(transport or Local(), host), tmp)


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    b = make_box(tmp_path)
    try:
        yield b
    finally:
        b.cleanup()
