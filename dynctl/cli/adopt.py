"""`dynctl adopt`: make the operator's running server dynctl's, without restarting it."""

from __future__ import annotations

import json

import typer

from dynctl import adoption, sglang
from dynctl.cli.common import ConfigOpt, HostOpt, JsonOpt, YesOpt, confirm, console, handle_errors, open_host
from dynctl.cli.progress import EventPrinter


def register(app: typer.Typer) -> None:
    app.command("adopt")(adopt)


@handle_errors
def adopt(
    host: str = HostOpt,
    config: str = ConfigOpt,
    yes: bool = YesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Record the server on the port that dynctl did not start as the baseline release (argv, environment, cwd,
    its log file) and manage it from now on; it keeps running."""
    session = open_host(host, config)
    result = adoption.adopt(session.agent, EventPrinter(quiet=as_json), lambda question: confirm(question, yes))
    if as_json:
        console.print_json(json.dumps(sglang.redact(result), default=str))
