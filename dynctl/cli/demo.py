"""`dynctl demo`: a simulated GPU host, threshold 5 deployed, a load ramp, and the TUI on it."""

from __future__ import annotations

import threading

import typer
from rich.markup import escape

from dynctl.actions import demo as core
from dynctl.cli.common import ConfigOpt, console, handle_errors
from dynctl.cli.progress import EventPrinter
from dynctl.base.errors import UsageError
from dynctl.patching import parse_threshold


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


@handle_errors
def demo(
    config: str = ConfigOpt,
    no_tui: bool = typer.Option(False, "--no-tui", help="Print the story as text and exit instead of opening the TUI."),
    threshold: int = typer.Option(5, "--threshold", "-t", help="Threshold to deploy."),
    port: int = typer.Option(30000, "--port", help="Port of the simulated server (127.0.0.1)."),
    time_scale: float = typer.Option(1.0, "--time-scale", help="Run the simulated GPU this many times faster than the H200 it was measured on (1 = the measured speed)."),
    level_seconds: float = typer.Option(4.5, "--level-seconds", help="Seconds per step of the 1→64→1 ramp."),
    fleet: int = typer.Option(0, "--fleet", metavar="N",
                              help="N simulated hosts (1-8) behind a real smg gateway, and a rolling deploy through it."),
) -> None:
    """Start a local SIMULATED GPU host, deploy threshold 5 to it, drive a load ramp and watch speculation switch."""
    # Checked before anything is prepared: a bad value must not leave a half-registered demo host behind.
    parse_threshold(threshold, "--threshold")
    if fleet:
        from dynctl.cli.fleet import demo_fleet

        return demo_fleet(fleet, config, threshold, time_scale, no_tui)
    if not 0 < port < 65536:
        raise UsageError(f"--port: expected a TCP port 1-65535, got {port}")
    for name, value in (("--time-scale", time_scale), ("--level-seconds", level_seconds)):
        if not value > 0:
            raise UsageError(f"{name}: expected a number above 0, got {value:g}")
    printer = EventPrinter(quiet=False)
    console.print("[bold magenta]dynctl demo[/] — everything below runs against a [bold]SIMULATED[/] SGLang server "
                  "on 127.0.0.1 (no GPU, no model), patched through the real deploy path.")
    host = core.prepare(config, port=port, time_scale=time_scale, on_event=printer)
    if no_tui:
        flips = core.story(host, threshold, lambda line: console.print(escape(line)), printer,
                           seconds=level_seconds)
        console.print(f"speculation switched {flips} time(s) as the load crossed threshold {threshold}.")
        console.print(f"The demo server keeps running: try `dynctl status --host {core.DEMO_HOST}`, "
                      f"`dynctl tui --host {core.DEMO_HOST}`; `dynctl stop --host {core.DEMO_HOST} --yes` ends it.")
        return
    import sys

    from dynctl.cli.tui import run_dashboard

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("the demo opens the TUI, which needs a terminal; use `dynctl demo --no-tui`")
    core.deploy_threshold(host, threshold, printer)
    stop = threading.Event()

    def ramp_until_quit() -> None:
        while not stop.is_set():  # 1 → 64 → 1, again and again, while the TUI is open
            for _ in core.load_ramp(host.agent, seconds=level_seconds, stop=stop):
                pass

    ramp = threading.Thread(target=ramp_until_quit, name="demo-load-ramp", daemon=True)
    ramp.start()
    try:
        run_dashboard(host.config, [host.host])
    finally:
        stop.set()
    console.print(f"The demo server keeps running: `dynctl stop --host {core.DEMO_HOST} --yes` ends it.")
