"""`dynctl config`: which config file is in use, where dynctl looked, and the host settings in effect."""

from __future__ import annotations

import json
from typing import Any

import typer

from dynctl.base import sglang
from dynctl.cli.common import ConfigOpt, HostOpt, JsonOpt, console, handle_errors
from dynctl.cli.tables import print_table
from dynctl.base.config import find_config_path, load_config, lookup_order
from dynctl.core.lifecycle import server_argv


def register(app: typer.Typer) -> None:
    app.command("config")(config_command)


def describe_config(host_name: str | None, config: str | None) -> dict[str, Any]:
    """The lookup, the file in use and the effective settings of one host, without contacting it."""
    looked = []
    in_use = find_config_path(config)
    for source, path in lookup_order(config):
        state = "not set" if path is None else ("in use" if path == in_use else
                                                "found" if path.is_file() else "absent")
        looked.append({"source": source, "path": None if path is None else str(path), "state": state})
        if in_use is not None and path == in_use:
            break  # the first one found is the one in use; later ones are not read
    cfg = load_config(config)
    host = cfg.host(host_name)
    settings = {
        "host": host.name, "default": host.name == cfg.default_host, "route": host.route,
        "ssh": None if host.ssh is None else str(host.ssh), "pct": host.pct, "python": host.python,
        "workdir": host.workdir, "port": host.port, "strategy": host.strategy, "keep_history": host.keep_history,
        "simulated": host.simulated, "env_keys": sorted(host.env), "launch_argv": sglang.redact_argv(server_argv(host)),
    }
    return {"config": None if in_use is None else str(in_use), "looked": looked, "hosts": sorted(cfg.hosts),
            "settings": settings}


@handle_errors
def config_command(
    host: str = HostOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """The config file in use, where dynctl looked for one, and the effective settings of the host (default: the
    default host); environment values are never shown, only their names."""
    found = describe_config(host, config)
    if as_json:
        console.print_json(json.dumps(found))
        return
    if console.is_terminal:
        console.print(f"[bold]config:[/] {found['config'] or 'none found (this machine, defaults)'}")
    print_table(console, ("looked in", "path", "state"),
                [(e["source"], e["path"] or "-", e["state"]) for e in found["looked"]])
    if console.is_terminal:
        console.print()
    settings = found["settings"]
    rows = [(k, " ".join(v) if k == "launch_argv" else ", ".join(v) if isinstance(v, list) else v)
            for k, v in settings.items()]
    print_table(console, ("setting", "value"), [(k, "-" if v is None else v) for k, v in rows])
