"""The server lifecycle verbs (find, stop, start, restart, wait until ready, logs) and the restart operation."""

from __future__ import annotations

import os

from dynctl_agent import lock, releases, servers, shutdown, startup
from dynctl_agent.protocol import AgentError


def _no_extra(name, extra):
    if extra:
        raise AgentError("%s: unknown parameter(s) %s" % (name, ", ".join(sorted(extra))), "usage")


def server_find(ctx, **extra):
    _no_extra("server_find", extra)
    return servers.find(ctx)


def server_stop(ctx, grace=60, port_timeout=30, gpu_timeout=60, pid=None, pid_start=None, **extra):
    _no_extra("server_stop", extra)
    with lock.host_lock(ctx, "stop"), lock.hangup_shield():
        return shutdown.stop_server(ctx, float(grace), float(port_timeout), float(gpu_timeout), pid, pid_start)


def _resolve_launch(ctx, argv, release, baseline_argv):
    """(argv, release, how) of a start: the caller's argv, else the one recorded with the release in force
    (what deploy started, so a start after a stop keeps the threshold), else the configured one."""
    if argv is not None:
        return argv, release, "the given launch argv"
    releases.require_records(ctx)  # an unreadable record must not turn into "start the configured argv"
    in_force = releases.launch_in_force(ctx)
    if in_force is not None and in_force["argv"]:
        return in_force["argv"], in_force["release"], "the launch argv of release %s" % in_force["release"]
    if baseline_argv:
        why = ("release %s records none" % in_force["release"]) if in_force else "no release in force"
        return list(baseline_argv), None, "the configured launch argv (%s)" % why
    return None, release, None


def server_start(ctx, argv=None, env=None, release=None, baseline_argv=None, **extra):
    _no_extra("server_start", extra)
    with lock.host_lock(ctx, "start"), lock.hangup_shield():
        argv, release, how = _resolve_launch(ctx, argv, release, baseline_argv)
        if argv is None:
            raise AgentError("start: no argv given, no release in force and no configured launch", "usage")
        result = startup.start_server(ctx, argv, env, release)
        result["launch"] = how
        return result


def _raise_failed(items):
    """Stream items as the client expects them (ok: true each); a failure ends the stream as an error."""
    for item in items:
        if item.get("event") == "failed":
            extra = {k: v for k, v in item.items() if k not in ("message", "event")}
            raise AgentError(item["message"], "failed", **extra)
        item.setdefault("ok", True)
        yield item


def server_wait_ready(ctx, ready_timeout=900, generate=True, **extra):
    _no_extra("server_wait_ready", extra)
    return _raise_failed(startup.wait_ready(ctx, float(ready_timeout), bool(generate)))


def server_restart(ctx, argv=None, env=None, release=None, grace=60, ready_timeout=900, baseline_argv=None,
                        **extra):
    """stop → start → wait_ready in one agent process, so a dropped connection cannot leave it between."""
    _no_extra("server_restart", extra)
    with lock.host_lock(ctx, "restart"):
        with lock.hangup_shield():
            rec = servers.read_pidfile(ctx) or {}
            argv, release, how = _resolve_launch(ctx, argv, release, baseline_argv)
            if argv is None:  # the last start, as recorded (the pidfile is 0600: env values may be secret)
                argv, how = rec.get("argv"), "the launch argv of the last start"
                release = rec.get("release") if release is None else release
                if not argv:
                    raise AgentError("restart: no argv given and no previous start recorded in %s" % ctx.workdir,
                                     "usage")
            if env is None and rec.get("argv") == argv:
                env = rec.get("env")
            servers.preflight(ctx, servers.locate(ctx), "restart")
            stopped = shutdown.stop_server(ctx, float(grace))
            try:
                started = startup.start_server(ctx, argv, env, release)
            except AgentError as err:
                if not ctx.changed:
                    raise
                raise AgentError("restart: %s, but the new server was not started: %s"
                                 % (shutdown.summary(stopped), err), "failed", **err.extra)
            started["launch"] = how
        yield {"ok": True, "event": "stopped", "result": stopped}
        yield {"ok": True, "event": "started", "result": started}
        for item in _raise_failed(startup.wait_ready(ctx, float(ready_timeout))):
            yield item


def server_logs(ctx, lines=200, **extra):
    _no_extra("server_logs", extra)
    path = ctx.path(servers.LOG)
    return {"path": path, "exists": os.path.isfile(path), "lines": startup.log_tail(path, int(lines))}


def server_logs_follow(ctx, lines=20, max_seconds=None, **extra):
    _no_extra("server_logs_follow", extra)
    return _raise_failed(startup.follow_server_log(ctx, int(lines), None if max_seconds is None else float(max_seconds)))


def op_restart(ctx, oplog, **params):
    """The restart verb's stop → start → ready, run by the worker: its items become the operation's events."""
    for item in server_restart(ctx, **params):
        kind = item.get("event")
        if kind == "ready":
            return {k: v for k, v in item.items() if k not in ("ok", "event")}
        if kind == "log":
            for line in item.get("lines") or []:
                oplog.log(line)
        elif kind == "warning":
            oplog.emit("warning", text=item.get("text"))
        elif kind == "waiting":
            oplog.emit("waiting", seconds=item.get("elapsed"), detail=item.get("detail"))
        else:  # "stopped", "started" (named apart from the worker's own "started")
            oplog.emit("server_" + kind, **{k: v for k, v in item.items() if k not in ("ok", "event")})
    raise AgentError("the restart ended without a verdict", "failed")
