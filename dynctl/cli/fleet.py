"""The fan-out forms of status, releases, threshold, deploy and rollback (`--host GROUP`, `--hosts a,b`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from dynctl.core import deploy as core
from dynctl.core import fleet as fleet_core
from dynctl.core import rollout as rollout_core
from dynctl.base import sglang
from dynctl.agent.client import open_agent
from dynctl.cli.common import console, err_console
from dynctl.base.config import Config, load_config
from dynctl.base.errors import DynctlError, Interrupted
from dynctl.core.fleet import Fleet, HostRow
from dynctl.patching import parse_threshold

HostsOpt = typer.Option(None, "--hosts", help="Several hosts at once: host or group names separated by commas.")
ConcurrencyOpt = typer.Option(fleet_core.DEFAULT_CONCURRENCY, "--concurrency", min=1, max=256,
                              help="With a group: how many hosts are contacted at once.")


def target(host: str | None, hosts: str | None, config_path: str | None) -> tuple[Config, Fleet] | None:
    """The config and fleet named by --host GROUP / --hosts, or None for a one-host command."""
    if hosts is None and host is None:
        return None
    config = load_config(config_path)
    fleet = fleet_core.fleet_target(config, host, hosts)
    return None if fleet is None else (config, fleet)


def _num(value: Any, spec: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}"


def _gateway_cell(row: HostRow) -> str:
    if not row.gateway:
        return "[dim]none[/]"
    cells = []
    for g in row.gateway:
        if g.get("error"):
            cells.append("[red]unreachable[/]")
        else:
            colour = "green" if g["status"] == "ready" else "yellow"
            cells.append(f"[{colour}]{g['status']}[/] load {_num(g['load'])}")
    return ", ".join(cells)


def status(found: tuple[Config, Fleet], as_json: bool, concurrency: int) -> None:
    config, fleet = found
    rows, views = fleet_core.fleet_status(fleet, config, concurrency)
    code = fleet_core.status_exit_code(rows, views)
    if as_json:
        doc = {"fleet": fleet.name, "hosts": [r.to_dict() for r in rows],
               "gateways": [{"url": v.gateway.url, "group": v.gateway.group, "error": v.error,
                             "workers": None if v.workers is None else len(v.workers)} for v in views],
               "all_answered": code == 0}
        console.print_json(json.dumps(sglang.redact(doc), default=str))
        raise typer.Exit(code)
    table = Table("host", "state", "release", "threshold", "batch", "spec", "tok/s", "GPUs", "gateway",
                  box=None, pad_edge=False, title=f"fleet {fleet.name}", title_justify="left")
    for r in rows:
        name = r.host + (" [magenta]SIM[/]" if r.simulated else "")
        if not r.ok:
            table.add_row(name, "[red]no answer[/]", "", "", "", "", "", "", _gateway_cell(r))
            continue
        colour = {"ready": "green", "starting": "yellow", "draining": "yellow"}.get(r.state or "", "red")
        spec = "-" if r.speculation is None else ("[green]ON[/]" if r.speculation else "[yellow]OFF[/]")
        gpus = "-" if not r.gpu_count else (f"{r.gpu_count} × {(r.gpu_mem_used_mib or 0) / 1024:.0f}/"
                                            f"{(r.gpu_mem_total_mib or 0) / 1024:.0f} GiB")
        table.add_row(name, f"[{colour}]{r.state}[/]", (r.release or "baseline")[:24], _num(r.threshold),
                      f"{_num(r.batch_size)}+{_num(r.queue)}", spec, _num(r.gen_throughput, ".0f"), gpus,
                      _gateway_cell(r))
    console.print(table)
    for r in rows:
        if not r.ok:
            err_console.print(f"[bold red]{escape(r.host)}:[/] {escape(r.error or '')}", soft_wrap=True)
    for v in views:
        if v.error:
            err_console.print(f"[bold red]gateway:[/] {escape(v.error)}", soft_wrap=True)
    answered = sum(r.ok for r in rows)
    console.print(f"[dim]{answered} of {len(rows)} hosts answered[/]")
    raise typer.Exit(code)


def releases(found: tuple[Config, Fleet], as_json: bool, concurrency: int) -> None:
    config, fleet = found

    def read(member: fleet_core.Member) -> dict[str, Any]:
        try:
            with fleet_core.endpoint_slot(member.host):
                agent = open_agent(member.host, config)
                return {"host": member.host.name, "releases": core.list_releases(agent)}
        except DynctlError as err:
            return {"host": member.host.name, "error": str(err), "exit_code": err.exit_code}

    results = fleet_core.fan_out(list(fleet.members), read, concurrency)
    code = max((r.get("exit_code", 0) for r in results), default=0)
    if as_json:
        console.print_json(json.dumps(sglang.redact({"fleet": fleet.name, "hosts": results}), default=str))
        raise typer.Exit(code)
    table = Table("host", "release in force", "threshold", "sglang", "releases", box=None, pad_edge=False,
                  title=f"fleet {fleet.name}", title_justify="left")
    for r in results:
        if "error" in r:
            table.add_row(r["host"], "[red]no answer[/]", "", "", "")
            continue
        items = r["releases"]
        current = next((m for m in items if m.get("state") == "applied"), None)  # newest first
        table.add_row(r["host"], current["id"] if current else "baseline",
                      _num(current.get("threshold")) if current else "-",
                      (current or {}).get("sglang_version") or "-", str(len(items)))
    console.print(table)
    for r in results:
        if "error" in r:
            err_console.print(f"[bold red]{escape(r['host'])}:[/] {escape(r['error'])}", soft_wrap=True)
    raise typer.Exit(code)


def threshold(value: str, found: tuple[Config, Fleet], yes: bool, as_json: bool, concurrency: int) -> None:
    """The live change on every host at once (no restart): one confirmation, a row per host."""
    from dynctl.cli.common import confirm

    number = parse_threshold(value, "threshold")
    config, fleet = found
    names = ", ".join(m.host.name for m in fleet.members)
    confirm(f"Set the live threshold to {number} on {len(fleet.members)} hosts of {fleet.name} ({names})?", yes)

    def change(member: fleet_core.Member) -> dict[str, Any]:
        try:
            with fleet_core.endpoint_slot(member.host):
                agent = open_agent(member.host, config)
                return {"host": member.host.name, **core.set_threshold(agent, number)}
        except DynctlError as err:
            return {"host": member.host.name, "error": str(err), "exit_code": err.exit_code}

    results = fleet_core.fan_out(list(fleet.members), change, concurrency)
    failed = [r for r in results if "error" in r]
    code = 0 if not failed else (1 if len(failed) < len(results) else max(r["exit_code"] for r in failed))
    if as_json:
        console.print_json(json.dumps({"fleet": fleet.name, "hosts": results}, default=str))
        raise typer.Exit(code)
    table = Table("host", "threshold in force", "note", box=None, pad_edge=False)
    for r in results:
        if "error" in r:
            table.add_row(r["host"], "[red]unchanged?[/]", escape(r["error"]))
        else:
            table.add_row(r["host"], _num(r.get("in_force")), "")
    console.print(table)
    raise typer.Exit(code)


MaxUnavailableOpt = typer.Option(1, "--max-unavailable", min=1, max=1024,
                                 help="With a group: how many hosts are out of the gateway at once.")
CanaryOpt = typer.Option(0, "--canary", min=0, max=1024,
                         help="With a group: roll this many hosts first, then pause (asks on a TTY; --yes goes on).")
DrainOpt = typer.Option(rollout_core.DEFAULT_DRAIN_S, "--drain", min=1, max=3600,
                        help="With a gateway: seconds its in-flight requests get (the longest request) before the "
                             "worker is removed.")


def go_on(question: str, yes: bool) -> bool:
    """The canary pause: --yes goes on; on a TTY the operator's answer; without one, stop there."""
    if yes:
        return True
    if not sys.stdin.isatty():
        err_console.print(f"{question.rstrip('?')}: stopping here without --yes (stdin is not a terminal)",
                          soft_wrap=True)
        return False
    return typer.confirm(question, default=False)


def rolling(action: str, target_value: Any, found: tuple[Config, Fleet], *, yes: bool, dry_run: bool, grace: float,
            ready_timeout: float, soak: float, drain: float, max_unavailable: int, canary: int, as_json: bool,
            verbose: bool) -> None:
    """`deploy` / `rollback` with a group: a rolling operation, then a table host by host (exit 1 on a failure)."""
    from dynctl.cli.common import confirm
    from dynctl.cli.progress import EventPrinter

    config, fleet = found
    operation = rollout_core.RollingOperation(
        config, fleet, action, target_value, on_event=EventPrinter(quiet=as_json, verbose=verbose),
        confirm=lambda question: confirm(question, yes), grace=grace, ready_timeout=ready_timeout, soak=soak,
        drain=drain, max_unavailable=max_unavailable, canary=canary)
    try:
        if dry_run:
            plans = operation.preflight()
            doc = [{"host": p.member.host.name, "gateways": [g.url for g in p.member.gateways],
                    **(p.plan.to_json() if p.plan else {})} for p in plans]
            if as_json:
                console.print_json(json.dumps(sglang.redact({"fleet": fleet.name, "hosts": doc})))
            else:
                for d in doc:
                    via = ", ".join(d["gateways"]) or "no gateway (no drain)"
                    console.print(f"[bold]{escape(d['host'])}[/]: {escape(d.get('noop') or action)}  [dim]via {via}[/]")
                console.print("[dim]dry run: nothing was changed[/]")
            return
        try:
            record, results = operation.run(lambda question: go_on(question, yes))
        except KeyboardInterrupt:
            if operation.record is None:
                raise
            raise Interrupted(f"rollout {operation.record.id} of {fleet.name} interrupted: the host operation in "
                              "progress goes on on its host; run the same command again to finish the rollout (the "
                              "host in the middle first, and back in its gateway)") from None
    finally:
        operation.close()
    code = rollout_core.exit_code(results, record.state)
    if as_json:
        console.print_json(json.dumps({"rollout": record.id, "fleet": fleet.name, "state": record.state,
                                       "hosts": [r.__dict__ for r in results]}, default=str))
        raise typer.Exit(code)
    table = Table("host", "outcome", "drain", "operation", "gateway", "note", box=None, pad_edge=False,
                  title=f"rollout {record.id} ({fleet.name}): {record.state}", title_justify="left")
    for r in results:
        colour = {"failed": "red", "untouched": "dim", "unchanged": "green"}.get(r.outcome, "green")
        table.add_row(r.host, f"[{colour}]{r.outcome}[/]", f"{r.drain_s:.1f} s" if r.drain_s else "-",
                      f"{r.operation_s:.1f} s" if r.operation_s else "-",
                      f"{r.register_s:.1f} s" if r.register_s else "-", escape(r.detail[:160]))
    console.print(table)
    if record.state == "stopped":
        left = ", ".join(r.host for r in results if r.outcome == "untouched")
        console.print(f"stopped at the canary pause: {escape(left)} untouched; the same command goes on from here "
                      "(hosts already on the target are skipped)", soft_wrap=True)
    raise typer.Exit(code)


def list_rollouts(fleet_name: str | None, limit: int, as_json: bool) -> None:
    """The rolling operations started from this client (newest first): id, fleet, what, state, per host."""
    records = [r for r in rollout_core.list_rollouts() if fleet_name is None or r.fleet == fleet_name][:limit]
    if as_json:
        console.print_json(json.dumps([r.__dict__ for r in records], default=str))
        return
    if not records:
        console.print(f"no rollouts{f' of {escape(fleet_name)}' if fleet_name else ''} from this client yet")
        return
    table = Table(box=None)
    table.add_column("rollout", no_wrap=True, min_width=max(len(r.id) for r in records))
    for name in ("fleet", "action", "target", "started", "state", "hosts"):
        table.add_column(name, overflow="fold")
    for r in records:
        hosts = ", ".join(f"{h} {s}" for h, s in r.hosts.items())
        table.add_row(r.id, r.fleet, r.action, r.target, r.started[:19], r.state, hosts)
    console.print(table)


def gateway_reader(fleet: Fleet) -> Callable[[], dict[str, dict[str, Any]]]:
    """host -> its entry in the first of its gateways ({"status", "load"}, or {"error"}), read on each call."""

    def read() -> dict[str, dict[str, Any]]:
        views = {v.gateway.url: v for v in fleet_core.fan_out(fleet.gateways, fleet_core.read_gateway)}
        rows: dict[str, dict[str, Any]] = {}
        for m in fleet.members:
            if not m.gateways:
                continue
            view = views[m.gateways[0].url]
            if view.workers is None:
                rows[m.host.name] = {"error": view.error}
                continue
            worker = next((w for w in view.workers if w.url == m.host.gateway_url), None)
            rows[m.host.name] = ({"status": worker.status, "load": worker.load} if worker
                                 else {"status": "not registered", "load": None})
        return rows

    return read


def run_fleet_screen(cfg: Config, group: str, read_only: bool = False, interval: float = 1.0) -> None:
    """`dynctl tui --host GROUP`: the fleet screen over the one-host dashboards."""
    from dynctl.live.feed import LiveFeed
    from dynctl.actions.host import actions_for
    from dynctl.tui.fleet import create_fleet_app

    fleet = fleet_core.fleet_target(cfg, group, None)
    assert fleet is not None
    hosts = [m.host for m in fleet.members]

    def rollout(action: str, arg: Any, on_event: Callable[[Any], None]) -> list[Any]:
        operation = rollout_core.RollingOperation(cfg, fleet, action, arg, on_event=on_event)
        try:
            return operation.run(lambda question: True)[1]  # the screen's dialog was the confirmation
        finally:
            operation.close()

    app = create_fleet_app(group, [h.name for h in hosts],
                           lambda on_update: LiveFeed(hosts, on_update, config=cfg, interval=interval),
                           actions=actions_for(cfg, hosts), gateways=gateway_reader(fleet) if fleet.gateways else None,
                           rollout=rollout, read_only=read_only, interval=interval)
    app.run()


def demo_fleet(count: int, config_path: str | None, threshold: int, time_scale: float, no_tui: bool) -> None:
    """`dynctl demo --fleet N`: the fleet, a rolling deploy of `threshold` through its gateway, then the screen."""
    import sys
    import threading

    from dynctl.actions import demo_fleet as core_fleet
    from dynctl.cli.progress import EventPrinter
    from dynctl.base.errors import UsageError

    if not 1 <= count <= core_fleet.MAX_FLEET:
        raise UsageError(f"--fleet: expected 1-{core_fleet.MAX_FLEET} hosts, got {count}")
    if not time_scale > 0:
        raise UsageError(f"--time-scale: expected a number above 0, got {time_scale:g}")
    if not no_tui and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("the demo opens the TUI, which needs a terminal; use `dynctl demo --fleet N --no-tui`")
    printer = EventPrinter(quiet=False)
    console.print(f"[bold magenta]dynctl demo --fleet {count}[/] — {count} [bold]SIMULATED[/] SGLang servers on "
                  "127.0.0.1 (no GPU, no model)" + (" behind a real smg gateway" if core_fleet.smg_binary() else ""))
    made = core_fleet.prepare(count, config_path, time_scale=time_scale, on_event=printer)
    stop = threading.Event()
    if made.gateway:
        core_fleet.drive_load(made.gateway, stop)
    try:
        results = core_fleet.rolling_deploy(made, threshold, printer)
        table = Table("host", "outcome", "drain", "operation", "gateway", box=None, pad_edge=False)
        for r in results:
            table.add_row(r.host, r.outcome, f"{r.drain_s:.1f} s", f"{r.operation_s:.1f} s", f"{r.register_s:.1f} s")
        console.print(table)
        if no_tui:
            fleet = fleet_core.fleet_target(made.config, core_fleet.GROUP, None)
            assert fleet is not None  # the demo registered the group
            rows, views = fleet_core.fleet_status(fleet,
                                                  made.config)
            for row in rows:
                gw = ", ".join(f"{g['status']} load {g['load']}" for g in row.gateway) or "no gateway"
                console.print(f"{row.host}: {row.state}, threshold {row.threshold}, {gw}")
        else:
            run_fleet_screen(made.config, core_fleet.GROUP)
    finally:
        stop.set()
    console.print(f"The demo fleet keeps running: `dynctl status --host {core_fleet.GROUP}`, "
                  f"`dynctl tui --host {core_fleet.GROUP}`; `dynctl stop --host demo-N --yes` ends a server, and the "
                  f"gateway's pid is in {core_fleet.fleet_root() / 'smg.pid'}.")
