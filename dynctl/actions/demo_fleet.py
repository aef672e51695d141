"""`dynctl demo --fleet N`: N simulated GPU hosts behind a real smg gateway on 127.0.0.1, and a rolling deploy
of the threshold through it (UI-free).

The hosts are `demo-1` … `demo-N` in group `demo-fleet` of the user's config (other hosts and comments
kept); the gateway is started only when smg is installed, and only the one this demo started (its pid in
the fleet's directory, checked against its command line) is ever reused or stopped.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from dynctl.base import events
from dynctl.agent.client import open_agent
from dynctl.base.config import Config, load_config
from dynctl.actions.demo import demo_root, free_port, register_tables
from dynctl.base.errors import ConfigError, OperationFailed
from dynctl.base.httpjson import HttpError, JsonHttp
from dynctl.core.fleet import fan_out, fleet_target
from dynctl.core.lifecycle import find_server, restart_server, server_argv

GROUP = "demo-fleet"
MAX_FLEET = 8


def fleet_root() -> Path:
    return demo_root().parent / "demo-fleet"


def smg_binary() -> str | None:
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.is_file() else shutil.which("smg")


def register_sections(sections: dict[str, dict[str, Any]], config_path: str | None = None) -> Path:
    """Put each `[NAME]` table of `sections` ("hosts.demo-1", "groups.demo-fleet") into the user's config,
    replacing one already there; the rest of the file, comments included, stays as it was."""
    return register_tables(sections, "made by `dynctl demo --fleet` (SIMULATED hosts, no GPU)", config_path)


@dataclass
class DemoFleet:
    config: Config
    config_path: Path
    names: list[str]
    gateway: str | None


def _gateway_pid(root: Path) -> int | None:
    """The pid of the gateway this demo started, when it still runs as smg; else None."""
    try:
        pid = int((root / "smg.pid").read_text())
        proc = psutil.Process(pid)
        if any("smg" in part for part in proc.cmdline()):
            return pid
    except (OSError, ValueError, psutil.Error):
        pass
    return None


def prepare(count: int, config_path: str | None = None, time_scale: float = 1.0,
            on_event: events.EventSink = events.ignore) -> DemoFleet:
    """N demo hosts registered and serving, and the gateway in front of them when smg is installed."""
    from dynctl.sim.hostsetup import prepare_demo_host

    root = fleet_root()
    cache = demo_root() / "cache"
    names = [f"demo-{i}" for i in range(1, count + 1)]
    on_event(events.StepStarted("prepare", f"{count} simulated GPU hosts in {root} (sglang 0.5.9 from PyPI)"))
    try:
        old = load_config(config_path)
        old_ports = {n: old.hosts[n].port for n in names if n in old.hosts}
    except ConfigError:
        old_ports = {}
    entries = {}
    for name in names:
        entry = prepare_demo_host(root / name, port=old_ports.get(name) or free_port(), cache_dir=cache,
                                  time_scale=time_scale)
        entries[name] = entry
    gateway_pid = _gateway_pid(root)
    gw_port = int((root / "smg.port").read_text()) if gateway_pid and (root / "smg.port").exists() else free_port()
    binary = smg_binary()
    gateway = f"http://127.0.0.1:{gw_port}" if binary else None
    group: dict[str, Any] = {"hosts": names}
    if gateway:
        group["gateway"] = gateway
    path = register_sections({**{f"hosts.{n}": e for n, e in entries.items()}, f"groups.{GROUP}": group},
                             config_path)
    cfg = load_config(path)
    on_event(events.StepDone("prepare", 0.0, f"registered as {', '.join(names)} in group {GROUP} in {path}"))

    def start(name: str) -> None:
        host = cfg.hosts[name]
        agent = open_agent(host, cfg)
        state = find_server(agent)
        if state.not_ours:
            holder = state.not_ours.get("text") or "another process"
            raise OperationFailed(f"{name}: port {host.port} is held by {holder}, which the demo leaves alone")
        if state.pid is None:
            restart_server(agent, server_argv(host), grace=10)

    on_event(events.StepStarted("start", f"{count} simulated servers"))
    t0 = time.monotonic()
    fan_out(names, start, 4)
    on_event(events.StepDone("start", time.monotonic() - t0, "every server ready"))
    if binary is None:
        on_event(events.Warning("smg is not installed (pip install smg==1.13.0): the fleet runs without a gateway, "
                                "so a rolling deploy cannot drain"))
    elif gateway_pid is None:
        urls = [cfg.hosts[n].gateway_url for n in names]
        log = open(root / "smg.log", "ab")
        proc = subprocess.Popen([binary, "launch", "--host", "127.0.0.1", "--port", str(gw_port), "--policy",
                                 "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port",
                                 str(free_port()), "--worker-urls", *urls], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        (root / "smg.pid").write_text(f"{proc.pid}\n")
        (root / "smg.port").write_text(f"{gw_port}\n")
        on_event(events.Note(f"smg gateway on {gateway} (pid {proc.pid}, log {root / 'smg.log'})"))
    if gateway:
        _wait_gateway(gateway, [cfg.hosts[n].gateway_url for n in names])
    return DemoFleet(cfg, path, names, gateway)


def _wait_gateway(gateway: str, urls: list[str], timeout: float = 60.0) -> None:
    """Until the gateway lists every URL ready, registering those it does not know (the demo's own fleet)."""
    deadline = time.monotonic() + timeout
    http = JsonHttp(gateway, timeout=5)
    while True:
        try:
            workers = {w["url"].rstrip("/"): w for w in http.request("GET", "/workers").json()["workers"]}
            for url in urls:
                if url not in workers:
                    http.post("/workers", json={"url": url})
            if all(str(workers.get(u, {}).get("status", "")).lower() == "ready" for u in urls):
                return
        except (HttpError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise OperationFailed(f"the demo gateway {gateway} did not list every server ready in {timeout:.0f} s")
        time.sleep(0.2)


def rolling_deploy(fleet: DemoFleet, threshold: int, on_event: events.EventSink = events.ignore,
                   drain: float = 5.0) -> list[Any]:
    from dynctl.core.rollout import RollingOperation

    target = fleet_target(fleet.config, GROUP, None)
    assert target is not None
    op = RollingOperation(fleet.config, target, "deploy", threshold, on_event=on_event, drain=drain, grace=10)
    try:
        return op.run(lambda question: True)[1]
    finally:
        op.close()


def drive_load(gateway: str, stop: threading.Event, streams: int = 4) -> None:
    """Closed-loop streaming completions through the gateway until `stop` (the demo's traffic)."""

    def loop(i: int) -> None:
        http = JsonHttp(gateway, timeout=60)
        while not stop.is_set():
            body = {"model": "/models/demo-simulated", "prompt": f"demo fleet {i}", "max_tokens": 128,
                    "stream": True}
            try:
                for _ in http.stream_lines("POST", "/v1/completions", json=body):
                    pass
            except HttpError:
                stop.wait(0.5)

    for i in range(streams):
        threading.Thread(target=loop, args=(i,), name=f"demo-fleet-load-{i}", daemon=True).start()
