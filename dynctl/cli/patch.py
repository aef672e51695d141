"""`dynctl patch status|diff|apply|revert` (issue 3)."""

from __future__ import annotations

import typer

app = typer.Typer(help="The speculation patch alone, without touching the server process.", no_args_is_help=True)
