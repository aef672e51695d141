"""`dynctl stop|start|restart|logs`: the server lifecycle of SPEC §5 on its own."""

from __future__ import annotations

import json
from typing import Any

import typer

from dynctl.base import sglang
from dynctl.core import lifecycle
from dynctl.cli.common import (
    AdoptOpt,
    ConfigOpt,
    HostOpt,
    JsonOpt,
    VerboseOpt,
    YesOpt,
    adopt_word,
    confirm,
    console,
    handle_errors,
    open_host,
    seconds_option,
)
from dynctl.cli.progress import EventPrinter
from dynctl.base.parsers.logrecord import log_record

GraceOpt = seconds_option(60.0, "--grace", 0, lifecycle.MAX_GRACE_S,
                          "Seconds the server may drain after SIGTERM before SIGKILL.")
ReadyTimeoutOpt = seconds_option(900.0, "--ready-timeout", 1, lifecycle.MAX_READY_TIMEOUT_S,
                                 "Seconds to wait for /health_generate and one real /generate.")


def register(app: typer.Typer) -> None:
    app.command("stop")(stop)
    app.command("start")(start)
    app.command("restart")(restart)
    app.command("logs")(logs)


def _print_json(obj: Any) -> None:
    console.print_json(json.dumps(sglang.redact(obj), default=str))


@handle_errors
def stop(
    host: str = HostOpt,
    config: str = ConfigOpt,
    grace: float = GraceOpt,
    pid: int = typer.Option(None, "--pid", min=1,
                            help="Stop this process although dynctl did not start it: an sglang server for this "
                                 "host's port that dynctl found only by its command line (asks first)."),
    yes: bool = YesOpt,
    adopt: bool = AdoptOpt,
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Stop the server: SIGTERM, drain, SIGKILL after --grace, sweep its processes, wait for port and GPU."""
    session = open_host(host, config)
    result = lifecycle.stop(session.agent, grace, EventPrinter(quiet=as_json, verbose=verbose),
                            lambda question: confirm(question, yes), pid=pid, adopt=adopt_word(adopt, yes))
    if as_json:
        _print_json(result)


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
    result = lifecycle.start(session.agent, session.host, ready_timeout, EventPrinter(quiet=as_json, verbose=verbose),
                             lambda question: confirm(question, yes))
    if as_json:
        _print_json(result)


@handle_errors
def restart(
    host: str = HostOpt,
    config: str = ConfigOpt,
    grace: float = GraceOpt,
    ready_timeout: float = ReadyTimeoutOpt,
    yes: bool = YesOpt,
    adopt: bool = AdoptOpt,
    keep_live_threshold: bool = typer.Option(False, "--keep-live-threshold",
                                             help="Start with the threshold the server runs now (set with `dynctl "
                                                  "threshold`), not the release's."),
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Stop and start again, in one step on the host, with the launch argv of the release in force (else the
    configured one)."""
    session = open_host(host, config)
    ready = lifecycle.restart(session.agent, session.host, grace, ready_timeout,
                              EventPrinter(quiet=as_json, verbose=verbose), lambda question: confirm(question, yes),
                              adopt=adopt_word(adopt, yes), keep_live_threshold=keep_live_threshold)
    if as_json:
        _print_json(ready)


@handle_errors
def logs(
    host: str = HostOpt,
    config: str = ConfigOpt,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines (Ctrl-C ends)."),
    lines: int = typer.Option(100, "--lines", "-n", min=0, help="How many of the last lines to show."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line: the raw line, its time, ranks, "
                                                       "message, and the decode or speculation fields read from it."),
) -> None:
    """The server log: the one dynctl's starts write in the workdir, or an adopted server's own log file."""
    session = open_host(host, config)
    offset = lifecycle.log_utc_offset(session.agent) if as_json else None

    def show(line: str) -> None:
        if as_json:
            console.file.write(json.dumps(sglang.redact(log_record(line, offset))) + "\n")
            console.file.flush()
        else:
            console.out(line, highlight=False)

    if not follow:
        for line in lifecycle.read_log(session.agent, lines):
            show(line)
        return
    try:
        for line in lifecycle.follow_log(session.agent, lines):
            show(line)
    except KeyboardInterrupt:
        pass
