"""Edits of the operator's config file as a TOML document (tomlkit): comments, order and layout kept."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tomlkit

from dynctl.base.config import load_config
from dynctl.base.errors import ConfigError


def _last_table(table: Any) -> Any:
    """The table whose body ends where `table`'s section ends in the file: its last sub-table, or itself."""
    keyed = [item for key, item in table.value.body if key is not None]
    if keyed and isinstance(keyed[-1], tomlkit.items.Table):
        return _last_table(keyed[-1])
    return table


@contextlib.contextmanager
def keep_trailing_lines(table: Any) -> Iterator[None]:
    """Edit `table` with the comments and blank lines that end its section kept at its end: tomlkit keeps the
    lines before the next header in this table's body, though they introduce what follows, so a key added
    here would otherwise land under them."""
    body = _last_table(table).value.body
    trailing: list[Any] = []
    while body and body[-1][0] is None and isinstance(body[-1][1], (tomlkit.items.Comment, tomlkit.items.Whitespace)):
        trailing.insert(0, body.pop()[1])
    yield
    _last_table(table).value.body.extend((None, item) for item in trailing)


def set_host_keys(path: Path, host: str, values: dict[str, Any]) -> None:
    """Set `values` in [hosts.<host>] of the config at `path`, leaving every other line as it was; the result
    must load, or the file is left untouched (the error names the file)."""
    text = path.read_text(encoding="utf-8")
    doc = tomlkit.parse(text)
    hosts = doc.get("hosts")
    if hosts is None or host not in hosts:
        raise ConfigError(f"{path}: no [hosts.{host}] section to write to; add one (or pass --host)")
    table = hosts[host]
    with keep_trailing_lines(table):
        for key, value in values.items():
            table[key] = value
    new = tomlkit.dumps(doc)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new, encoding="utf-8")
    try:
        load_config(tmp)
    except ConfigError as err:
        tmp.unlink()
        raise ConfigError(f"{path}: writing [hosts.{host}] would not load ({err}); the file is unchanged") from None
    os.replace(tmp, path)
