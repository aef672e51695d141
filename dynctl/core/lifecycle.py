"""The server's lifecycle on a host (SPEC §5): find, stop, start, wait until ready, logs. UI-free.

`stop`, `start` and `restart` are the commands as an operator asks for them, decisions included (already
stopped, already running, which argv, what to confirm): the CLI and the TUI's keys both call them. The
`*_server` functions below them call one agent verb each (the work happens on the host). Progress goes to
an `on_event` sink as `dynctl.base.events`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynctl.base import events, hostspec, sglang
from dynctl.core import operations
from dynctl.agent.client import AgentClient, AgentError
from dynctl.base.config import HostConfig, own_flag_in
from dynctl.base.errors import ConfigError, DynctlError, Interrupted, OperationFailed, PreflightError
from dynctl.base.events import EventSink

# The longest waits an operator may ask for; a value beyond them (inf, NaN) would hold the host lock without end.
# The agent enforces the same bounds (dynctl_agent.protocol.LIMITS).
MAX_GRACE_S = 3600.0  # a drain longer than an hour is a server that will not drain
MAX_READY_TIMEOUT_S = 7200.0  # eight times the default (900 s): room for the slowest model load
# Slack on top of the verb's own deadlines for the transport's timeout.
_SLACK_S = 60.0
_STOP_PORT_TIMEOUT_S = 30.0
_STOP_GPU_TIMEOUT_S = 60.0

Confirm = Callable[[str], None]  # asks the operator `question`; raises when they decline


def proceed(question: str) -> None:
    """The Confirm of a view that asked before it called (the TUI's dialogs), or of a caller that needs none."""


Adopt = Callable[[str], bool]  # asks whether to take over the operator's server; True only on the operator's word


def never_adopt(question: str) -> bool:
    """The Adopt of a caller that has no word from the operator for a takeover: the operator's server is refused."""
    return False


def operator_server(not_ours: dict[str, Any] | None) -> dict[str, Any] | None:
    """The operator's server (listening on the port, not started by dynctl) the host named, or None."""
    return not_ours if not_ours and not_ours.get("kind") == "operator" else None


def takeover(host: str, action: str, operator: dict[str, Any] | None, adopt: Adopt) -> dict[str, Any] | None:
    """The operator's word to take over their server, pinned to the process they were shown ({"pid", "start"}
    for the host, which checks it is still that process); None when no such server runs. Without the word, or
    for another user's server, a refusal (exit 3) that names it and says how to take it over."""
    if operator is None:
        return None
    pid = operator["pid"]
    what = f"pid {pid}, not started by dynctl ({events.one_line(operator.get('cmdline'), 200)})"
    if not operator.get("adoptable"):
        raise PreflightError(f"{host}: {action} refused: port is served by {what}, which runs as "
                             f"{operator.get('owner')}: dynctl never takes over another user's server, not even "
                             f"with --adopt; nothing was changed and nothing was killed -- stop it yourself, or "
                             f"name it with `dynctl stop --pid {pid}`")
    question = (f"Take over pid {pid} on {host}, which was not started by dynctl? It runs "
                f"{events.one_line(operator.get('cmdline'), 200)} (argv against what dynctl would run: "
                f"{operator.get('argv_diff') or '?'}). dynctl will stop it; its argv, environment and cwd become the "
                f"baseline release, which `dynctl rollback --to baseline` restarts as it was")
    if not adopt(question):
        raise PreflightError(f"{host}: {action} refused: the server on the port is {what}; nothing was changed "
                             f"and nothing was killed -- to take it over (its argv, environment and cwd become "
                             f"the baseline release), answer the takeover prompt on a terminal or add --adopt; "
                             f"--yes alone never takes over a server")
    return {"pid": pid, "start": operator["start"]}


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
    source: str | None = None  # pidfile (the only server that is ours)
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
    adopted: dict[str, Any] | None = None  # the adopted baseline: {"pid", "argv", "cwd", "env_keys", ...}

    @classmethod
    def from_agent(cls, raw: dict[str, Any]) -> ServerState:
        return cls(
            state=raw["state"], port=raw["port"], pid=raw.get("pid"), source=raw.get("source"),
            argv=tuple(raw.get("argv") or ()), uptime_s=raw.get("uptime_s"), started=raw.get("started"),
            release=raw.get("release"), health=raw.get("health"), pidfile=raw.get("pidfile") or "absent",
            log=raw.get("log"), port_owner=raw.get("port_owner"), leftovers=tuple(raw.get("leftovers") or ()),
            unmanaged=tuple(raw.get("unmanaged") or ()), not_ours=raw.get("not_ours"), in_force=raw.get("in_force"),
            adopted=raw.get("adopted"),
        )

    @property
    def running(self) -> bool:
        return self.pid is not None


def server_argv(host: HostConfig, extra: Sequence[str] = ()) -> list[str]:
    """The launch argv: configured launch + args + `extra` + the flags dynctl owns (--port, --enable-metrics)."""
    if flag := own_flag_in(host.args):  # config files are checked when read; hosts built in code are not
        raise ConfigError(f"hosts.{host.name}.args: remove {flag}; dynctl adds it itself (SPEC §3)")
    return hostspec.configured_argv(host.launch_argv(), [*host.args, *extra], host.port)


def launch_in_force(state: ServerState, host: HostConfig) -> tuple[list[str], str]:
    """The argv a plain start or restart runs, and why: the one recorded with the release in force (what
    deploy started, threshold included), else the adopted one, else the configured one: the agent's rule."""
    argv, how, _ = hostspec.plain_start(state.in_force, state.adopted, server_argv(host))
    return argv, how


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


def describe(state: ServerState) -> str:
    if state.pid is None:
        return "down"
    up = f", up {state.uptime_s:.0f} s" if state.uptime_s is not None else ""
    how = "adopted: not started by dynctl" if state.source == "adopted" else f"found by {state.source}"
    return f"{state.state}, pid {state.pid} ({how}{up})"


# --------------------------------------------------------------------------- the commands


def stop(agent: AgentClient, grace: float = 60.0, on_event: EventSink = events.ignore, confirm: Confirm = proceed,
         pid: int | None = None, adopt: Adopt = never_adopt) -> dict[str, Any]:
    """`dynctl stop [--pid N] [--adopt]` and the TUI's `s`: nothing to stop is not an error; a launcher dynctl
    did not start is refused (exit 3) unless the operator names it by pid, or takes the operator's listening
    server over (`adopt`: its launch becomes the baseline release first)."""
    name = agent.host.name
    state = find_server(agent)
    operator = operator_server(state.not_ours)
    if pid is None and state.pid is None and operator is not None:
        pinned = takeover(name, "stop", operator, adopt)
        what = f"pid {operator['pid']}, not started by dynctl, taken over"
        confirm(f"Stop the server on {name} ({what})?")
        result = stop_server(agent, grace, on_event, adopt=pinned)
        on_event(_stopped(name, what, result))
        return result
    if pid is not None:
        target = named_process(state, pid)
        started = "started" if pid == state.pid and state.source == "pidfile" else "did not start"
        confirm(f"Stop pid {pid} on {name} ({events.one_line(target.get('cmdline'), 120) or '?'}), which dynctl "
                f"{started}?")
        result = stop_server(agent, grace, on_event, pid=pid, pid_start=target.get("start"))
        on_event(_stopped(name, f"pid {pid}", result))
        return result
    if state.pid is None and not state.leftovers:
        not_ours = state.not_ours or {}
        if not_ours.get("kind") in ("unmanaged", "operator"):  # it looks like the server: refuse, name it, say how
            raise PreflightError(f"{name}: no server started by dynctl is running, and {not_ours['text']}: "
                                 f"nothing was signalled -- {not_ours.get('hint', '')}")
        note = f"; {not_ours['text']} (left alone)" if not_ours else ""
        on_event(events.Unchanged("stop", f"server on {name} is already stopped{note}"))
        return {"stopped": False, "message": "server already stopped" + note}
    what = f"pid {state.pid}" if state.pid else f"{len(state.leftovers)} leftover process(es) of the old server"
    confirm(f"Stop the server on {name} ({what})?")
    result = stop_server(agent, grace, on_event)
    on_event(_stopped(name, what, result))
    return result


def _stopped(host: str, what: str, result: dict[str, Any]) -> events.Finished | events.Unchanged:
    if not result.get("stopped"):  # it ended on its own between the look and the stop
        return events.Unchanged("stop", f"server on {host}: {result.get('message') or 'already stopped'}")
    return events.Finished("stop", "stopped", f"the server on {host} ({what})")


def named_process(state: ServerState, pid: int) -> dict[str, Any]:
    """The process `--pid` names, as the host described it; only the server, its leftovers or an sglang
    launcher for this port that dynctl did not start qualify."""
    if pid == state.pid:
        return {"pid": pid, "cmdline": list(state.argv)}
    operator = [operator_server(state.not_ours)] if operator_server(state.not_ours) else []
    for proc in (*operator, *state.unmanaged, *state.leftovers):
        if proc.get("pid") == pid:
            return proc
    known = [f"{p['pid']} ({events.one_line(p.get('cmdline'), 120) or '?'})" for p in (*operator, *state.unmanaged)]
    if state.pid is not None:
        known.insert(0, f"{state.pid} (the server)")
    raise PreflightError(f"pid {pid} is not an sglang server for port {state.port} on this host "
                         f"(candidates: {', '.join(known) or 'none'}); nothing was signalled")


def start(agent: AgentClient, host: HostConfig, ready_timeout: float = 900.0, on_event: EventSink = events.ignore,
          confirm: Confirm = proceed) -> dict[str, Any]:
    """`dynctl start` and the TUI's `S`: a running server is left as it is; else the launch argv of the release
    in force (else the configured one) is started and waited for."""
    state = find_server(agent)
    if state.pid is not None:
        on_event(events.Unchanged("start", f"server on {host.name} is already running: {describe(state)}"))
        return {"already_running": True, "pid": state.pid, "state": state.state}
    argv, how = launch_in_force(state, host)
    confirm(f"Start the server on {host.name} with {how}: {' '.join(sglang.redact_argv(argv))}?")
    started = start_server(agent, None, on_event=on_event, baseline_argv=server_argv(host))
    ready = wait_ready(agent, ready_timeout, on_event=on_event)
    on_event(events.Finished("start", "started", f"the server on {host.name}: pid {ready.get('pid')} ready"))
    return {"started": started, "ready": ready}


def restart(agent: AgentClient, host: HostConfig, grace: float = 60.0, ready_timeout: float = 900.0,
            on_event: EventSink = events.ignore, confirm: Confirm = proceed,
            adopt: Adopt = never_adopt, keep_live_threshold: bool = False) -> dict[str, Any]:
    """`dynctl restart` and the TUI's `R`: the launch argv of the release in force, else the baseline (an
    adopted launch, else the configured one). The operator's server (not started by dynctl) is restarted only
    on the operator's word (`adopt`), which adopts it first: with no release in force it comes back as it was.

    A threshold changed live (`dynctl threshold`) goes back to the launch's value, and the question says so;
    `keep_live_threshold` starts the launch with the live value instead."""
    state = find_server(agent)
    operator = operator_server(state.not_ours) if state.pid is None else None
    argv, how = launch_in_force(state, host)
    if operator is not None:  # the question shows what the restart will run, not the configured launch
        planned = argv if (state.in_force or {}).get("argv") else list(operator["cmdline"])
        operator = dict(operator, argv_diff=sglang.argv_diff(operator.get("cmdline") or [], planned))
    pinned = takeover(host.name, "restart", operator, adopt)
    if pinned is not None and not (state.in_force or {}).get("argv"):
        argv, how = list(operator["cmdline"]), f"its own launch (pid {operator['pid']}, adopted as the baseline)"
    given, note = None, ""
    live = live_threshold(agent) if state.pid is not None else None
    launched = threshold_of(argv)
    if live is not None and live != launched:
        if keep_live_threshold and launched is not None:
            given = with_threshold(argv, live)
            how += f", its threshold {launched} replaced by the live {live}"
            argv = given
        elif keep_live_threshold:
            raise PreflightError(f"{host.name}: --keep-live-threshold: the launch ({how}) sets no {sglang.THRESHOLD_FLAG} "
                                 f"to replace (a native or baseline launch); nothing was changed")
        else:
            note = (f"; the live threshold {live} goes back to "
                    f"{launched if launched is not None else 'none (the launch sets none)'}, the launch's value "
                    f"(--keep-live-threshold keeps {live})")
            on_event(events.Warning(f"threshold {live} was set live; the restart goes back to the launch's "
                                    f"{launched if launched is not None else 'none'}"))
    running = describe(state) if pinned is None else f"pid {operator['pid']}, not started by dynctl, taken over"
    confirm(f"Restart the server on {host.name} ({running}) with {how}: {' '.join(sglang.redact_argv(argv))}{note}?")
    return restart_server(agent, given, grace=grace, ready_timeout=ready_timeout, on_event=on_event,
                          baseline_argv=server_argv(host), adopt=pinned,
                          release=(state.in_force or {}).get("release") if given is not None else None)


def live_threshold(agent: AgentClient) -> int | None:
    """The threshold the running server reports in force (/server_info), or None when it reports none."""
    try:
        info = agent.call("server_info").get("info")
    except AgentError:
        return None
    return sglang.threshold_in_force(info) if info else None


def threshold_of(argv: Sequence[str]) -> int | None:
    """The threshold a launch argv sets (the last one, as argparse reads it), or None."""
    found = None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag == sglang.THRESHOLD_FLAG:
            raw = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            try:
                found = int(raw) if raw is not None else None
            except ValueError:
                found = None
    return found


def with_threshold(argv: Sequence[str], threshold: int) -> list[str]:
    """argv with every threshold flag's value replaced by `threshold`."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == sglang.THRESHOLD_FLAG and i + 1 < len(out):
            out[i + 1] = str(threshold)
        elif arg.startswith(sglang.THRESHOLD_FLAG + "="):
            out[i] = f"{sglang.THRESHOLD_FLAG}={threshold}"
    return out


# --------------------------------------------------------------------------- one agent verb each


def stop_server(agent: AgentClient, grace: float = 60.0, on_event: EventSink = events.ignore,
                pid: int | None = None, pid_start: int | None = None,
                adopt: dict[str, Any] | None = None) -> dict[str, Any]:
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
    if adopt is not None:
        params.update(adopt=adopt)
    with _patience(agent, grace + _STOP_PORT_TIMEOUT_S + _STOP_GPU_TIMEOUT_S + _SLACK_S):
        try:
            result = agent.call_through_drop("server_stop", "stop", **params)
        except AgentError as err:
            on_event(events.Failed("stop", str(err)))
            raise
        except KeyboardInterrupt:
            raise stop_interrupted(agent, grace) from None
    not_ours = result.get("not_ours") or {}
    if not result.get("stopped") and not_ours.get("kind") in ("unmanaged", "operator"):
        message = f"{agent.host.name}: {result['message']}"
        on_event(events.Failed("stop", message))
        raise PreflightError(message)
    for event in events.from_stop(result, time.monotonic() - t0):
        on_event(event)
    return result


def stop_interrupted(agent: AgentClient, grace: float, settle_s: float = 3.0) -> Interrupted:
    """After Ctrl-C during a stop: what the host says became of it. The agent runs apart from the terminal
    (its own session, SIGINT and SIGHUP ignored while it stops), so the stop normally goes on there; the words
    follow what the host reports, not that expectation."""
    name = agent.host.name
    old = agent.timeout
    agent.timeout = min(old, 15.0)
    deadline = time.monotonic() + settle_s
    try:
        while True:
            holder = agent.call("op_current")["holder"] or {}
            if holder.get("operation") == "stop":
                return Interrupted(f"{name}: interrupted; the stop continues on the host (agent pid {holder.get('pid')}"
                                   f", since {holder.get('started')}): SIGTERM, then SIGKILL after the {grace:g} s "
                                   "grace; `dynctl status` shows the server")
            state = find_server(agent)
            if state.pid is None and not state.leftovers:
                return Interrupted(f"{name}: interrupted, but the stop had already ended there: the server is down")
            if time.monotonic() >= deadline:  # the request may never have reached the agent
                return Interrupted(f"{name}: interrupted; no stop is running on the host and the server is still "
                                   f"{describe(state)}: run `dynctl stop` again")
            time.sleep(0.2)
    except (DynctlError, KeyboardInterrupt) as err:
        return Interrupted(f"{name}: interrupted; could not ask the host what became of the stop "
                           f"({err or 'interrupted again'}): `dynctl status` shows the server")
    finally:
        agent.timeout = old


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
        on_event(events.StepStarted("start", " ".join(sglang.redact_argv(argv))))
    else:
        params["baseline_argv"] = list(baseline_argv or [])
        on_event(events.StepStarted("start", "with the launch argv of the release in force, else the configured one"))
    t0 = time.monotonic()
    try:
        result = agent.call_through_drop("server_start", "start", **params)
    except AgentError as err:
        on_event(events.Failed("start", str(err)))
        raise
    on_event(events.from_start(result if argv is None else {k: v for k, v in result.items() if k != "launch"},
                               time.monotonic() - t0))
    return result


def wait_ready(agent: AgentClient, ready_timeout: float = 900.0,
               on_event: EventSink = events.ignore) -> dict[str, Any]:
    """Stream the log until /health_generate is 200 and one /generate returns tokens; raise on crash/timeout."""
    on_event(events.StepStarted("ready", f"/health_generate and one /generate, up to {ready_timeout:g} s"))
    t0 = time.monotonic()
    try:
        for item in agent.stream_through_drop("server_wait_ready", ready_timeout=ready_timeout):
            if item.get("type") == "ready":
                on_event(events.StepDone("ready", time.monotonic() - t0, events.ready_detail(item)))
                return item
            for event in events.from_ready_item(item):
                on_event(event)
    except AgentError as err:
        raise _start_failed(err, on_event) from None
    raise OperationFailed("the readiness stream ended without an answer")


def restart_server(agent: AgentClient, argv: Sequence[str] | None = None, env: dict[str, str] | None = None,
                   grace: float = 60.0, ready_timeout: float = 900.0,
                   on_event: EventSink = events.ignore, baseline_argv: Sequence[str] | None = None,
                   adopt: dict[str, Any] | None = None, release: str | None = None) -> dict[str, Any]:
    """stop → start → wait as ONE operation on the host (a dropped connection cannot leave it between, and
    the client follows it through reconnects).

    argv None: the launch argv of the release in force, else the baseline (an adopted launch, else
    `baseline_argv`), else the last recorded start. adopt: the operator's word ({"pid", "start"}) to take
    over their server that runs on the port.
    """
    params: dict[str, Any] = {"grace": grace, "ready_timeout": ready_timeout}
    if adopt is not None:
        params["adopt"] = adopt
    if argv is not None:
        params.update(argv=list(argv), env=dict(env or {}))
        if release is not None:
            params.update(release=release)
    elif baseline_argv is not None:
        params.update(baseline_argv=list(baseline_argv))

    def failure(final: dict[str, Any], message: str) -> DynctlError:
        if final.get("reason"):  # the server did not become ready: crash, traceback or timeout
            return ServerStartFailed(message, final["reason"], final.get("log_tail") or (), final.get("pid"))
        return operations.error_for(final, message)

    return operations.execute(agent, "restart", params, on_event, failure)


def _start_failed(err: AgentError, on_event: EventSink) -> ServerStartFailed:
    answer = err.answer
    tail = answer.get("log_tail") or []
    on_event(events.Failed("ready", str(err), tuple(tail)))
    return ServerStartFailed(str(err), answer.get("reason") or "failed", tail, answer.get("pid"))


def read_log(agent: AgentClient, lines: int = 100) -> list[str]:
    return list(agent.call("server_logs", lines=lines)["lines"])


def log_utc_offset(agent: AgentClient) -> float | None:
    """Seconds east of UTC of the host's clock, in which the server stamps its log; None from an older agent."""
    return agent.call("server_logs", lines=0).get("utc_offset")


def follow_log(agent: AgentClient, lines: int = 20, max_seconds: float | None = None) -> Iterator[str]:
    """The log's last lines, then new ones as they come (until the caller stops iterating)."""
    for item in agent.stream("server_logs_follow", lines=lines, max_seconds=max_seconds):
        yield from item.get("lines", [])
