"""Progress events on the terminal: one line per step with its elapsed time, log lines dimmed, the outcome last."""

from __future__ import annotations

import re
from typing import Any

from rich.markup import escape

from dynctl.base import events
from dynctl.cli.common import console, err_console


class EventPrinter:
    """Renders `dynctl.base.events` by type.

    quiet (--json): only warnings and failures, on stderr, so stdout stays one JSON document.
    """

    # Server log lines worth a line of their own without --verbose; the rest scroll by in the journal.
    NOTABLE = re.compile(r"Traceback|Error|error:|WARNING|fired up and ready|Speculation (en|dis)abled|not armed"
                         r"|never fires|Uvicorn running")

    def __init__(self, quiet: bool = False, verbose: bool = False) -> None:
        self.quiet = quiet
        self.verbose = verbose
        self.out = err_console if quiet else console

    def __call__(self, event: Any) -> None:
        match event:
            case events.Warning(text=text):
                self.out.print(f"[yellow]![/] {escape(text)}", soft_wrap=True)
            case events.Failed(step=step, message=message, log_tail=tail):
                for line in tail:
                    self.out.print(f"  [red]│[/] {escape(line)}", soft_wrap=True)
                self.out.print(f"[bold red]✗[/] {step:<6} {escape(message)}", soft_wrap=True)
            case _ if self.quiet:
                pass
            case events.StepStarted(step=step, detail=detail):
                console.print(f"[bold cyan]→[/] {step:<6} [dim]{escape(detail)}[/]", soft_wrap=True)
            case events.StepDone(step=step, elapsed=elapsed, detail=detail):
                console.print(f"[green]✓[/] {step:<6} {elapsed:6.2f} s  {escape(detail)}", soft_wrap=True)
            case events.LogLine(text=text):
                if self.verbose or self.NOTABLE.search(text):
                    console.print(f"  [dim]│ {escape(text)}[/]", soft_wrap=True)
            case events.Note(text=text):
                console.print(f"  [dim]│[/] {escape(text)}", soft_wrap=True)
            case events.Finished(outcome=outcome, detail=detail, elapsed=elapsed):
                took = f", {elapsed:.1f} s" if elapsed is not None else ""
                console.print(f"[bold green]{escape(outcome)}[/] {escape(detail)}{took}", soft_wrap=True)
            case events.Unchanged(reason=reason):
                console.print(f"[green]✓[/] {escape(reason)}", soft_wrap=True)
            case _:
                raise TypeError(f"not a progress event: {event!r}")
