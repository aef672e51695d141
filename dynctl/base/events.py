"""Progress of a host operation as small typed events, and the one place where the agent's records become them.

The CLI renders these with rich, the TUI in its actions panel; neither reads the agent's dicts. Bench adds
a sub-family of its own (`dynctl.bench.events`: levels and modes) and shares `Warning` and `Finished`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dynctl.base import sglang


@dataclass(frozen=True)
class StepStarted:
    step: str
    detail: str = ""


@dataclass(frozen=True)
class StepDone:
    step: str
    elapsed: float
    detail: str = ""


@dataclass(frozen=True)
class LogLine:
    """A line of the server's log."""

    text: str


@dataclass(frozen=True)
class Note:
    """What the operation says about its own progress ("release R in force", "stopped pid N")."""

    text: str


@dataclass(frozen=True)
class Warning:  # noqa: A001 - the event's name; use it as `events.Warning`
    text: str


@dataclass(frozen=True)
class Failed:
    step: str
    message: str
    log_tail: tuple[str, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The operation succeeded: `outcome` is what happened ("deployed"), `detail` the rest of the sentence."""

    operation: str
    outcome: str
    detail: str = ""
    elapsed: float | None = None  # seconds the operation took, where known

    @property
    def text(self) -> str:
        return f"{self.outcome} {self.detail}".rstrip()


@dataclass(frozen=True)
class Unchanged:
    """Nothing needed doing (the server is already stopped, the threshold already deployed), and nothing was done."""

    operation: str
    reason: str

    @property
    def text(self) -> str:
        return self.reason


Event = StepStarted | StepDone | LogLine | Note | Warning | Failed | Finished | Unchanged
EventSink = Callable[[Any], None]  # takes Event, and bench's sub-family where a bench runs


def ignore(event: Any) -> None:
    """The sink for callers that do not show progress."""


# --------------------------------------------------------------------------- the agent's records


def from_stop(result: dict[str, Any], elapsed: float) -> list[Event]:
    """A `server_stop` answer (also the result of an operation's "stop" step)."""
    if not result.get("stopped"):
        return [StepDone("stop", elapsed, result.get("message", "already stopped"))]
    out: list[Event] = []
    if result.get("escalated"):
        out.append(Warning(f"pid {result['pid']} did not exit within {result['grace_s']:g} s: sent SIGKILL"))
    for proc in result.get("swept", []):
        out.append(Warning(f"swept leftover pid {proc['pid']} of the old server: {one_line(proc.get('cmdline'))}"))
    out += [Warning(text) for text in result.get("warnings", [])]
    t = result.get("timings", {})
    parts = []
    if result.get("pid") is None:  # nothing ran: only a dead server's leftovers were swept
        parts.append(f"no server was running; swept {len(result.get('swept', []))} leftover process(es) of "
                     f"the previous server")
    if "sigterm_to_exit_s" in t:
        parts.append(f"pid {result['pid']} exited after {_secs(t['sigterm_to_exit_s'])}")
    parts.append(f"port free {_secs(t.get('exit_to_port_free_s', 0))} later")
    gpu = result.get("gpu") or {}
    if gpu.get("checked"):
        parts.append(f"GPU memory released {_secs(gpu['released_after_exit_s'])} after exit")
    out.append(StepDone("stop", elapsed, ", ".join(parts)))
    return out


def from_start(result: dict[str, Any], elapsed: float) -> StepDone:
    """A `server_start` answer (also the result of an operation's "start" step)."""
    if result.get("already_running"):
        return StepDone("start", elapsed, f"already running as pid {result['pid']}")
    how = f" with {result['launch']}" if result.get("launch") else ""
    log = f", log {result['log']}" if result.get("log") else ""
    argv = " ".join(sglang.redact_argv(result.get("argv") or []))
    return StepDone("start", elapsed, f"pid {result['pid']}{how}: {argv}{log}")


def from_ready_item(item: dict[str, Any]) -> list[Event]:
    """One item of the `server_wait_ready` stream; "ready" itself is the caller's."""
    kind = item.get("type")
    if kind == "log":
        return [LogLine(line) for line in item.get("lines", [])]
    if kind == "warning":
        return [Warning(item.get("text", ""))]
    return []  # "waiting" is a heartbeat: the log lines already show that the server is loading


def ready_detail(item: dict[str, Any]) -> str:
    gen = item.get("generate") or {}
    return f"pid {item['pid']} ready; /generate returned {gen.get('tokens', '?')} tokens"


class OperationEvents:
    """Reads one operation's records (`ops/<id>.jsonl`, as op_run and op_follow stream them) as events.

    Every operation writes its own steps (step_started, step_done with the seconds the host measured), so
    steps keep their true durations when `dynctl ops follow` replays an operation that ended long ago.
    """

    def __init__(self) -> None:
        self.step = ""

    def read(self, record: dict[str, Any]) -> list[Event]:
        kind = record.get("type")
        if kind == "step_started":
            self.step = record["step"]
            return [StepStarted(record["step"], record.get("detail") or "")]
        if kind == "step_done":
            return self._done(record["step"], record.get("seconds") or 0.0, record.get("result"))
        if kind == "log":
            return [LogLine(record.get("text", ""))]
        if kind in ("info", "prepared"):
            return [Note(record.get("text", ""))]
        if kind == "warning":
            return [Warning(record.get("text", ""))]
        if kind == "final" and not record.get("ok"):
            return [Failed(self.step or str(record.get("op_kind") or "operation"),
                           record.get("error") or "failed", tuple(record.get("log_tail") or ()))]
        return []  # "started" (the worker took it up), "waiting" (a heartbeat), a successful "final"

    @staticmethod
    def _done(step: str, seconds: float, result: dict[str, Any] | None) -> list[Event]:
        """A step's end; the verb answer a step carries (a restart's stop, start and ready) says how it went."""
        if result is None:
            return [StepDone(step, seconds)]
        if step == "stop":
            return from_stop(result, seconds)
        if step == "start":
            return [from_start(result, seconds)]
        if step == "ready":
            return [StepDone(step, seconds, ready_detail(result))]
        return [StepDone(step, seconds)]


def one_line(cmdline: list[str] | None, width: int = 100) -> str:
    """A process's command line on one line, even for `-c` code; API keys in it redacted."""
    return " ".join(" ".join(sglang.redact_argv(cmdline or [])).split())[:width]


def _secs(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"
