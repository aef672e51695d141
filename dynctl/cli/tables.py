"""Tables for a person on a terminal, and for a pipe: one tab-separated line per row, never wrapped."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _cell(value: object) -> str:
    """A cell on one line: tabs and line breaks inside it would split the row."""
    return " ".join(str("" if value is None else value).split())


def print_table(console: Console, columns: Sequence[str], rows: Sequence[Sequence[object]],
                no_wrap: Sequence[str] = ()) -> None:
    """On a terminal a rich table (`no_wrap` columns never cut); elsewhere a header line and one line per row,
    cells separated by tabs, so `cut -f`, `grep` and `awk -F'\\t'` read it whole."""
    if not console.is_terminal:
        for row in [columns, *rows]:
            console.file.write("\t".join(_cell(v) for v in row) + "\n")
        console.file.flush()
        return
    table = Table(box=None)
    for name in columns:
        if name in no_wrap:
            table.add_column(name, no_wrap=True, min_width=max([len(_cell(r[columns.index(name)])) for r in rows] or [0]))
        else:
            table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(_cell(v) for v in row))
    console.print(table)


def print_rich_table(console: Console, table: Table) -> None:
    """A table built for the terminal, off it as tab-separated rows of its plain text (markup stripped)."""
    if console.is_terminal:
        console.print(table)
        return
    columns = [[Text.from_markup(c).plain if isinstance(c, str) else getattr(c, "plain", str(c))
                for c in column._cells] for column in table.columns]  # rich keeps a column's cells there
    for row in zip(*columns):
        console.file.write("\t".join(_cell(v) for v in row) + "\n")
    console.file.flush()
