"""`dynctl adopt`: make the operator's running server dynctl's, without restarting it."""

from __future__ import annotations

import json

import typer

from dynctl.base import sglang
from dynctl.core import adoption
from dynctl.cli.common import ConfigOpt, HostOpt, JsonOpt, YesOpt, confirm, console, handle_errors, open_host
from dynctl.cli.progress import EventPrinter
from dynctl.base.configedit import set_host_keys
from dynctl.base.errors import ConfigError


def register(app: typer.Typer) -> None:
    app.command("adopt")(adopt)


@handle_errors
def adopt(
    host: str = HostOpt,
    config: str = ConfigOpt,
    yes: bool = YesOpt,
    write_config: bool = typer.Option(False, "--write-config",
                                      help="Also write the adopted launch (launch, args, python) into this host's "
                                           "section of the config file, keeping its comments; never its environment."),
    as_json: bool = JsonOpt,
) -> None:
    """Record the server on the port that dynctl did not start as the baseline release (argv, environment, cwd,
    its log file) and manage it from now on; it keeps running."""
    session = open_host(host, config)
    config_path = session.config.path
    if write_config and config_path is None:
        raise ConfigError("--write-config: no config file is in use (see `dynctl config`); nothing was changed")
    result = adoption.adopt(session.agent, EventPrinter(quiet=as_json), lambda question: confirm(question, yes))
    if write_config and result.get("argv"):
        launch, args = adoption.split_launch(result["argv"])
        values = {"launch": launch, "args": args}
        if result.get("python"):
            values["python"] = result["python"]
        assert config_path is not None  # refused above
        set_host_keys(config_path, session.host.name, values)
        if not as_json:
            console.print(f"wrote launch, args and python of [hosts.{session.host.name}] in {config_path}")
    if as_json:
        console.print_json(json.dumps(sglang.redact(result), default=str))
