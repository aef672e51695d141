"""`dynctl hosts` and `dynctl status`."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from dynctl.base import sglang
from dynctl.cli import fleet as fleet_cli
from dynctl.cli.common import ConfigOpt, HostOpt, JsonOpt, console, handle_errors, open_host
from dynctl.cli.tables import print_rich_table, print_table
from dynctl.base.config import load_config
from dynctl.base.errors import DynctlError
from dynctl.core.inventory import HostInfo, describe_host, probe_hosts
from dynctl.live.server_status import server_section



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
        console.print_json(json.dumps(sglang.redact([r.to_dict() for r in results])))
    else:
        rows = [(r.name, r.route, "yes" if r.reachable else "no",
                 f"{r.latency_ms:.1f} ms" if r.latency_ms is not None else "-", r.error or ("simulated" if r.simulated else ""))
                for r in results]
        print_table(console, ("host", "via", "reachable", "latency", "note"), rows, no_wrap=("host",))
    if any(not r.reachable for r in results):
        raise typer.Exit(max(r.exit_code for r in results if not r.reachable))


@handle_errors
def status(
    host: str = HostOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
    hosts: str = fleet_cli.HostsOpt,
    concurrency: int = fleet_cli.ConcurrencyOpt,
) -> None:
    """One screen: host, sglang version and path, strategy, patch state, server state, GPUs (a group: a row each)."""
    if found := fleet_cli.target(host, hosts, config):
        return fleet_cli.status(found, as_json, concurrency)
    session = open_host(host, config)
    info = describe_host(session.host, session.agent)
    report: dict[str, Any] = {"host": info.to_dict()}
    if info.sglang_version:
        try:
            report.update(server_section(session.agent, session.host.simulated))
        except DynctlError as err:
            report.setdefault("warnings", []).append(str(err))
    if as_json:
        console.print_json(json.dumps(sglang.redact(report), default=str))
        return
    render_host(info)
    if "server" in report:
        render_server(report["patch"], report["server"])
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
    listeners = ", ".join(f"pid {p['pid']} ({' '.join(sglang.redact_argv(p.get('cmdline') or []))[:60]})"
                          for p in info.port_listeners)
    table.add_row("port", f"{info.port}  " + (listeners or "[dim]nothing listening[/]"))
    print_rich_table(console, table)


def _fmt(value: Any, spec: str = "", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _provenance(reading: dict[str, Any] | None) -> str:
    """ "  (from /v1/loads)", "  [STALE: gauge 42 s old]": where a live number came from, and a stale one said."""
    if not reading:
        return ""
    where = {"counter": "generation_tokens_total rate", "metrics": "gauge"}.get(reading["source"], reading["source"])
    if reading.get("stale"):
        return f"  [bold yellow]STALE: {where} {reading['age_s']:.0f} s old[/]"
    age = f", {reading['age_s']:.0f} s old" if reading.get("age_s") else ""
    return f"  [dim](from {where}{age})[/]"


def render_server(patch: dict[str, Any], server: dict[str, Any]) -> None:
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("patch", f"{patch['status']}  [dim]{patch['detail']}[/]")
    table.add_row("release", patch.get("current_release") or "none (baseline)")
    state = server["state"]
    colour = {"ready": "green", "starting": "yellow", "draining": "yellow"}.get(state, "red")
    line = f"[{colour}]{state}[/]"
    if server.get("pid"):
        line += f"  pid {server['pid']}"
    if server.get("uptime_s") is not None:
        line += f"  up {server['uptime_s']:.0f} s"
    if server.get("operation"):
        line += f"  [yellow]{server['operation']}[/]"
    table.add_row("server", line)
    if server.get("leftovers"):
        table.add_row("", f"[yellow]leftovers of the previous server: pids "
                          f"{', '.join(map(str, server['leftovers']))}[/]  [dim](`dynctl stop` sweeps them)[/]")
    if server.get("not_ours"):
        table.add_row("", f"[yellow]not ours:[/] {escape(server['not_ours'])}  [dim](dynctl leaves it alone)[/]")
    live = server.get("threshold")
    sources = server.get("sources") or {}
    answered = (sources.get("threshold") or {}).get("age_s") is not None  # /server_info answered in this run
    threshold = (_fmt(live) if live is not None else
                 "[dim]unknown[/]" if server.get("state") == "down" else
                 "[dim]none reported by /server_info[/]" if answered else
                 "[yellow]unknown: /server_info did not answer[/]")
    if server.get("release_threshold") is not None and server.get("release_threshold") != live:
        threshold += (f"  [yellow](differs from release {server.get('release')}: {server['release_threshold']}; "
                      f"a restart goes back to it unless --keep-live-threshold)[/]" if live is not None else
                      f"  [dim](release {server.get('release')} recorded {server['release_threshold']})[/]")
    if live is not None and (sources.get("threshold") or {}).get("source") == "metrics":
        threshold += "  [yellow](from the gauge, written at the last decode step: a live change since is not in it)[/]"
    elif live is not None:
        threshold += _provenance(sources.get("threshold"))
    table.add_row("threshold", threshold)
    table.add_row("batch size", f"{_fmt(server.get('batch_size'))} running, {_fmt(server.get('queue'))} queued"
                                f"{_provenance(sources.get('running_reqs'))}")
    spec = server.get("speculation")
    spec_text = "[dim]unknown[/]" if spec is None else ("[green]ON[/]" if spec else "[yellow]OFF[/]")
    switch = server.get("last_switch")
    if switch and switch.get("batch_size") is not None:
        spec_text += f"  [dim](last switch at batch {switch['batch_size']})[/]"
    elif switch:
        spec_text += "  [dim](last switch seen in the metrics gauge; its log line not read yet)[/]"
    table.add_row("speculation", spec_text)
    table.add_row("throughput", f"{_fmt(server.get('gen_throughput'), '.1f')} tok/s"
                                f"{_provenance(sources.get('gen_throughput'))}, accept length "
                                f"{_fmt(server.get('accept_length'), '.2f')}")
    gpus = server.get("gpus") or []
    if gpus:
        used = sum((g.get("mem_used_mib") or 0) for g in gpus)
        total = sum((g.get("mem_total_mib") or 0) for g in gpus)
        util = [g["util_pct"] for g in gpus if g.get("util_pct") is not None]
        mean = sum(util) / len(util) if util else None
        table.add_row("GPUs", f"{len(gpus)} × {gpus[0].get('name')}, {used / 1024:.0f}/{total / 1024:.0f} GiB used, "
                              f"mean util {_fmt(mean, '.0f', '%')}")
    elif server.get("gpu_error"):
        table.add_row("GPUs", f"[dim]{server['gpu_error']}[/]")
    if server.get("spec_warning"):
        table.add_row("warning", f"[yellow]{server['spec_warning']}[/]")
    print_rich_table(console, table)
