"""The bench run: probe the server, then for each mode and concurrency level one `bench_level` on the host."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynctl.base import events
from dynctl.agent.client import AgentClient, AgentError
from dynctl.bench.events import (
    BenchStarted,
    LevelDone,
    LevelProgress,
    LevelStarted,
    ModeStarted,
    ThresholdRestored,
)
from dynctl.bench.modes import ModeSwitcher, Redeployer
from dynctl.bench.plan import BenchPlan, Mode
from dynctl.bench.recommend import recommend
from dynctl.bench.stats import read_sample, summarize_level
from dynctl.base.errors import DynctlError, Interrupted, UnreachableError, UsageError

LOADGEN_CPU_WARN = 80.0  # % of one core: above it the generator, not the server, may set the pace
# --compare's no-spec mode on a speculative server: threshold 0, the patch's disabled path
NO_SPEC_AS = "threshold 0 on a speculative server"


@dataclass
class ModeRun:
    mode: Mode
    threshold_in_force: int | None
    levels: list[dict[str, Any]] = field(default_factory=list)
    measured_as: str | None = None  # what the mode's name does not say about how it was measured


@dataclass
class BenchResult:
    host: str
    simulated: bool
    plan: BenchPlan
    started: str
    probe: dict[str, Any] = field(default_factory=dict)
    runs: list[ModeRun] = field(default_factory=list)
    interrupted: bool = False
    error: str | None = None
    recommendation: dict[str, Any] | None = None

    @property
    def levels_measured(self) -> int:
        return sum(len(r.levels) for r in self.runs)

    @property
    def debug_checks(self) -> list[dict[str, str]]:
        """The slowing debug checks the measured server runs with (strict memory checks, NaN detection)."""
        return list(self.probe.get("debug_checks") or [])


def debug_checks_warning(host: str, checks: list[dict[str, str]]) -> str:
    found = "; ".join(f"{c['check']} ({c['source']})" for c in checks)
    return (f"{host}: the server runs with debug checks that slow every step: {found}; these numbers are slower "
            "than production, and so is any threshold recommended from them: measure a server started without them")


def no_spec_note(algorithm: str | None) -> str:
    return (f"no-spec measured as {NO_SPEC_AS} ({algorithm or 'speculation'} configured, disabled by the threshold: "
            "the patch's disabled path, not a server launched without speculation); the recommendation's "
            "no-spec baseline is that path")


class _Stopped(Exception):
    """should_stop() said so."""


class BenchInterrupted(Exception):
    """Ctrl-C during the run; `result` holds the levels measured before it."""

    def __init__(self, result: BenchResult) -> None:
        super().__init__("interrupted")
        self.result = result


def run_bench(agent: AgentClient, host: str, plan: BenchPlan, on_event: events.EventSink,
              *, simulated: bool = False, redeployer: Redeployer | None = None,
              should_stop: Callable[[], bool] | None = None) -> BenchResult:
    """Measure every mode × level of `plan`; the server's threshold is put back as found, even on Ctrl-C.

    A mode the server cannot switch to live needs `redeployer`; without one it is refused before any load.

    Errors keep what was measured in `err.bench_result`. Ctrl-C, or `should_stop()` turning true (checked
    about once a second, for a UI's stop key), raises BenchInterrupted with the levels measured so far.
    """
    result = BenchResult(host=host, simulated=simulated, plan=plan,
                         started=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))

    def emit(event: Any) -> None:
        on_event(event)
        if should_stop is not None and should_stop():
            raise _Stopped

    try:
        _run(agent, host, plan, emit, result, redeployer)
    except (KeyboardInterrupt, Interrupted, _Stopped):  # Interrupted: Ctrl-C during a redeploy's operation
        result.interrupted = True
        raise BenchInterrupted(result) from None
    except DynctlError as err:
        result.error = str(err)
        err.bench_result = result  # type: ignore[attr-defined]
        raise
    return result


def _run(agent: AgentClient, host: str, plan: BenchPlan, on_event: events.EventSink,
         result: BenchResult, redeployer: Redeployer | None) -> None:
    probe = agent.call("bench_probe")
    result.probe = probe
    if not probe.get("reachable"):
        raise UnreachableError(
            f"{host}: the SGLang server at {probe.get('where')} is not answering ({probe.get('error')}); "
            f"is it running? (`dynctl status --host {host}`)"
        )
    switcher = ModeSwitcher(agent, host, probe, redeployer)
    switcher.check(plan.modes)
    on_event(BenchStarted(host, probe.get("where", "?"), probe.get("model"), plan.concurrency, plan.modes,
                          plan.budget))
    if result.debug_checks:
        on_event(events.Warning(debug_checks_warning(host, result.debug_checks)))
    if not probe.get("metrics"):
        on_event(events.Warning(f"{host}: no sglang metrics at /metrics (server started without --enable-metrics?): "
                              "batch size and speculation share will be missing"))
    total = len(plan.modes) * len(plan.concurrency)
    index = 0
    try:
        for mode in plan.modes:
            run = ModeRun(mode, switcher.enter(mode))
            if mode == Mode.no_spec() and run.threshold_in_force == 0 and probe.get("speculative_algorithm"):
                run.measured_as = NO_SPEC_AS
            result.runs.append(run)
            on_event(ModeStarted(mode, run.threshold_in_force))
            for concurrency in plan.concurrency:
                index += 1
                on_event(LevelStarted(mode, concurrency, index, total))
                level = {"mode": mode.name, "threshold": run.threshold_in_force,
                         **_measure_level(agent, host, plan, mode, concurrency, on_event)}
                run.levels.append(level)
                _warn_about(level, host, on_event)
                on_event(LevelDone(mode, level))
    finally:
        _restore(switcher, host, on_event)
    if plan.compare:
        result.recommendation = recommend(result.runs)
    rec = result.recommendation
    if rec is not None:
        baseline = next((r for r in result.runs if r.mode.threshold == 0), None)
        rec["no_spec_measured_as"] = baseline.measured_as if baseline is not None else None
        if rec["no_spec_measured_as"]:
            rec["notes"].append(no_spec_note(probe.get("speculative_algorithm")))
        rec["measured_with_debug_checks"] = [c["check"] for c in result.debug_checks]
    advice = f"; recommended threshold {rec['threshold']}" if rec else ""
    on_event(events.Finished("bench", "measured",
                             f"{result.levels_measured} level(s) on {host}"
                             f"{' (SIMULATED)' if result.simulated else ''}{advice}"))


def _restore(switcher: ModeSwitcher, host: str, on_event: events.EventSink) -> None:
    """Put the threshold back; a failure here must not hide the error that ended the run."""
    if not switcher.changed:
        return
    try:
        restored = switcher.restore()
    except DynctlError as err:
        on_event(events.Warning(f"{host}: could not put threshold {switcher.original} back: {err}; "
                              f"run `dynctl threshold {switcher.original} --host {host}`"))
        return
    if restored is not None:
        on_event(ThresholdRestored(restored))


def _measure_level(agent: AgentClient, host: str, plan: BenchPlan, mode: Mode, concurrency: int,
                   on_event: events.EventSink) -> dict[str, Any]:
    params: dict[str, Any] = {
        "concurrency": concurrency, "input_len": plan.input_len, "output_len": plan.output_len,
        "warmup": plan.warmup_for(concurrency), "seed": plan.seed + concurrency,
    }
    if plan.duration is not None:
        params["duration"] = plan.duration
    else:
        params["num_prompts"] = plan.num_prompts
    raw: dict[str, Any] | None = None
    try:
        # closing(): on Ctrl-C the agent's level must stop now, not when the traceback is collected
        with contextlib.closing(agent.stream("bench_level", **params)) as items:
            for item in items:
                if item.get("type") == "tick":
                    on_event(LevelProgress(mode, concurrency, item.get("phase", "?"),
                                           float(item.get("elapsed", 0)), item.get("window_elapsed"),
                                           int(item.get("completed", 0)), int(item.get("failed", 0)),
                                           read_sample(item.get("metrics") or "").get("running")))
                elif item.get("type") == "level":
                    raw = item
    except AgentError as err:
        if err.kind == "unreachable":
            raise UnreachableError(f"{host}: {err}") from None
        if err.kind == "usage":
            raise UsageError(str(err)) from None
        raise
    if raw is None:
        raise DynctlError(f"{host}: the load generator ended without a result for concurrency {concurrency}")
    return summarize_level(raw, input_len=plan.input_len, duration_mode=plan.duration is not None,
                           goodput=plan.goodput or None)


def _warn_about(level: dict[str, Any], host: str, on_event: events.EventSink) -> None:
    c = level["max_concurrency"]
    cpu = (level.get("loadgen") or {}).get("cpu_percent")
    if cpu is not None and cpu > LOADGEN_CPU_WARN:
        on_event(events.Warning(f"concurrency {c}: the load generator used {cpu:.0f}% of a CPU core on {host}; "
                              "the client may have limited this level"))
    if level.get("timed_out"):
        on_event(events.Warning(f"concurrency {c}: the level hit its time cap before finishing"))
    if level["failed"]:
        top = max(level["errors"].items(), key=lambda kv: kv[1])[0] if level["errors"] else "?"
        on_event(events.Warning(f"concurrency {c}: {level['failed']} request(s) failed (most often: {top})"))
    if level["completed"] == 0:
        on_event(events.Warning(f"concurrency {c}: no request completed inside the window; lengthen --duration"))
