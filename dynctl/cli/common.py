"""What every command shares: config and host lookup, confirmation, and errors mapped to exit codes."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from dynctl.agent import AgentClient
from dynctl.config import Config, HostConfig, load_config
from dynctl.errors import DynctlError, Interrupted, UsageError
from dynctl.transport import Transport, close_all, connect

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

F = TypeVar("F", bound=Callable[..., Any])

HostOpt = typer.Option(None, "--host", "-H", help="Host name from the config (default: default_host).")
ConfigOpt = typer.Option(None, "--config", "-c", help="Config file (else $DYNCTL_CONFIG, ./dynctl.toml, ~/.config/dynctl/config.toml).")
JsonOpt = typer.Option(False, "--json", help="Machine-readable output.")
VerboseOpt = typer.Option(False, "--verbose", "-v", help="Show every server log line while waiting.")
YesOpt = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation (required when stdin is not a TTY).")


@dataclass
class HostSession:
    config: Config
    host: HostConfig
    transport: Transport
    agent: AgentClient


def open_host(host_name: str | None, config_path: str | None) -> HostSession:
    config = load_config(config_path)
    host = config.host(host_name)
    transport = connect(host, config)
    return HostSession(config, host, transport, AgentClient(transport, host))


def confirm(question: str, yes: bool) -> None:
    """Ask on a TTY; without one, require --yes (SPEC §2)."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"{question.rstrip('?')}: refusing without --yes (stdin is not a terminal)")
    if not typer.confirm(question, default=False):
        raise typer.Exit(1)


def handle_errors(fn: F) -> F:
    """Print a DynctlError as one clear line and exit with its code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            err_console.print("[bold yellow]![/] interrupted: whatever was already asked of the host goes on there "
                              "(`dynctl status` shows the server, `dynctl ops list` the operations)", soft_wrap=True)
            raise typer.Exit(130) from None
        except Interrupted as err:  # not an error of the host's: Ctrl-C, with what became of the operation
            err_console.print(f"[bold yellow]![/] {escape(str(err))}", soft_wrap=True)
            raise typer.Exit(err.exit_code) from None
        except DynctlError as err:
            err_console.print(f"[bold red]error:[/] {escape(str(err))}", soft_wrap=True)
            raise typer.Exit(err.exit_code) from None
        finally:
            close_all()

    return wrapper  # type: ignore[return-value]
