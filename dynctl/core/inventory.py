"""What dynctl knows about its hosts: reachability and what is installed there (UI-free)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from dynctl.agent.client import LOOK_TIMEOUT, AgentClient, open_agent
from dynctl.base.config import Config, HostConfig
from dynctl.base.errors import DynctlError


@dataclass
class Reachability:
    name: str
    route: str
    reachable: bool
    latency_ms: float | None = None
    error: str | None = None
    exit_code: int = 0
    simulated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_host(host: HostConfig, config: Config) -> Reachability:
    """Reach the host and its agent once; latency is the agent round trip after the connection is up."""
    try:
        agent = open_agent(host, config, timeout=LOOK_TIMEOUT)
        agent.call("ping")  # connects, uploads the agent if needed
        start = time.perf_counter()
        agent.call("ping")
        latency = (time.perf_counter() - start) * 1000
    except DynctlError as err:
        return Reachability(host.name, host.route, False, error=str(err), exit_code=err.exit_code,
                            simulated=host.simulated)
    return Reachability(host.name, host.route, True, latency_ms=round(latency, 2), simulated=host.simulated)


def probe_hosts(config: Config, names: list[str] | None = None) -> list[Reachability]:
    hosts = [config.host(n) for n in names] if names else list(config.hosts.values()) or [config.host(None)]
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(hosts)))) as pool:
        return list(pool.map(lambda h: probe_host(h, config), hosts))


@dataclass
class HostInfo:
    """The host section of `dynctl status`."""

    name: str
    route: str
    reachable: bool
    simulated: bool = False
    hostname: str | None = None
    python: str | None = None
    python_version: str | None = None
    sglang_version: str | None = None
    sglang_path: str | None = None
    strategy: str | None = None
    strategy_note: str | None = None
    workdir: dict[str, Any] = field(default_factory=dict)
    nvidia_smi: str | None = None
    psutil: bool = False
    port: int | None = None
    port_listeners: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe_host(host: HostConfig, agent: AgentClient) -> HostInfo:
    raw = agent.call("inspect")
    sglang = raw.get("sglang") or {}
    info = HostInfo(
        name=host.name,
        route=host.route,
        reachable=True,
        simulated=host.simulated,
        hostname=raw.get("hostname"),
        python=raw.get("python"),
        python_version=raw.get("python_version"),
        sglang_version=sglang.get("version"),
        sglang_path=sglang.get("package_dir"),
        workdir=raw.get("workdir") or {},
        nvidia_smi=raw.get("nvidia_smi"),
        psutil=bool(raw.get("psutil")),
        port=raw.get("port"),
        port_listeners=raw.get("port_listeners") or [],
    )
    info.strategy, info.strategy_note = classify_sglang(info.sglang_version, bool(sglang), host.strategy)
    return info


def classify_sglang(version: str | None, installed: bool, preference: str = "auto") -> tuple[str, str | None]:
    """('patch'|'native'|'unsupported'|'absent', why) for the sglang found on the host, under the host's
    `strategy` preference."""
    if not installed:
        return "absent", "sglang is not installed for this interpreter"
    if not version:
        return "unsupported", "sglang is installed but its version could not be read"
    from dynctl.patching import strategy_for
    from dynctl.patching.versions import strategy_note

    try:
        strategy = strategy_for(version, preference)
        return strategy, strategy_note(version, strategy)
    except DynctlError as err:
        return "unsupported", str(err)
