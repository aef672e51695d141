"""What every command shares: config and host lookup, confirmation, and errors mapped to exit codes."""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

from dynctl.agent.client import AgentClient, close_connections, open_agent
from dynctl.base.config import Config, HostConfig, load_config
from dynctl.base.errors import DynctlError, Interrupted, UsageError

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

F = TypeVar("F", bound=Callable[..., Any])

HostOpt = typer.Option(None, "--host", "-H", help="Host name from the config (default: default_host).")
ConfigOpt = typer.Option(None, "--config", "-c", help="Config file (else $DYNCTL_CONFIG, ./dynctl.toml, ~/.config/dynctl/config.toml).")
JsonOpt = typer.Option(False, "--json", help="Machine-readable output.")
VerboseOpt = typer.Option(False, "--verbose", "-v", help="Show every server log line while waiting.")
YesOpt = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation (required when stdin is not a TTY).")
AdoptOpt = typer.Option(False, "--adopt",
                        help="Take over the server on the port that dynctl did not start (the operator's): stop it "
                             "and make its argv, environment and cwd the baseline release. --yes alone never does.")


def seconds_option(default: float, flag: str, low: float, high: float, help: str) -> Any:
    """An option that takes seconds: a finite number in [low, high], else a usage error naming the option and
    the range (exit 2). NaN, inf and 1e400 are refused: an unbounded wait would hold the host forever."""

    def check(value: float) -> float:
        if value is None or (math.isfinite(value) and low <= value <= high):
            return value
        raise typer.BadParameter(f"{value:g} is not allowed: give seconds from {low:g} to {high:g}")

    return typer.Option(default, flag, callback=check, help=f"{help} ({low:g}-{high:g} s)")


_NEGATIVE_NUMBER = re.compile(r"-\d+(\.\d+)?")


class NumbersCommand(TyperCommand):
    """A command whose positional values may be negative numbers: `dynctl threshold -1`.

    Click reads every word that starts with '-' as an option ("No such option: -1"). As argparse does
    when no option looks like a number, a negative number that is not an option's value is a positional
    value here: the positionals move behind `--`, in their order, before click parses.
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, negative_numbers_as_values(self.get_params(ctx), args))


def negative_numbers_as_values(params: list[Any], args: list[str]) -> list[str]:
    """`args` with its positional values after `--` when one of them is a negative number; else unchanged."""
    values_taken: dict[str, int] = {}  # option name -> how many words follow it as its value
    for param in params:
        if getattr(param, "param_type_name", None) == "option":
            taken = 0 if (getattr(param, "is_flag", False) or getattr(param, "count", False)) else param.nargs
            for name in (*param.opts, *param.secondary_opts):
                values_taken[name] = taken
    options: list[str] = []
    positionals: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if word == "--":
            positionals += args[i:]
            break
        if _NEGATIVE_NUMBER.fullmatch(word) or not word.startswith("-") or word == "-":
            positionals.append(word)
            continue
        options.append(word)
        taken = _values_after(word, values_taken)
        options += args[i:i + taken]
        i += taken
    if not any(_NEGATIVE_NUMBER.fullmatch(w) for w in positionals):
        return args
    return [*options, "--", *positionals]


def _values_after(word: str, values_taken: dict[str, int]) -> int:
    """How many of the next words `word` (an option, or a cluster of short ones like -yH) takes as values."""
    if word.startswith("--") or "=" in word:
        return 0 if "=" in word else values_taken.get(word, 0)
    if word in values_taken:
        return values_taken[word]
    for n, letter in enumerate(word[1:], start=2):
        taken = values_taken.get("-" + letter, 0)
        if taken:
            return taken if n == len(word) else 0  # `-Hbox`: the value is the rest of the word
    return 0


@dataclass
class HostSession:
    config: Config
    host: HostConfig
    agent: AgentClient


def open_host(host_name: str | None, config_path: str | None) -> HostSession:
    config = load_config(config_path)
    host = config.host(host_name)
    return HostSession(config, host, open_agent(host, config))


DECLINED = 3  # SPEC §2: nothing on the host was changed (the operator's answer was the check that failed)


def confirm(question: str, yes: bool) -> None:
    """Ask on a TTY; without one, require --yes (SPEC §2). A "no" ends the command with DECLINED."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"{question.rstrip('?')}: refusing without --yes (stdin is not a terminal)")
    if not typer.confirm(question, default=False):
        err_console.print("declined: nothing was changed", soft_wrap=True)
        raise typer.Exit(DECLINED)


def adopt_word(adopt: bool, yes: bool) -> Callable[[str], bool]:
    """The operator's word for taking over their server: --adopt, else a prompt on a TTY (never --yes)."""

    def ask(question: str) -> bool:
        if adopt:
            return True
        if yes or not sys.stdin.isatty():
            return False
        return typer.confirm(question.rstrip("?. ") + "?", default=False)

    return ask


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
            close_connections()

    return wrapper  # type: ignore[return-value]
