"""`dynctl bench`: the closed-loop concurrency sweep of SPEC §7, rendered with rich."""

from __future__ import annotations

import math
import re
from typing import Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from dynctl.base import events
from dynctl.bench import (
    BenchInterrupted,
    BenchPlan,
    BenchResult,
    BenchStarted,
    LevelDone,
    LevelProgress,
    LevelStarted,
    ModeStarted,
    ThresholdRestored,
    parse_concurrency,
    parse_goodput,
    plan_modes,
    run_bench,
)
from dynctl.bench.modes import DeployRedeployer
from dynctl.bench.runner import debug_checks_warning
from dynctl.bench.chart import chart_series, crossover_x, terminal_chart, write_png
from dynctl.bench.report import comparison_rows, level_cells, level_headers, write_json
from dynctl.cli.common import (
    ConfigOpt,
    HostOpt,
    NumbersCommand,
    YesOpt,
    confirm,
    console,
    err_console,
    handle_errors,
    open_host,
)
from dynctl.cli.progress import EventPrinter
from dynctl.base.errors import DynctlError, UsageError
from dynctl.patching import parse_threshold

EXIT_INTERRUPTED = 130
_DEFAULT_LEVELS = ",".join(str(c) for c in BenchPlan().concurrency)
_SLO = re.compile(r"^[a-z0-9]+:")


def register(app: typer.Typer) -> None:
    app.command("bench", cls=NumbersCommand)(bench)


@handle_errors
def bench(
    host: str = HostOpt,
    config: str = ConfigOpt,
    concurrency: str = typer.Option(_DEFAULT_LEVELS, "--concurrency", help="Comma-separated concurrency levels."),
    input_len: int = typer.Option(512, "--input-len", help="Prompt tokens per request (random token ids)."),
    output_len: int = typer.Option(128, "--output-len", help="Generated tokens per request (ignore_eos)."),
    duration: float = typer.Option(None, "--duration", help="Seconds measured per level (default 30)."),
    num_prompts: int = typer.Option(None, "--num-prompts",
                                    help="Requests measured per level (instead of --duration)."),
    warmup: int = typer.Option(None, "--warmup",
                               help="Warm-up requests per level, not measured (default: one per worker)."),
    compare: bool = typer.Option(False, "--compare",
                                 help="Sweep no-spec, always-spec and each --threshold; recommend a threshold."),
    threshold: list[str] = typer.Option([], "--threshold",
                                        help="Threshold mode(s) to sweep: --threshold 4 --threshold 8, or 4,8."),
    goodput: list[str] = typer.Option([], "--goodput",
                                      help="SLOs in ms as vLLM: --goodput ttft:200 tpot:50 (e2el too)."),
    extra: list[str] = typer.Argument(None, hidden=True, metavar="VALUES",
                                      help="More values of --goodput / --threshold, written vLLM-style."),
    json_path: str = typer.Option(None, "--json", help="Write the results as JSON (vLLM field names) to PATH."),
    png_path: str = typer.Option(None, "--png", help="Write a tok/s-vs-concurrency chart to PATH (PNG)."),
    chart: bool = typer.Option(True, "--chart/--no-chart", help="Draw the terminal chart at the end."),
    yes: bool = YesOpt,
) -> None:
    """Closed-loop concurrency sweep against the server: tok/s, TTFT, TPOT, ITL, E2E, and the server's view."""
    goodput_items, threshold_items = _split_extra(extra or [], bool(goodput), bool(threshold))
    plan = BenchPlan(
        concurrency=parse_concurrency(concurrency),
        input_len=input_len,
        output_len=output_len,
        duration=duration,
        num_prompts=num_prompts,
        warmup=warmup,
        goodput=parse_goodput([*goodput, *goodput_items]),
        modes=plan_modes(compare, _parse_thresholds([*threshold, *threshold_items])),
        compare=compare,
    )
    session = open_host(host, config)
    view = BenchView(plan)
    try:
        with view.progress:
            result = run_bench(session.agent, session.host.name, plan, view.on_event,
                               simulated=session.host.simulated,
                               redeployer=DeployRedeployer(session.agent, session.host, confirm=lambda: confirm(
                                   f"The threshold of {session.host.name} cannot change live: bench will redeploy "
                                   f"its server for each mode (a restart each) and put the original back. Go on?",
                                   yes), on_event=view.on_event))
    except BenchInterrupted as stop:
        view.finish(stop.result, json_path, png_path, chart)
        err_console.print(f"[yellow]interrupted[/] after {stop.result.levels_measured} measured level(s)")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except DynctlError as err:
        partial = getattr(err, "bench_result", None)
        if partial is not None and partial.levels_measured:
            view.finish(partial, json_path, png_path, chart)
        raise
    view.finish(result, json_path, png_path, chart)


def _split_extra(extra: list[str], has_goodput: bool, has_threshold: bool) -> tuple[list[str], list[str]]:
    """vLLM writes `--goodput ttft:200 tpot:50`: typer sees the second SLO as a stray argument."""
    slos, thresholds = [], []
    for item in extra:
        if has_goodput and _SLO.match(item):
            slos.append(item)
        elif has_threshold and re.fullmatch(r"-?\d+(,-?\d+)*", item):
            thresholds.append(item)
        else:
            raise UsageError(f"unexpected argument {item!r} (dynctl bench takes options only; see --help)")
    return slos, thresholds


def _parse_thresholds(items: list[str]) -> list[int]:
    out = []
    for raw in items:
        for part in raw.split(","):
            out.append(parse_threshold(part, f"--threshold {raw!r}"))
    return out


class BenchView:
    """Renders the event stream: a progress bar per level, one summary line per finished level; the events bench
    shares with the other operations (warnings, a redeploy's steps) as they print everywhere."""

    def __init__(self, plan: BenchPlan) -> None:
        self.plan = plan
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                                 TimeElapsedColumn(), console=console, transient=True)
        self.overall: TaskID | None = None
        self.level: TaskID | None = None
        self.shared = EventPrinter()

    def on_event(self, event: Any) -> None:
        p = self.progress
        if isinstance(event, BenchStarted):
            modes = ", ".join(m.name for m in event.modes)
            console.print(f"[bold]bench[/] {event.host} → server {event.where} (model {event.model}); "
                          f"levels {','.join(map(str, event.levels))}; {event.budget} per level; modes: {modes}")
            self.overall = p.add_task("all levels", total=len(event.levels) * len(event.modes), info="")
        elif isinstance(event, ModeStarted):
            forced = "" if event.threshold_in_force is None else f" (threshold {event.threshold_in_force} in force)"
            console.print(f"[bold]mode {event.mode.name}[/]{forced}")
        elif isinstance(event, LevelStarted):
            if self.level is not None:
                p.remove_task(self.level)
            total = self.plan.duration if self.plan.duration is not None else self.plan.num_prompts
            self.level = p.add_task(f"{event.mode.name} c={event.concurrency}", total=total, info="warm-up")
        elif isinstance(event, LevelProgress) and self.level is not None:
            done = (event.window_elapsed or 0.0) if self.plan.duration is not None else event.completed + event.failed
            batch = f" batch {event.running:.0f}" if event.running is not None else ""
            info = f"{event.phase} {event.completed} done {event.failed} failed{batch}"
            p.update(self.level, completed=done if event.phase == "measure" else 0, info=info)
        elif isinstance(event, LevelDone):
            if self.overall is not None:
                p.advance(self.overall)
            console.print(_level_line(event.mode.name, event.level))
        elif isinstance(event, ThresholdRestored):
            console.print(f"threshold restored to {event.threshold}")
        elif isinstance(event, events.Finished) and event.operation == "bench":
            pass  # finish() prints the tables that say it better
        else:
            self.shared(event)

    def finish(self, result: BenchResult, json_path: str | None, png_path: str | None, chart: bool) -> None:
        self.progress.stop()
        goodput = bool(result.plan.goodput)
        for run in result.runs:
            if not run.levels:
                continue
            table = Table(*level_headers(goodput), title=f"{result.host} · {run.mode.name}"
                          + (f" (measured as {run.measured_as})" if run.measured_as else "")
                          + (" · SIMULATED" if result.simulated else ""), box=None, pad_edge=False)
            for level in run.levels:
                table.add_row(*level_cells(level, goodput))
            console.print(table)
        if len([r for r in result.runs if r.levels]) > 1:
            headers, rows = comparison_rows(result)
            table = Table(*headers, title="output tok/s by mode (* best)", box=None, pad_edge=False)
            for row in rows:
                table.add_row(*row)
            console.print(table)
        if result.recommendation:
            _print_recommendation(result.recommendation)
        series = chart_series(result.runs)
        cross = crossover_x(result.recommendation)
        title = f"{result.host}{' (SIMULATED)' if result.simulated else ''}: output tok/s vs concurrency"
        if chart and series and max(len(pts) for _, pts in series) > 1:
            console.print(Text.from_ansi(terminal_chart(series, width=min(console.width, 100), height=18,
                                                        title=title, crossover=cross,
                                                        color=console.is_terminal)))
        if result.debug_checks:
            console.print(f"[yellow]warning:[/] {escape(debug_checks_warning(result.host, result.debug_checks))}",
                          soft_wrap=True)
        if json_path:
            console.print(f"results: {write_json(result, json_path)}")
        if png_path and series:
            console.print(f"chart: {write_png(series, png_path, title=title, crossover=cross)}")


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _level_line(mode: str, lv: dict[str, Any]) -> str:
    server = lv.get("server") or {}
    share = server.get("spec_on_share")
    return (f"  {mode} c={lv['max_concurrency']}: [bold]{lv['output_throughput']:.1f}[/] tok/s  "
            f"TTFT {lv['median_ttft_ms']:.0f} ms  TPOT {lv['median_tpot_ms']:.1f} ms  "
            f"{lv['completed']} ok {lv['failed']} failed  batch {_num(server.get('mean_batch_size'), '{:.1f}')}  "
            f"spec {_num(share * 100 if share is not None else None, '{:.0f}%')}")


def _print_recommendation(rec: dict[str, Any]) -> None:
    console.print(f"[bold green]recommended:[/] {rec['flag']}  (speculation while batch ≤ {rec['threshold']})")
    table = Table("conc", "no-spec", "always-spec", "with threshold", "vs no-spec", "vs always-spec",
                  title="margin of the recommended threshold", box=None, pad_edge=False)
    for row in rec["levels"]:
        got = row.get("measured_output_throughput", row["expected_output_throughput"])
        vs_off = row.get("measured_margin_vs_no_spec_pct", row["margin_vs_no_spec_pct"])
        vs_on = row.get("measured_margin_vs_always_spec_pct", row["margin_vs_always_spec_pct"])
        table.add_row(str(row["max_concurrency"]), f"{row['no_spec_output_throughput']:.1f}",
                      f"{row['always_spec_output_throughput']:.1f}", f"{got:.1f}",
                      _num(vs_off, "{:+.1f}%"), _num(vs_on, "{:+.1f}%"))
    console.print(table)
    for note in rec.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")
