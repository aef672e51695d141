"""`dynctl demo`: a local simulated GPU host, a deploy of threshold 5, and a load ramp that crosses it (UI-free).

The story, as events: prepare the host (pristine sglang 0.5.9 from PyPI, the simulator, a fake nvidia-smi),
register it as host `demo` in the user's config, start the pristine server, deploy threshold 5 through
the real deploy path, then drive 1 → 64 → 1 concurrent streams so speculation turns off and on again.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit

from dynctl.core import deploy as core
from dynctl.base import events
from dynctl.agent.client import AgentClient, open_agent
from dynctl.base.config import Config, HostConfig, find_config_path, load_config, user_config_path
from dynctl.base.configedit import keep_trailing_lines
from dynctl.base.errors import ConfigError
from dynctl.core.lifecycle import find_server, restart_server, server_argv

DEMO_HOST = "demo"
RAMP = (1, 2, 4, 8, 16, 32, 64, 32, 16, 8, 4, 2, 1)


def demo_root() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "dynctl" / "demo"


def _toml_value(value: Any) -> Any:
    """`value` as tomlkit writes it: tables of the entry (env) inline, as an operator writes them."""
    if isinstance(value, dict):
        table = tomlkit.inline_table()
        table.update({k: _toml_value(v) for k, v in value.items()})
        return table
    if isinstance(value, (list, tuple)):
        return [_toml_value(v) for v in value]
    return value


def _replace_items(table: Any, values: dict[str, Any]) -> None:
    """Make `table` hold exactly `values`, keeping its comments and, for a sub-table, its own layout."""
    for key in [k for k in table if k not in values]:
        del table[key]
    for key, value in values.items():
        old = table.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and not isinstance(old, tomlkit.items.InlineTable):
            _replace_items(old, value)
        else:
            table[key] = _toml_value(value)


def register_tables(tables: dict[str, dict[str, Any]], comment: str, config_path: str | None = None,
                    default_host: str | None = None) -> Path:
    """Put each table of `tables` ("hosts.demo" or "groups.NAME": its entry) into the user's config,
    creating the file if needed (with `default_host` then); an existing table is replaced.

    Edited as a TOML document (tomlkit), so the operator's comments, order and other tables stay as they were.
    """
    path = find_config_path(config_path) if config_path or os.environ.get("DYNCTL_CONFIG") else None
    if path is None:
        path = user_config_path()
    text = path.read_text() if path.exists() else ""
    if text:
        load_config(path)  # refuse to touch a config that does not parse (ConfigError names it)
    doc = tomlkit.parse(text) if text else tomlkit.document()
    if not text and default_host:
        doc.add("default_host", default_host)
        doc.add(tomlkit.nl())
    for dotted, entry in tables.items():
        kind, _, name = dotted.partition(".")
        parent = doc.get(kind)
        if parent is None:
            parent = tomlkit.table(is_super_table=True)
            doc.add(kind, parent)
        if name in parent:  # updated in place, the lines that lead into the next section kept there
            with keep_trailing_lines(parent[name]):
                _replace_items(parent[name], entry)
        else:
            section = tomlkit.table()
            section.add(tomlkit.comment(comment))
            for key, value in entry.items():
                section.add(key, _toml_value(value))
            parent.add(name, section)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(tomlkit.dumps(doc))
    os.replace(tmp, path)
    cfg = load_config(path)
    for dotted in tables:
        kind, _, name = dotted.partition(".")
        if name not in getattr(cfg, kind):
            raise ConfigError(f"{path}: writing [{dotted}] failed")
    return path


def register_demo_host(entry: dict[str, Any], config_path: str | None = None) -> Path:
    """Add [hosts.demo] to the user's config (creating it if needed); an existing entry is replaced."""
    return register_tables({f"hosts.{DEMO_HOST}": entry},
                           "a SIMULATED GPU host made by `dynctl demo` (no GPU, no model)",
                           config_path, default_host=DEMO_HOST)


@dataclass
class DemoHost:
    config: Config
    host: HostConfig
    agent: AgentClient
    config_path: Path


def prepare(config_path: str | None = None, root: Path | None = None, port: int = 30000,
            time_scale: float = 1.0, on_event: events.EventSink = events.ignore) -> DemoHost:
    from dynctl.sim.hostsetup import prepare_demo_host

    root = root or demo_root()
    on_event(events.StepStarted("prepare", f"simulated GPU host in {root} (sglang 0.5.9 from PyPI)"))
    entry = prepare_demo_host(root, port=port, time_scale=time_scale)
    path = register_demo_host(entry, config_path)
    cfg = load_config(path)
    host = cfg.host(DEMO_HOST)
    agent = open_agent(host, cfg)
    taken = port_taken(agent, port)
    if taken is not None:
        entry["port"] = free_port()
        path = register_demo_host(entry, config_path)
        cfg = load_config(path)
        host = cfg.host(DEMO_HOST)
        agent = open_agent(host, cfg)
        on_event(events.Warning(f"port {port} is taken by {taken}, which the demo did not start: the demo leaves "
                                f"it alone and uses port {entry['port']} instead"))
    on_event(events.StepDone("prepare", 0.0, f"registered as host '{DEMO_HOST}' (port {entry['port']}) in {path}"))
    return DemoHost(cfg, host, agent, path)


def port_taken(agent: AgentClient, port: int) -> str | None:
    """What holds `port` that is not the demo's own server (ours by its pidfile in the demo's workdir), in
    words; None when the port is free or held by the demo's own server. The demo never signals anything else."""
    state = find_server(agent)
    if state.not_ours:
        return str(state.not_ours.get("text") or f"pid {state.not_ours.get('pid')}")
    if state.pid is None and not _bindable(port):
        return "a process the demo cannot see"
    return None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def deploy_threshold(demo: DemoHost, threshold: int = 5, on_event: events.EventSink = events.ignore) -> dict:
    """Start the demo from the pristine server, then deploy `threshold` through the real deploy path."""
    releases = core.list_releases(demo.agent)
    if any(r.get("state") == "applied" for r in releases):
        core.rollback(demo.agent, demo.host, to="baseline", on_event=on_event, grace=10)
    else:
        restart_server(demo.agent, server_argv(demo.host), grace=10, on_event=on_event)
    done = core.deploy_threshold(demo.agent, demo.host, threshold, on_event, grace=10)
    return done.result if done.result is not None else {"threshold_in_force": threshold, "noop": done.plan.noop}


@dataclass(frozen=True)
class RampLevel:
    concurrency: int
    output_throughput: float | None
    mean_batch: float | None
    spec_on_share: float | None
    errors: int


def load_ramp(agent: AgentClient, levels: tuple[int, ...] = RAMP, seconds: float = 4.5,
              stop: threading.Event | None = None) -> Iterator[RampLevel]:
    """Drive each concurrency for `seconds` with the bench load generator on the host; yield what it saw."""
    from dynctl.bench.stats import summarize_level

    for concurrency in levels:
        if stop is not None and stop.is_set():
            return
        raw: dict[str, Any] | None = None
        for item in agent.stream("bench_level", concurrency=concurrency, input_len=64, output_len=64,
                                 duration=seconds, warmup=0):
            if item.get("type") == "level":
                raw = item
        if raw is None:
            continue
        level = summarize_level(raw, input_len=64, duration_mode=True)
        server = level.get("server") or {}
        yield RampLevel(concurrency, level.get("output_throughput"), server.get("mean_batch_size"),
                        server.get("spec_on_share"), int(level.get("failed") or 0))


def story(demo: DemoHost, threshold: int, on_line: Callable[[str], None],
          on_event: events.EventSink = events.ignore, levels: tuple[int, ...] = RAMP, seconds: float = 4.5) -> int:
    """The whole demo as text (for --no-tui); returns the number of levels that saw speculation flip."""
    result = deploy_threshold(demo, threshold, on_event)
    on_line(f"threshold {result.get('threshold_in_force')} in force on the SIMULATED host '{DEMO_HOST}'")
    on_line(f"{'streams':>8} {'tok/s':>8} {'batch':>6}  speculation")
    flips = 0
    last = None
    for lvl in load_ramp(demo.agent, levels, seconds):
        state = "-" if lvl.spec_on_share is None else ("ON" if lvl.spec_on_share >= 0.5 else "OFF")
        if last is not None and state != last:
            flips += 1
        last = state
        share = "" if lvl.spec_on_share is None else f" ({lvl.spec_on_share:.0%} of steps speculated)"
        on_line(f"{lvl.concurrency:>8} {lvl.output_throughput or 0:>8.0f} {lvl.mean_batch or 0:>6.1f}  {state}{share}"
                + (f"  {lvl.errors} errors" if lvl.errors else ""))
    return flips
