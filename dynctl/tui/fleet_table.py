"""The fleet screen's table: a DataTable that renders again only the cells whose text changed.

DataTable drops every rendered cell whenever any cell changes (its caches are keyed by one update
counter), so a fleet whose tok/s column moves every second would lay out every cell of every row once a
second. Here a cell's rendering is kept under what decides how it looks (its text, place, width, style,
cursor, hover, focus); a changed tok/s renders that cell alone.
"""

from __future__ import annotations

from typing import Any

from textual.coordinate import Coordinate
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist


class FleetTable(DataTable):
    CACHE_CELLS = 4096  # a bound on kept cells; a screen of hosts needs a few hundred

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._cells: dict[tuple, Any] = {}

    def _render_cell(self, row_index: int, column_index: int, base_style: Any, width: int, *args: Any,
                     **kw: Any) -> Any:
        if row_index < 0 or column_index < 0:  # the header and row labels: few, and DataTable's own cache
            return super()._render_cell(row_index, column_index, base_style, width, *args, **kw)
        try:
            value = self.get_cell_at(Coordinate(row_index, column_index))
        except CellDoesNotExist:  # a cell DataTable cannot name is rendered as DataTable does
            return super()._render_cell(row_index, column_index, base_style, width, *args, **kw)
        key = (row_index, column_index, value, base_style, width, args, tuple(sorted(kw.items())),
               getattr(self, "_pseudo_class_state", None), getattr(self, "_show_hover_cursor", None),
               self.app.theme)
        try:
            lines = self._cells.get(key)
        except TypeError:  # a value that cannot be a key: no keeping it
            return super()._render_cell(row_index, column_index, base_style, width, *args, **kw)
        if lines is None:
            if len(self._cells) >= self.CACHE_CELLS:
                self._cells.clear()
            lines = self._cells[key] = super()._render_cell(row_index, column_index, base_style, width, *args, **kw)
        return lines
