"""`dynctl stop|start|restart|logs`: the server lifecycle of SPEC §5 on its own."""

from __future__ import annotations

import json
import re
from typing import Any

import typer
from rich.markup import escape

from dynctl import events, lifecycle
from dynctl.cli.common import (
    ConfigOpt,
    HostOpt,
    JsonOpt,
    VerboseOpt,
    YesOpt,
    confirm,
    console,
    err_console,
    handle_errors,
    open_host,
)
from dynctl.errors import PreflightError

GraceOpt = typer.Option(60.0, "--grace", min=0, help="Seconds the server may drain after SIGTERM before SIGKILL.")
ReadyTimeoutOpt = typer.Option(900.0, "--ready-timeout", min=1,
                               help="Seconds to wait for /health_generate and one real /generate.")


def register(app: typer.Typer) -> None:
    app.command("stop")(stop)
    app.command("start")(start)
    app.command("restart")(restart)
    app.command("logs")(logs)


class EventPrinter:
    """Renders lifecycle events: one line per step with its elapsed time, log lines dimmed.

    quiet (--json): only warnings and failures, on stderr, so stdout stays one JSON document.
    """

    # Server log lines worth a line of their own without --verbose; the rest scroll by in the journal.
    NOTABLE = re.compile(r"Traceback|Error|error:|WARNING|fired up and ready|Speculation (en|dis)abled|not armed"
                         r"|never fires|release |server pid|stopped|swept |Uvicorn running")

    def __init__(self, quiet: bool = False, verbose: bool = False) -> None:
        self.quiet = quiet
        self.verbose = verbose
        self.out = err_console if quiet else console

    def __call__(self, event: events.Event) -> None:
        if isinstance(event, events.StepStarted):
            if not self.quiet:
                console.print(f"[bold cyan]→[/] {event.step:<6} [dim]{escape(event.detail)}[/]", soft_wrap=True)
        elif isinstance(event, events.StepDone):
            if not self.quiet:
                console.print(f"[green]✓[/] {event.step:<6} {event.elapsed:6.2f} s  {escape(event.detail)}",
                              soft_wrap=True)
        elif isinstance(event, events.LogLine):
            if not self.quiet and (self.verbose or self.NOTABLE.search(event.text)):
                console.print(f"  [dim]│ {escape(event.text)}[/]", soft_wrap=True)
        elif isinstance(event, events.Warning):
            self.out.print(f"[yellow]![/] {escape(event.text)}", soft_wrap=True)
        elif isinstance(event, events.Failed):
            for line in event.log_tail:
                self.out.print(f"  [red]│[/] {escape(line)}", soft_wrap=True)
            self.out.print(f"[bold red]✗[/] {event.step:<6} {escape(event.message)}", soft_wrap=True)


def _describe(state: lifecycle.ServerState) -> str:
    if state.pid is None:
        return "down"
    up = f", up {state.uptime_s:.0f} s" if state.uptime_s is not None else ""
    return f"{state.state}, pid {state.pid} (found by {state.source}{up})"


def _print_json(obj: Any) -> None:
    console.print_json(json.dumps(obj, default=str))


@handle_errors
def stop(
    host: str = HostOpt,
    config: str = ConfigOpt,
    grace: float = GraceOpt,
    pid: int = typer.Option(None, "--pid", min=1,
                            help="Stop this process although dynctl did not start it: an sglang server for this "
                                 "host's port that dynctl found only by its command line (asks first)."),
    yes: bool = YesOpt,
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Stop the server: SIGTERM, drain, SIGKILL after --grace, sweep its processes, wait for port and GPU."""
    session = open_host(host, config)
    state = lifecycle.find_server(session.agent)
    printer = EventPrinter(quiet=as_json, verbose=verbose)
    if pid is not None:
        target = _named_process(state, pid)
        confirm(f"Stop pid {pid} on {session.host.name} ({_cmd(target)}), which dynctl "
                f"{'started' if pid == state.pid and state.source == 'pidfile' else 'did not start'}?", yes)
        result = lifecycle.stop_server(session.agent, grace, on_event=printer, pid=pid, pid_start=target.get("start"))
        if as_json:
            _print_json(result)
        return
    if state.pid is None and not state.leftovers:
        not_ours = state.not_ours or {}
        if not_ours.get("kind") == "unmanaged":  # it looks like the server: refuse, name it, say how to override
            raise PreflightError(f"{session.host.name}: no server started by dynctl is running, and {not_ours['text']}: "
                                 f"nothing was signalled -- {not_ours.get('hint', '')}")
        note = f"; {not_ours['text']} (left alone)" if not_ours else ""
        if as_json:
            _print_json({"stopped": False, "message": "server already stopped" + note})
        else:
            console.print(f"server on {session.host.name} is already stopped{escape(note)}")
        return
    what = f"pid {state.pid}" if state.pid else f"{len(state.leftovers)} leftover process(es) of the old server"
    confirm(f"Stop the server on {session.host.name} ({what})?", yes)
    result = lifecycle.stop_server(session.agent, grace, on_event=printer)
    if as_json:
        _print_json(result)


def _cmd(proc: dict[str, Any]) -> str:
    return " ".join(" ".join(proc.get("cmdline") or []).split())[:120] or "?"


def _named_process(state: lifecycle.ServerState, pid: int) -> dict[str, Any]:
    """The process `--pid` names, as the host described it; only the server, its leftovers or an sglang
    launcher for this port that dynctl did not start qualify."""
    if pid == state.pid:
        return {"pid": pid, "cmdline": list(state.argv)}
    for proc in (*state.unmanaged, *state.leftovers):
        if proc.get("pid") == pid:
            return proc
    known = [f"{p['pid']} ({_cmd(p)})" for p in state.unmanaged]
    if state.pid is not None:
        known.insert(0, f"{state.pid} (the server)")
    raise PreflightError(f"pid {pid} is not an sglang server for port {state.port} on this host "
                         f"(candidates: {', '.join(known) or 'none'}); nothing was signalled")


@handle_errors
def start(
    host: str = HostOpt,
    config: str = ConfigOpt,
    ready_timeout: float = ReadyTimeoutOpt,
    yes: bool = YesOpt,
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Start the server detached with the launch argv of the release in force (else the configured one)."""
    session = open_host(host, config)
    state = lifecycle.find_server(session.agent)
    if state.pid is not None:
        console.print(f"server on {session.host.name} is already running: {_describe(state)}")
        return
    argv, how = lifecycle.launch_in_force(state, session.host)
    confirm(f"Start the server on {session.host.name} with {how}: {' '.join(argv)}?", yes)
    printer = EventPrinter(quiet=as_json, verbose=verbose)
    started = lifecycle.start_server(session.agent, None, on_event=printer,
                                     baseline_argv=lifecycle.server_argv(session.host))
    ready = lifecycle.wait_ready(session.agent, ready_timeout, on_event=printer)
    if as_json:
        _print_json({"started": started, "ready": ready})


@handle_errors
def restart(
    host: str = HostOpt,
    config: str = ConfigOpt,
    grace: float = GraceOpt,
    ready_timeout: float = ReadyTimeoutOpt,
    yes: bool = YesOpt,
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Stop and start again, in one step on the host, with the launch argv of the release in force (else the
    configured one)."""
    session = open_host(host, config)
    state = lifecycle.find_server(session.agent)
    argv, how = lifecycle.launch_in_force(state, session.host)
    confirm(f"Restart the server on {session.host.name} ({_describe(state)}) with {how}: {' '.join(argv)}?", yes)
    ready = lifecycle.restart_server(session.agent, None, grace=grace, ready_timeout=ready_timeout,
                                     on_event=EventPrinter(quiet=as_json, verbose=verbose),
                                     baseline_argv=lifecycle.server_argv(session.host))
    if as_json:
        _print_json(ready)


@handle_errors
def logs(
    host: str = HostOpt,
    config: str = ConfigOpt,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines (Ctrl-C ends)."),
    lines: int = typer.Option(100, "--lines", "-n", min=0, help="How many of the last lines to show."),
) -> None:
    """The server log in the host's workdir."""
    session = open_host(host, config)
    if not follow:
        for line in lifecycle.read_log(session.agent, lines):
            console.out(line, highlight=False)
        return
    try:
        for line in lifecycle.follow_log(session.agent, lines):
            console.out(line, highlight=False)
    except KeyboardInterrupt:
        pass
