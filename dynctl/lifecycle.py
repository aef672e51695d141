"""The server's lifecycle on a host (SPEC §5): find, stop, start, wait until ready, logs. UI-free.

Each function calls one agent verb (the work happens on the host) and reports progress as
`dynctl.events` to an `on_event` sink; the CLI prints them, the TUI shows them in a panel.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynctl import events, operations
from dynctl.agent import AgentClient, AgentError
from dynctl.config import HostConfig
from dynctl.errors import ConfigError, DynctlError, OperationFailed, PreflightError
from dynctl.events import EventSink

# dynctl adds these itself (SPEC §3); a config that sets them would fight with it.
_OWN_FLAGS = ("--port", "--enable-metrics")
# Slack on top of the verb's own deadlines for the transport's timeout.
_SLACK_S = 60.0
_STOP_PORT_TIMEOUT_S = 30.0
_STOP_GPU_TIMEOUT_S = 60.0


class ServerStartFailed(OperationFailed):
    """The server did not become ready: it crashed, logged a Traceback, or timed out."""

    def __init__(self, message: str, reason: str, log_tail: Sequence[str], pid: int | None) -> None:
        super().__init__(message)
        self.reason = reason
        self.log_tail = tuple(log_tail)
        self.pid = pid


@dataclass(frozen=True)
class ServerState:
    """What `server_find` saw: state is down / starting / ready / draining."""

    state: str
    port: int
    pid: int | None = None
    source: str | None = None  # pidfile / port / cmdline
    argv: tuple[str, ...] = ()
    uptime_s: float | None = None
    started: str | None = None
    release: str | None = None
    health: int | None = None
    pidfile: str = "absent"
    log: str | None = None
    port_owner: dict[str, Any] | None = None  # a listener on the port that dynctl does not manage
    leftovers: tuple[dict[str, Any], ...] = field(default=())  # live processes of a previous server
    # sglang launchers for this port that dynctl did not start and that do not listen: named, never signalled
    unmanaged: tuple[dict[str, Any], ...] = field(default=())
    not_ours: dict[str, Any] | None = None  # what is in the server's way and not ours, with the agent's words
    in_force: dict[str, Any] | None = None  # {"release", "argv"} of the release in force: what start runs

    @classmethod
    def from_agent(cls, raw: dict[str, Any]) -> ServerState:
        return cls(
            state=raw["state"], port=raw["port"], pid=raw.get("pid"), source=raw.get("source"),
            argv=tuple(raw.get("argv") or ()), uptime_s=raw.get("uptime_s"), started=raw.get("started"),
            release=raw.get("release"), health=raw.get("health"), pidfile=raw.get("pidfile") or "absent",
            log=raw.get("log"), port_owner=raw.get("port_owner"), leftovers=tuple(raw.get("leftovers") or ()),
            unmanaged=tuple(raw.get("unmanaged") or ()), not_ours=raw.get("not_ours"), in_force=raw.get("in_force"),
        )

    @property
    def running(self) -> bool:
        return self.pid is not None


def server_argv(host: HostConfig, extra: Sequence[str] = ()) -> list[str]:
    """The launch argv: configured launch + args + `extra` + the flags dynctl owns (--port, --enable-metrics)."""
    for flag in _OWN_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in host.args):
            raise ConfigError(f"hosts.{host.name}.args: remove {flag}; dynctl adds it itself (SPEC §3)")
    return [*host.launch_argv(), *host.args, *extra, "--port", str(host.port), "--enable-metrics"]


def launch_in_force(state: ServerState, host: HostConfig) -> tuple[list[str], str]:
    """The argv a plain start or restart runs, and why: the one recorded with the release in force (what
    deploy started, threshold included), else the configured one. The agent decides the same way."""
    in_force = state.in_force or {}
    if in_force.get("argv"):
        return list(in_force["argv"]), f"the launch argv of release {in_force['release']}"
    why = f"release {in_force['release']} records none" if in_force else "no release in force"
    return server_argv(host), f"the configured launch argv ({why})"


@contextlib.contextmanager
def _patience(agent: AgentClient, seconds: float) -> Iterator[None]:
    """Let one long verb (a drain, a model load) outlast the client's default timeout."""
    old = agent.timeout
    agent.timeout = max(old, seconds)
    try:
        yield
    finally:
        agent.timeout = old


def find_server(agent: AgentClient) -> ServerState:
    return ServerState.from_agent(agent.call("server_find"))


def stop_server(agent: AgentClient, grace: float = 60.0, on_event: EventSink = events.ignore,
                pid: int | None = None, pid_start: int | None = None) -> dict[str, Any]:
    """SIGTERM, drain up to `grace`, SIGKILL, sweep the server's tree, wait for port and GPU to be free.

    A launcher of an sglang server that dynctl did not start is never signalled unless the operator names
    it (`pid`, with the start time they confirmed); without that, stop refuses and names it (exit 3).
    """
    if grace < 0:
        raise ValueError("grace must be >= 0")
    what = f"pid {pid}, named by the operator: " if pid is not None else ""
    on_event(events.StepStarted("stop", f"{what}SIGTERM, drain up to {grace:g} s"))
    t0 = time.monotonic()
    params: dict[str, Any] = {"grace": grace, "port_timeout": _STOP_PORT_TIMEOUT_S, "gpu_timeout": _STOP_GPU_TIMEOUT_S}
    if pid is not None:
        params.update(pid=pid, pid_start=pid_start)
    with _patience(agent, grace + _STOP_PORT_TIMEOUT_S + _STOP_GPU_TIMEOUT_S + _SLACK_S):
        try:
            result = agent.call_through_drop("server_stop", "stop", **params)
        except AgentError as err:
            on_event(events.Failed("stop", str(err)))
            raise
    not_ours = result.get("not_ours") or {}
    if not result.get("stopped") and not_ours.get("kind") == "unmanaged":
        message = f"{agent.host.name}: {result['message']}"
        on_event(events.Failed("stop", message))
        raise PreflightError(message)
    report_stop(result, time.monotonic() - t0, on_event)
    return result


def report_stop(result: dict[str, Any], elapsed: float, on_event: EventSink) -> None:
    """Turn a `server_stop` result into events (shared with restart)."""
    if not result.get("stopped"):
        on_event(events.StepDone("stop", elapsed, result.get("message", "already stopped")))
        return
    t = result.get("timings", {})
    if result.get("escalated"):
        on_event(events.Warning(f"pid {result['pid']} did not exit within {result['grace_s']:g} s: sent SIGKILL"))
    for proc in result.get("swept", []):
        cmd = " ".join(" ".join(proc.get("cmdline") or []).split())[:100]  # one line, even for `-c` code
        on_event(events.Warning(f"swept leftover pid {proc['pid']} of the old server: {cmd}"))
    for text in result.get("warnings", []):
        on_event(events.Warning(text))
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
    on_event(events.StepDone("stop", elapsed, ", ".join(parts)))


def _secs(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def start_server(agent: AgentClient, argv: Sequence[str] | None, env: dict[str, str] | None = None,
                 release: str | None = None, on_event: EventSink = events.ignore,
                 baseline_argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Start argv detached on the host (own session, log and pidfile in workdir); returns at once.

    argv None: the launch argv recorded with the release in force, else `baseline_argv` (the configured
    one); the host decides, under its lock, and the result's "launch" says which.
    """
    params: dict[str, Any] = {"env": dict(env or {}), "release": release}
    if argv is not None:
        params["argv"] = list(argv)
        on_event(events.StepStarted("start", " ".join(argv)))
    else:
        params["baseline_argv"] = list(baseline_argv or [])
        on_event(events.StepStarted("start", "with the launch argv of the release in force, else the configured one"))
    t0 = time.monotonic()
    try:
        result = agent.call_through_drop("server_start", "start", **params)
    except AgentError as err:
        on_event(events.Failed("start", str(err)))
        raise
    how = f" with {result['launch']}" if argv is None and result.get("launch") else ""
    if result.get("already_running"):
        on_event(events.StepDone("start", time.monotonic() - t0, f"already running as pid {result['pid']}"))
    else:
        on_event(events.StepDone("start", time.monotonic() - t0,
                                 f"pid {result['pid']}{how}: {' '.join(result.get('argv') or [])}, "
                                 f"log {result['log']}"))
    return result


def wait_ready(agent: AgentClient, ready_timeout: float = 900.0,
               on_event: EventSink = events.ignore) -> dict[str, Any]:
    """Stream the log until /health_generate is 200 and one /generate returns tokens; raise on crash/timeout."""
    on_event(events.StepStarted("ready", f"/health_generate and one /generate, up to {ready_timeout:g} s"))
    t0 = time.monotonic()
    try:
        for item in agent.stream_through_drop("server_wait_ready", ready_timeout=ready_timeout):
            done = _relay_ready_item(item, on_event)
            if done is not None:
                on_event(events.StepDone("ready", time.monotonic() - t0, _ready_detail(done)))
                return done
    except AgentError as err:
        raise _start_failed(err, on_event) from None
    raise OperationFailed("the readiness stream ended without an answer")


def restart_server(agent: AgentClient, argv: Sequence[str] | None = None, env: dict[str, str] | None = None,
                   grace: float = 60.0, ready_timeout: float = 900.0,
                   on_event: EventSink = events.ignore, baseline_argv: Sequence[str] | None = None) -> dict[str, Any]:
    """stop → start → wait as ONE operation on the host (a dropped connection cannot leave it between, and
    the client follows it through reconnects).

    argv None: the launch argv of the release in force, else `baseline_argv`, else the last recorded start.
    """
    on_event(events.StepStarted("stop", f"SIGTERM, drain up to {grace:g} s"))
    t0 = time.monotonic()
    params: dict[str, Any] = {"grace": grace, "ready_timeout": ready_timeout}
    if argv is not None:
        params.update(argv=list(argv), env=dict(env or {}))
    elif baseline_argv is not None:
        params.update(baseline_argv=list(baseline_argv))

    def relay(event: dict[str, Any], sink: EventSink) -> None:
        nonlocal t0
        kind = event.get("type")
        if kind == "server_stopped":
            report_stop(event["result"], time.monotonic() - t0, sink)
            t0 = time.monotonic()
            sink(events.StepStarted("start", "as recorded" if argv is None else " ".join(argv)))
        elif kind == "server_started":
            started = event["result"]
            how = f" with {started['launch']}" if argv is None and started.get("launch") else ""
            sink(events.StepDone("start", time.monotonic() - t0,
                                 f"pid {started['pid']}{how}: {' '.join(started.get('argv') or [])}"))
            t0 = time.monotonic()
            sink(events.StepStarted("ready", f"up to {ready_timeout:g} s"))
        elif kind in ("log", "warning"):
            operations.relay(event, sink)

    def failure(final: dict[str, Any], message: str) -> DynctlError:
        if final.get("reason"):  # the server did not become ready: crash, traceback or timeout
            return ServerStartFailed(message, final["reason"], final.get("log_tail") or (), final.get("pid"))
        return operations.error_for(final, message)

    done = operations.execute(agent, "restart", params, on_event, relay, failure)
    on_event(events.StepDone("ready", time.monotonic() - t0, _ready_detail(done)))
    return done


def _relay_ready_item(item: dict[str, Any], on_event: EventSink) -> dict[str, Any] | None:
    kind = item.get("event")
    if kind == "log":
        for line in item.get("lines", []):
            on_event(events.LogLine(line))
    elif kind == "warning":
        on_event(events.Warning(item.get("text", "")))
    elif kind == "ready":
        return item
    return None


def _ready_detail(item: dict[str, Any]) -> str:
    gen = item.get("generate") or {}
    return f"pid {item['pid']} ready; /generate returned {gen.get('tokens', '?')} tokens"


def _start_failed(err: AgentError, on_event: EventSink) -> ServerStartFailed:
    answer = err.answer
    tail = answer.get("log_tail") or []
    on_event(events.Failed("ready", str(err), tuple(tail)))
    return ServerStartFailed(str(err), answer.get("reason") or "failed", tail, answer.get("pid"))


def read_log(agent: AgentClient, lines: int = 100) -> list[str]:
    return list(agent.call("server_logs", lines=lines)["lines"])


def follow_log(agent: AgentClient, lines: int = 20, max_seconds: float | None = None) -> Iterator[str]:
    """The log's last lines, then new ones as they come (until the caller stops iterating)."""
    for item in agent.stream("server_logs_follow", lines=lines, max_seconds=max_seconds):
        yield from item.get("lines", [])
