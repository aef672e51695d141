"""Several hosts at once: what `--host GROUP` / `--hosts a,b` name, and read-only fan-out (UI-free)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from dynctl.agent.client import open_agent
from dynctl.base.config import Config, HostConfig
from dynctl.base.errors import DynctlError, UsageError
from dynctl.core.gateway import GatewayClient, Worker
from dynctl.base.groups import Gateway, expand, gateways_of

DEFAULT_CONCURRENCY = 16  # hosts contacted at once; each has one connection
# Hosts behind one SSH endpoint (containers on one Proxmox node) share its connection, and sshd refuses a
# connection's channels past MaxSessions (10 by default): at most this many of them at once.
PER_ENDPOINT = 8
T = TypeVar("T")
_slots: dict[tuple, threading.BoundedSemaphore] = {}
_slots_lock = threading.Lock()


@contextmanager
def endpoint_slot(host: HostConfig) -> Iterator[None]:
    """Hold one of the PER_ENDPOINT slots of the SSH endpoint `host` is reached through."""
    key = (host.ssh, host.identity_file)
    with _slots_lock:
        slot = _slots.setdefault(key, threading.BoundedSemaphore(PER_ENDPOINT))
    with slot:
        yield


@dataclass(frozen=True)
class Member:
    host: HostConfig
    gateways: tuple[Gateway, ...] = ()


@dataclass(frozen=True)
class Fleet:
    name: str  # the group, or the --hosts list as given
    members: tuple[Member, ...]

    @property
    def gateways(self) -> list[Gateway]:
        found: dict[str, Gateway] = {}
        for m in self.members:
            for g in m.gateways:
                found.setdefault(g.url, g)
        return list(found.values())


def fleet_target(config: Config, host: str | None, hosts: str | None) -> Fleet | None:
    """The fleet that `--host GROUP` or `--hosts a,b` names; None when the command is about one host."""
    if hosts is not None and host is not None:
        raise UsageError("--host and --hosts: give one of them (--host NAME or GROUP, --hosts a,b)")
    if hosts is None:
        if host is None or host not in config.groups:
            return None
        return Fleet(host, tuple(_member(config, n) for n in expand(host, config.groups)))
    names = [n.strip() for n in hosts.split(",")]
    if not any(names) or not all(names):
        raise UsageError(f"--hosts {hosts!r}: expected host or group names separated by commas, none empty")
    chosen: list[str] = []
    for name in names:
        if name in config.groups:
            found = expand(name, config.groups)
        elif name in config.hosts:
            found = [name]
        else:
            where = config.path or "config"
            raise UsageError(f"--hosts: no host or group named '{name}' in {where} (hosts: "
                             f"{', '.join(sorted(config.hosts)) or 'none'}; groups: "
                             f"{', '.join(sorted(config.groups)) or 'none'})")
        chosen += [n for n in found if n not in chosen]
    return Fleet(hosts, tuple(_member(config, n) for n in chosen))


def _member(config: Config, name: str) -> Member:
    return Member(config.hosts[name], gateways_of(name, config.groups))


def fan_out(items: list[Any], fn: Callable[[Any], T], concurrency: int = DEFAULT_CONCURRENCY) -> list[T]:
    """fn over items, at most `concurrency` at once, results in the order of items."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(items)))) as pool:
        return list(pool.map(fn, items))


@dataclass
class HostRow:
    """One host's line of `dynctl status --host GROUP`: what it answered, or why it did not."""

    host: str
    route: str
    ok: bool
    error: str | None = None
    exit_code: int = 0
    simulated: bool = False
    state: str | None = None
    release: str | None = None
    threshold: int | None = None
    batch_size: int | None = None
    queue: int | None = None
    speculation: bool | None = None
    gen_throughput: float | None = None
    gpu_count: int = 0
    gpu_mem_used_mib: float | None = None
    gpu_mem_total_mib: float | None = None
    worker_url: str = ""
    gateway: list[dict[str, Any]] = field(default_factory=list)  # per gateway: url, status, load (or error)
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def host_row(member: Member, config: Config) -> HostRow:
    """Sample one host over its own connection: server state, release, threshold, batch, tok/s, GPUs."""
    from dynctl.live.server_status import sample_server

    host = member.host
    row = HostRow(host.name, host.route, ok=False, simulated=host.simulated, worker_url=host.gateway_url)
    t0 = time.monotonic()
    try:
        with endpoint_slot(host):
            agent = open_agent(host, config)
            snap = sample_server(agent, host.simulated)
    except DynctlError as err:
        row.error, row.exit_code = str(err), err.exit_code
    else:
        row.ok = True
        row.state, row.release, row.threshold = snap.state, snap.release, snap.threshold
        row.batch_size, row.queue, row.speculation = snap.running_reqs, snap.queue_reqs, snap.speculation
        row.gen_throughput = snap.gen_throughput
        row.gpu_count = len(snap.gpus)
        if snap.gpus:
            row.gpu_mem_used_mib = sum(g.mem_used_mib or 0 for g in snap.gpus)
            row.gpu_mem_total_mib = sum(g.mem_total_mib or 0 for g in snap.gpus)
    row.elapsed_s = round(time.monotonic() - t0, 3)
    return row


@dataclass
class GatewayView:
    gateway: Gateway
    workers: list[Worker] | None = None
    error: str | None = None
    exit_code: int = 0


def read_gateway(gateway: Gateway) -> GatewayView:
    try:
        client = GatewayClient(gateway, timeout=5)
        try:
            return GatewayView(gateway, client.workers())
        finally:
            client.close()
    except DynctlError as err:
        return GatewayView(gateway, error=str(err), exit_code=err.exit_code)


def fleet_status(fleet: Fleet, config: Config, concurrency: int = DEFAULT_CONCURRENCY
                 ) -> tuple[list[HostRow], list[GatewayView]]:
    """Every host and every gateway at once (hosts bounded by `concurrency`); nothing is changed."""
    jobs: list[Any] = [("gw", g) for g in fleet.gateways] + [("host", m) for m in fleet.members]

    def run(job: tuple[str, Any]) -> Any:
        kind, what = job
        return read_gateway(what) if kind == "gw" else host_row(what, config)

    results = fan_out(jobs, run, concurrency + len(fleet.gateways))
    views = [r for r in results if isinstance(r, GatewayView)]
    rows = [r for r in results if isinstance(r, HostRow)]
    by_url = {v.gateway.url: v for v in views}
    for row, member in zip(rows, fleet.members):
        for g in member.gateways:
            view = by_url[g.url]
            if view.workers is None:
                row.gateway.append({"gateway": g.url, "status": None, "load": None, "error": view.error})
                continue
            worker = next((w for w in view.workers if w.url == row.worker_url), None)
            row.gateway.append({"gateway": g.url, "status": worker.status if worker else "not registered",
                                "load": worker.load if worker else None})
    return rows, views


def status_exit_code(rows: list[HostRow], views: list[GatewayView]) -> int:
    """0 when every host and gateway answered; else the highest exit code among those that did not."""
    codes = [r.exit_code for r in rows if not r.ok] + [v.exit_code for v in views if v.error]
    return max(codes, default=0)
