"""The `dynctl` command line (typer). Each command group lives in its own module."""

from __future__ import annotations

import typer

from dynctl import __version__
from dynctl.cli import adopt as adopt_cli
from dynctl.cli import bench as bench_cli
from dynctl.cli import demo as demo_cli
from dynctl.cli import deploy as deploy_cli
from dynctl.cli import hosts as hosts_cli
from dynctl.cli import lifecycle as lifecycle_cli
from dynctl.cli import ops as ops_cli
from dynctl.cli import patch as patch_cli
from dynctl.cli import tui as tui_cli

app = typer.Typer(
    name="dynctl",
    help="Safe deploys, rollbacks and a live view for SGLang GPU hosts.",
    no_args_is_help=True,
    add_completion=False,
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
tui_cli.register(app)
bench_cli.register(app)
app.add_typer(patch_cli.app, name="patch")
app.add_typer(ops_cli.app, name="ops")


def main() -> None:
    app()
