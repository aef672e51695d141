"""The `dynctl` command line (typer). Each command group lives in its own module."""

from __future__ import annotations

from typing import Any

import typer

from dynctl import __version__
from dynctl.cli import adopt as adopt_cli
from dynctl.cli import bench as bench_cli
from dynctl.cli import configcmd as config_cli
from dynctl.cli import demo as demo_cli
from dynctl.cli import deploy as deploy_cli
from dynctl.cli import hosts as hosts_cli
from dynctl.cli import lifecycle as lifecycle_cli
from dynctl.cli import ops as ops_cli
from dynctl.cli import patch as patch_cli
from dynctl.cli import tui as tui_cli
from dynctl.cli.examples import add_examples

app = typer.Typer(
    name="dynctl",
    help="Safe deploys, rollbacks and a live view for SGLang GPU hosts.",
    no_args_is_help=True,
    add_completion=True,  # typer's own --install-completion / --show-completion
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dynctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    pass


demo_cli.register(app)
deploy_cli.register(app)
hosts_cli.register(app)
lifecycle_cli.register(app)
adopt_cli.register(app)
config_cli.register(app)
tui_cli.register(app)
bench_cli.register(app)
app.add_typer(patch_cli.app, name="patch")
app.add_typer(ops_cli.app, name="ops")


def plain_flags(command: Any) -> Any:
    """`command` with its flags shown without a value in --help (typer >= 0.20 prints `<bool>` for them)."""
    for param in getattr(command, "params", ()):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    help_option = getattr(command, "get_help_option", None)
    if help_option is not None:  # -h/--help is made when help is asked for, not kept in params

        def plain_help_option(ctx: Any, made: Any = help_option) -> Any:
            option = made(ctx)
            if option is not None and option.metavar is None:
                option.metavar = ""
            return option

        command.get_help_option = plain_help_option
    for sub in getattr(command, "commands", {}).values():
        plain_flags(sub)
    return command


def main() -> None:
    plain_flags(add_examples(typer.main.get_command(app)))(prog_name="dynctl")
