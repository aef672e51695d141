"""`dynctl ops follow|list`: the host-side operations (deploy, rollback, restart) after the command that started
them has gone (Ctrl-C, a closed laptop): watch one to its end, or see what ran."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.markup import escape

from dynctl.base import sglang
from dynctl.core import operations
from dynctl.cli.common import ConfigOpt, HostOpt, JsonOpt, VerboseOpt, console, handle_errors, open_host
from dynctl.cli.progress import EventPrinter
from dynctl.cli.tables import print_table
from dynctl.base.errors import Interrupted

app = typer.Typer(help="Operations on the host: follow one to its end, list recent ones.", no_args_is_help=True)


@app.command("follow")
@handle_errors
def follow(
    op: str = typer.Argument(operations.LATEST, metavar="[ID|latest]",
                             help="The operation's id (printed when its command was interrupted; see `dynctl ops "
                                  "list`), or 'latest'."),
    host: str = HostOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Re-attach to a running or finished operation and show it to its end; the exit code is its outcome:
    0 done, 1 failed (rolled back where that applies), 3 refused with nothing changed."""
    session = open_host(host, config)
    seen: dict[str, Any] = {}

    def records():
        for record in operations.follow(session.agent, op):
            seen.setdefault("op_id", record.get("op_id"))
            seen.setdefault("kind", record.get("op_kind"))
            yield record

    try:
        result = operations.conclude(session.agent, "operation", records(), EventPrinter(quiet=as_json, verbose=verbose))
    except KeyboardInterrupt:
        raise Interrupted(f"{session.host.name}: stopped following; the {seen.get('kind') or 'operation'} "
                          f"{seen.get('op_id') or op} goes on there regardless") from None
    if as_json:
        console.print_json(json.dumps(sglang.redact(result), default=str))


@app.command("list")
@handle_errors
def list_ops(
    host: str = HostOpt,
    config: str = ConfigOpt,
    limit: int = typer.Option(20, "--limit", "-n", min=1, help="How many of the newest to show."),
    as_json: bool = JsonOpt,
) -> None:
    """The newest operations on the host: id, kind, who, when, and how each ended (a group: its rollouts)."""
    from dynctl.cli import fleet as fleet_cli

    if fleet_cli.target(host, None, config):
        return fleet_cli.list_rollouts(host, limit, as_json)
    session = open_host(host, config)
    ops = operations.recent(session.agent, limit)
    if as_json:
        console.print_json(json.dumps(sglang.redact(ops), default=str))
        return
    if not ops:
        console.print(f"no operations on {escape(session.host.name)} yet")
        return
    rows = [(o["id"], o.get("kind") or "", o.get("who") or "", str(o.get("received") or "")[:19], o.get("state") or "")
            for o in ops]
    print_table(console, ("operation", "kind", "who", "received", "state"), rows, no_wrap=("operation",))


@app.command("rollouts")
@handle_errors
def rollouts(
    limit: int = typer.Option(20, "--limit", "-n", min=1, help="How many of the newest to show."),
    as_json: bool = JsonOpt,
) -> None:
    """The rolling deploys and rollbacks started from this client, each with its hosts' states."""
    from dynctl.cli import fleet as fleet_cli

    fleet_cli.list_rollouts(None, limit, as_json)
