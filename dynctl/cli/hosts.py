"""`dynctl hosts` and `dynctl status` (filled in by issue 2)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass
