"""`dynctl hosts` and `dynctl status`."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.table import Table

from dynctl.cli.common import ConfigOpt, HostOpt, JsonOpt, console, handle_errors, open_host
from dynctl.config import load_config
from dynctl.errors import DynctlError
from dynctl.inventory import HostInfo, describe_host, probe_hosts

# Filled in by later features (server state, metrics, GPUs): each adds a section to the status dict.
STATUS_SECTIONS: list[Any] = []


def register(app: typer.Typer) -> None:
    app.command("hosts")(hosts)
    app.command("status")(status)


@handle_errors
def hosts(
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Each configured host: reachable?, via what, agent round-trip latency."""
    cfg = load_config(config)
    results = probe_hosts(cfg)
    if as_json:
        console.print_json(json.dumps([r.to_dict() for r in results]))
    else:
        table = Table("host", "via", "reachable", "latency", "note", box=None, pad_edge=False)
        for r in results:
            note = r.error or ("simulated" if r.simulated else "")
            table.add_row(
                r.name,
                r.route,
                "[green]yes[/]" if r.reachable else "[red]no[/]",
                f"{r.latency_ms:.1f} ms" if r.latency_ms is not None else "-",
                note,
            )
        console.print(table)
    if any(not r.reachable for r in results):
        raise typer.Exit(max(r.exit_code for r in results if not r.reachable))


@handle_errors
def status(
    host: str = HostOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """One screen: host, sglang version and path, strategy, patch state, server state, GPUs."""
    session = open_host(host, config)
    info = describe_host(session.host, session.agent)
    report: dict[str, Any] = {"host": info.to_dict()}
    for section in STATUS_SECTIONS:
        try:
            report.update(section(session, info))
        except DynctlError as err:
            report.setdefault("warnings", []).append(str(err))
    if as_json:
        console.print_json(json.dumps(report, default=str))
        return
    render_host(info)
    for warning in report.get("warnings", []):
        console.print(f"[yellow]warning:[/] {warning}")


def render_host(info: HostInfo) -> None:
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    label = f"{info.name}  [dim]({info.route})[/]" + ("  [magenta]SIMULATED[/]" if info.simulated else "")
    table.add_row("host", label)
    table.add_row("reachable", "[green]yes[/]" + (f"  hostname {info.hostname}" if info.hostname else ""))
    table.add_row("python", f"{info.python} ({info.python_version})")
    if info.sglang_version or info.sglang_path:
        table.add_row("sglang", f"{info.sglang_version or '?'}  {info.sglang_path}")
    else:
        table.add_row("sglang", "[yellow]not installed[/] for this interpreter")
    strategy = info.strategy or "-"
    if info.strategy_note:
        strategy += f"  [dim]{info.strategy_note}[/]"
    table.add_row("strategy", strategy)
    wd = info.workdir
    free = wd.get("free_bytes")
    wd_line = f"{wd.get('path')}  " + ("exists" if wd.get("exists") else "not created yet")
    wd_line += "" if wd.get("writable") else "  [red]NOT WRITABLE[/]"
    if free is not None:
        wd_line += f"  {free / 2**30:.1f} GiB free"
    table.add_row("workdir", wd_line)
    table.add_row("nvidia-smi", info.nvidia_smi or "[dim]absent[/]")
    listeners = ", ".join(f"pid {p['pid']} ({' '.join(p.get('cmdline') or [])[:60]})" for p in info.port_listeners)
    table.add_row("port", f"{info.port}  " + (listeners or "[dim]nothing listening[/]"))
    console.print(table)
