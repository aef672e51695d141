"""`dynctl tui`: the live dashboard for one or several hosts (SPEC §6)."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from dynctl.cli.common import ConfigOpt, handle_errors
from dynctl.base.config import Config, HostConfig, load_config
from dynctl.base.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command("tui")
    @handle_errors
    def tui(
        host: Optional[list[str]] = typer.Option(  # noqa: UP007 - typer reads the annotation
            None, "--host", "-H", metavar="NAME",
            help="Host from the config; repeat for several (default: every configured host)."),
        read_only: bool = typer.Option(False, "--read-only", help="Watch only: hide deploy, rollback, stop and the rest."),
        config: Optional[str] = ConfigOpt,  # noqa: UP007
        interval: float = typer.Option(1.0, "--interval", metavar="SECONDS",
                                       help="Seconds between samples on each host (0.1-60)."),
    ) -> None:
        """Live view: batch size against the threshold, speculation on/off, tok/s, GPUs, log; keys act on the host."""
        if not 0.1 <= interval <= 60:
            raise UsageError(f"--interval must be between 0.1 and 60 seconds, got {interval:g}")
        cfg = load_config(config)
        if host and len(host) == 1 and host[0] in cfg.groups:
            if not (sys.stdin.isatty() and sys.stdout.isatty()):
                raise UsageError("dynctl tui needs a terminal; use `dynctl status --host GROUP --json` in scripts")
            from dynctl.cli.fleet import run_fleet_screen

            return run_fleet_screen(cfg, host[0], read_only=read_only, interval=interval)
        names = list(dict.fromkeys(host)) if host else (list(cfg.hosts) or [cfg.host(None).name])
        hosts = [cfg.host(name) for name in names]  # an unknown name is a config error naming the file
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            raise UsageError("dynctl tui needs a terminal; use `dynctl status --json` in scripts")

        run_dashboard(cfg, hosts, read_only=read_only, interval=interval)


def run_dashboard(cfg: Config, hosts: list[HostConfig], read_only: bool = False, interval: float = 1.0) -> None:
    from dynctl.live.feed import LiveFeed
    from dynctl.actions.host import actions_for
    from dynctl.tui.app import create_app

    dashboard = create_app(
        [h.name for h in hosts],
        lambda on_update: LiveFeed(hosts, on_update, config=cfg, interval=interval),
        actions=actions_for(cfg, hosts),
        read_only=read_only,
    )
    dashboard.run()
