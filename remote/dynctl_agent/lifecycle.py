"""The server lifecycle verbs (find, stop, start, wait until ready, logs) and the restart operation."""

from __future__ import annotations

import os
import signal
import time

from dynctl.base import hostspec
from dynctl_agent import lock, releases, servers, shutdown, startup
from dynctl_agent.protocol import AgentError, seconds


def server_find(ctx):
    return servers.find(ctx)


def server_stop(ctx, grace=60, port_timeout=30, gpu_timeout=60, pid=None, pid_start=None, adopt=None):
    """Stop our server; the operator's server only when named (`pid`) or taken over (`adopt`, which first
    records its launch as the baseline release)."""
    waits = seconds("grace", grace), seconds("port_timeout", port_timeout), seconds("gpu_timeout", gpu_timeout)
    # A stop, once begun, runs to its end (SIGTERM, grace, SIGKILL, sweep): a dropped channel or a Ctrl-C that
    # reaches this process does not cut it between its signals, and a full disk does not prevent it.
    with lock.host_lock(ctx, "stop", best_effort=True) as holder, lock.hangup_shield(signal.SIGINT):
        if adopt and pid is None:
            taking = servers.takeover(ctx, servers.locate(ctx), "stop", adopt)
            if taking is not None:
                releases.record_adopted(ctx, servers.adoption(ctx, taking))
                pid, pid_start = taking["pid"], taking["start"]
        result = shutdown.stop_server(ctx, *waits, pid=pid, pid_start=pid_start)
    if holder.get("unrecorded"):
        result.setdefault("warnings", []).append("%s: stopped without it" % holder["unrecorded"])
    return result


def _resolve_launch(ctx, argv, release, baseline_argv, adopting=None):
    """(argv, release, how, launch) of a start: the caller's argv, else hostspec.plain_start's choice (the
    release in force, the adopted launch, being adopted now when `adopting`, the configured one)."""
    if argv is not None:
        return argv, release, "the given launch argv", None
    releases.require_records(ctx)  # an unreadable record must not turn into "start the configured argv"
    in_force = releases.launch_in_force(ctx)
    chosen, how, adopted = hostspec.plain_start(in_force, adopting or releases.adopted(ctx), baseline_argv)
    if adopted is not None:
        return chosen, None, how, releases.adopted_launch(adopted)
    if chosen is None:
        return None, release, None, None
    return chosen, in_force["release"] if in_force and in_force.get("argv") else None, how, None


def server_start(ctx, argv=None, env=None, release=None, baseline_argv=None):
    with lock.host_lock(ctx, "start"), lock.hangup_shield():
        argv, release, how, launch = _resolve_launch(ctx, argv, release, baseline_argv)
        if argv is None:
            raise AgentError("start: no argv given, no release in force and no configured launch", "usage")
        result = startup.start_server(ctx, argv, env, release, launch)
        result["launch"] = how
        return result


def _raise_failed(items):
    """Stream items as the client expects them (ok: true each); a failure ends the stream as an error."""
    for item in items:
        if item.get("type") == "failed":
            extra = {k: v for k, v in item.items() if k not in ("message", "type")}
            raise AgentError(item["message"], "failed", **extra)
        item.setdefault("ok", True)
        yield item


def server_wait_ready(ctx, ready_timeout=900, generate=True):
    return _raise_failed(startup.wait_ready(ctx, seconds("ready_timeout", ready_timeout), bool(generate)))


def op_restart(ctx, oplog, argv=None, env=None, release=None, grace=60, ready_timeout=900, baseline_argv=None,
               adopt=None):
    """The restart operation, run by the worker: stop → start → ready, each a step of its records; stop and
    start under one lock and one hangup shield, so nothing cuts the restart between them. Returns the ready
    server (its pid) for the final record.

    adopt: the operator's word for taking over their server that runs on the port (servers.takeover): its
    launch becomes the baseline release, so with no release in force it is restarted as it was launched.
    """
    grace, ready_timeout = seconds("grace", grace), seconds("ready_timeout", ready_timeout)
    with lock.host_lock(ctx, "restart"):
        with lock.hangup_shield():
            rec = servers.read_pidfile(ctx) or {}
            taking = servers.preflight(ctx, servers.locate(ctx), "restart", adopt)
            adopting = servers.adoption(ctx, taking) if taking is not None else None
            argv, release, how, launch = _resolve_launch(ctx, argv, release, baseline_argv, adopting)
            if argv is None:  # the last start, as recorded (the pidfile is 0600: env values may be secret)
                argv, how = rec.get("argv"), "the launch argv of the last start"
                release = rec.get("release") if release is None else release
                if not argv:
                    raise AgentError("restart: no argv given and no previous start recorded in %s" % ctx.workdir,
                                     "usage")
            if env is None and launch is None and rec.get("argv") == argv:
                env = rec.get("env")
            with oplog.step("stop", "SIGTERM, drain up to %gs, then SIGKILL" % grace) as done:
                if adopting is not None:
                    releases.record_adopted(ctx, adopting)
                    stopped = shutdown.stop_server(ctx, grace, pid=taking["pid"], pid_start=taking["start"])
                else:
                    stopped = shutdown.stop_server(ctx, grace)
                done["result"] = stopped
            oplog.release_room()  # nothing to roll back to: once stopped, the start may use the room kept for undoing
            with oplog.step("start", how) as done:
                done["result"] = _start_after_stop(ctx, argv, env, release, launch, stopped)
                done["result"]["launch"] = how
    with oplog.step("ready", "/health_generate and one /generate, up to %gs" % ready_timeout) as done:
        done["result"] = startup.await_ready(ctx, oplog, ready_timeout)
    return done["result"]


def _start_after_stop(ctx, argv, env, release, launch, stopped):
    try:
        return startup.start_server(ctx, argv, env, release, launch)
    except Exception as err:  # a refusal, or a disk too full for the log: the server stays stopped
        if isinstance(err, AgentError) and not ctx.changed:
            raise
        why = err if isinstance(err, AgentError) else "%s: %s" % (type(err).__name__,
                                                                 getattr(err, "strerror", None) or err)
        raise AgentError("restart: %s, but the new server was not started: %s"
                         % (shutdown.summary(stopped), why), "failed",
                         **(err.extra if isinstance(err, AgentError) else {}))


def server_logs(ctx, lines=200):
    path = servers.log_path(ctx)
    offset = time.localtime().tm_gmtoff  # the zone the server stamps its lines in
    if path is None:
        return {"path": None, "exists": False, "lines": [], "utc_offset": offset,
                "note": "the adopted server writes no log file dynctl can read (its output goes to a terminal)"}
    return {"path": path, "exists": os.path.isfile(path), "lines": startup.log_tail(path, int(lines)),
            "utc_offset": offset}


def server_logs_follow(ctx, lines=20, max_seconds=None):
    return _raise_failed(startup.follow_server_log(ctx, int(lines), None if max_seconds is None else float(max_seconds)))
