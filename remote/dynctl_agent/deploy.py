"""Deploy and rollback, the operations: one detached worker on the host runs the whole critical
sequence, so the host ends on the old or the new release whatever happens to the connection.

  deploy:   recover an interrupted release → validate + back up + switch (patch.apply_release: nothing is
            touched unless every candidate compiles) → stop the old server → start the new argv →
            health gate → read the threshold back from /server_info. Any failure after the switch:
            revert the release, start the previous argv, health-gate it, report "rolled back to R".
  rollback: revert every release newer than the target (default: the one before the release in
            force; "baseline" = no release) → stop whatever runs → start the target's argv → gate.
            A second rollback right after the first stays where it is (workdir/state.json says so).
"""

from __future__ import annotations

import time

from dynctl_agent import lock, patch, procfs, releases, serverinfo, servers, shutdown, startup, store
from dynctl_agent.protocol import AgentError

STATE_FILE = serverinfo.STATE_FILE
DEFAULT_SOAK_S = 5.0


def _previous_argv(ctx, baseline_argv):
    in_force = releases.launch_in_force(ctx)
    if in_force is None:
        return None, baseline_argv
    return in_force["release"], in_force["argv"] or baseline_argv


def _state(ctx):
    return store.read_json(ctx.path(STATE_FILE)) or {}


def _set_state(ctx, **fields):
    state = _state(ctx)
    state.update(fields)
    state["updated"] = store.now_iso()
    store.write_json_atomic(ctx.path(STATE_FILE), state)


def _gate(ctx, oplog, argv, release, ready_timeout):
    """Start argv and wait until it serves; raise AgentError with the log tail when it does not."""
    with oplog.step("start", " ".join(argv)):
        started = startup.start_server(ctx, argv, release=release)
        oplog.emit("info", text="server pid %s" % started.get("pid"))
    with oplog.step("health", "waiting for /health_generate and one /generate"):
        for item in startup.wait_ready(ctx, ready_timeout=ready_timeout):
            if item.get("event") == "log":
                for line in item["lines"]:
                    oplog.log(line)
            elif item.get("event") == "waiting":
                oplog.emit("waiting", seconds=item.get("elapsed"), detail=item.get("detail"))
            elif item.get("event") == "warning":
                oplog.emit("warning", text=item.get("text"))
            elif item.get("event") == "failed":
                raise AgentError(item.get("message") or "the server did not become ready", "failed",
                                 reason=item.get("reason"), log_tail=item.get("log_tail") or [])
            elif item.get("event") == "ready":
                return item
    raise AgentError("the readiness check ended without a verdict", "failed")


def _verify(ctx, oplog, strategy, threshold, effective=None):
    """The threshold the new server enforces, as it reports it; `effective` is what the plan expects a native
    server to enforce (the requested threshold after sglang's CUDA-graph padding)."""
    with oplog.step("verify", "reading the threshold back from /server_info"):
        info = serverinfo.server_info(ctx)
        if info is None:
            raise AgentError("/server_info did not answer after the server became ready", "failed")
        if strategy == "native":
            adaptive = bool(info.get("speculative_adaptive"))
            if threshold is not None and threshold < 0:  # never disable: speculation as configured, no config
                if adaptive:
                    raise AgentError("threshold -1 must run without --speculative-adaptive, but it is on", "failed")
                return {"threshold_in_force": threshold, "threshold_requested": threshold}
            if not adaptive:
                raise AgentError("the server runs without --speculative-adaptive", "failed")
            cut, problem = serverinfo.adaptive_threshold(info)
            if problem is not None:
                raise AgentError("the server's threshold cannot be read back: %s" % problem, "failed")
            expected = threshold if effective is None else effective
            if cut != expected:
                raise AgentError("the server's adaptive config disables speculation above %r, expected %r"
                                 % (cut, expected), "failed")
            return {"threshold_in_force": cut, "threshold_requested": threshold,
                    "adaptive_config": info.get("speculative_adaptive_config")}
        value = serverinfo.threshold_in_force(info)
        if value != threshold:
            raise AgentError("the server reports threshold %r, expected %r" % (value, threshold), "failed")
        return {"threshold_in_force": value}


def _recover(ctx, oplog):
    """An interrupted release (worker killed mid-switch) is reverted before anything else happens."""
    recovered = []
    for m in releases.manifests(ctx):
        if m.get("state") == "applying":
            oplog.warn("release %s was interrupted; reverting it first" % m["id"])
            patch.revert_release(ctx, m["id"])
            recovered.append(m["id"])
    return recovered


def _rollback_target(ctx, to, manifests):
    """`rollback --to` as typed: a release id or a unique prefix (or sequence number) of one in force,
    "baseline", "latest" (the release in force) or "previous" (None: the one before it). Anything else is a
    usage error that names the candidates, raised before anything changes."""
    ids = [m["id"] for m in manifests if m.get("state") == "applied"]
    if to is None or to == "previous":
        return None
    if to == "latest":
        return ids[0] if ids else releases.BASELINE
    text = str(to).strip()
    if text == releases.BASELINE or text in ids:
        return text
    matches = [i for i in ids if i.startswith(text)]
    if not matches and text.isdigit():
        matches = [i for i in ids if int(i.split("-")[0]) == int(text)]
    if len(matches) == 1:
        return matches[0]
    in_force = ", ".join(ids + [releases.BASELINE])
    if matches:
        raise AgentError("release %r is ambiguous on %s: it could be %s; give more of the id; nothing was changed"
                         % (text, ctx.name, ", ".join(matches)), "usage")
    other = [m for m in manifests if m["id"].startswith(text) or m["id"] == text]
    if other:
        raise AgentError("release %s on %s is %s, not in force: rollback returns to one in force (%s); nothing "
                         "was changed" % (other[0]["id"], ctx.name, other[0].get("state"), in_force), "usage")
    raise AgentError("no release %r in force on %s to roll back to (in force: %s; also latest, previous); "
                     "nothing was changed" % (text, ctx.name, in_force), "usage")


def _soak(ctx, oplog, seconds, poll=0.05):
    """Keep watching a server that just became ready: dying within `seconds` fails the operation.

    A server that crashes a few seconds after its first good /generate (a scheduler that hits a bad
    kernel on its second batch, say) must not be reported as deployed.
    """
    seconds = float(seconds or 0)
    rec = servers.read_pidfile(ctx) or {}
    if seconds <= 0 or not rec.get("pid"):
        return {"soak_s": 0.0}
    pid, start = int(rec["pid"]), rec.get("pid_start")
    log_path, since = rec.get("log") or ctx.path(servers.LOG), int(rec.get("log_offset") or 0)
    host = servers.probe_host(rec.get("argv"))
    with oplog.step("soak", "watching pid %d for %gs after it became ready" % (pid, seconds)):
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            status = procfs.reap(pid)
            if status is not None or not procfs.same(pid, start):
                after = time.monotonic() - t0
                code = "" if status is None else " with code %d" % status
                store.journal(ctx, "soak.crash", pid=pid, after_s=round(after, 3), exit_code=status)
                raise AgentError("the server (pid %d) exited%s %.1fs after it became ready (soak of %gs)"
                                 % (pid, code, after, seconds), "failed", reason="crash",
                                 log_tail=startup.log_tail(log_path, 40, since=since))
            time.sleep(poll)
        # alive is not enough: it must still answer (a few tries, so one slow answer under load is no failure)
        health = None
        for _ in range(4):
            health = servers.health(host, ctx.port)
            if health == 200 or not procfs.same(pid, start):
                break
            time.sleep(0.5)
        if health != 200:
            store.journal(ctx, "soak.unhealthy", pid=pid, health=health)
            raise AgentError("the server (pid %d) %s at the end of the %gs soak"
                             % (pid, "exited" if not procfs.same(pid, start) else
                                "stopped answering /health (last answer: %s)" % health, seconds),
                             "failed", reason="soak", log_tail=startup.log_tail(log_path, 40, since=since))
    store.journal(ctx, "soak.ok", pid=pid, seconds=seconds)
    return {"soak_s": seconds}


def op_deploy(ctx, oplog, files, sglang_version, strategy, threshold, launch_argv, baseline_argv,
              artifacts=None, grace=60, ready_timeout=900, soak=DEFAULT_SOAK_S, effective_threshold=None, **_):
    loc = servers.locate(ctx)
    servers.preflight(ctx, loc, "deploy")
    releases.require_records(ctx)
    _recover(ctx, oplog)
    previous, previous_argv = _previous_argv(ctx, baseline_argv)
    running = loc["server"]
    with oplog.step("switch", "validate with %s, back up, swap %d file(s)" % (ctx.python, len(files))):
        applied = patch.apply_release(ctx, files, sglang_version, strategy=strategy, threshold=threshold,
                                      launch_argv=launch_argv, artifacts=artifacts,
                                      effective_threshold=effective_threshold)
    release = applied["release"]
    argv = applied["manifest"]["launch_argv"]
    oplog.emit("info", text="release %s in force (files changed: %d)" % (release, len(files)))
    try:
        with oplog.step("stop", "SIGTERM, drain up to %ss, then SIGKILL" % grace):
            stopped = shutdown.stop_server(ctx, grace=grace)
            oplog.emit("info", text=shutdown.summary(stopped))
        ready = _gate(ctx, oplog, argv, release, ready_timeout)
        verified = _verify(ctx, oplog, strategy, threshold, effective_threshold)
        verified.update(_soak(ctx, oplog, soak))
    except AgentError as err:
        oplog.warn("deploy failed: %s" % err)
        target = previous or releases.BASELINE
        rolled = _roll_back_after_failure(ctx, oplog, release, previous_argv, running is not None,
                                             grace, ready_timeout, soak)
        raise AgentError("deploy of release %s failed: %s; %s" % (release, err, rolled), "failed",
                         rolled_back_to=target, failed_release=release,
                         log_tail=err.extra.get("log_tail") or [])
    _set_state(ctx, last="deploy", release=release)
    result = {"release": release, "argv": argv, "previous": previous or releases.BASELINE, "pid": ready.get("pid"),
              "ready_seconds": ready.get("elapsed")}
    result.update(verified)
    return result


def _roll_back_after_failure(ctx, oplog, release, previous_argv, was_running, grace, ready_timeout, soak=0):
    with oplog.step("rollback", "restoring the previous release"):
        stopped = shutdown.stop_server(ctx, grace=min(grace, 30))
        oplog.emit("info", text=shutdown.summary(stopped))
        patch.revert_release(ctx, release)
    if not was_running:
        return "rolled back to the previous release (the server was not running before; left stopped)"
    try:
        _gate(ctx, oplog, previous_argv, releases.current(ctx), ready_timeout)
        _soak(ctx, oplog, min(float(soak or 0), DEFAULT_SOAK_S))  # it served before: a short look will do
    except AgentError as err:
        return "rolled back the files, but the previous server did not come back: %s" % err
    return "rolled back to %s, which is serving again" % (releases.current(ctx) or releases.BASELINE)


def op_rollback(ctx, oplog, baseline_argv, to=None, grace=60, ready_timeout=900, soak=DEFAULT_SOAK_S, **_):
    releases.require_records(ctx)
    chosen = _rollback_target(ctx, to, releases.manifests(ctx))
    loc = servers.locate(ctx)
    servers.preflight(ctx, loc, "rollback")
    recovered = _recover(ctx, oplog)
    applied = [m for m in releases.manifests(ctx) if m.get("state") == "applied"]  # newest first
    current = applied[0]["id"] if applied else None
    state = _state(ctx)
    if chosen is not None:
        target = chosen
    elif recovered:  # the interrupted release was the change to undo: back to what ran before it
        target = current or releases.BASELINE
    elif state.get("last") == "rollback" and state.get("target") == (current or releases.BASELINE):
        target = current or releases.BASELINE  # rolling back twice stays on the first rollback's target
        oplog.emit("info", text="already rolled back to %s; making sure it serves" % target)
    else:
        target = applied[1]["id"] if len(applied) > 1 else releases.BASELINE
    newer = [m for m in applied if target == releases.BASELINE or m["seq"] > int(target.split("-")[0])]
    manifest = next((m for m in applied if m["id"] == target), None)
    argv = (manifest or {}).get("launch_argv") or baseline_argv
    healthy = loc["server"] is not None and servers.health("127.0.0.1", ctx.port) == 200
    if not newer and healthy and servers.argv_matches(loc["server"]["argv"], argv):
        _set_state(ctx, last="rollback", target=target)
        if recovered:  # the files did change: the interrupted release is undone; the server kept serving
            return {"target": target, "changed": True, "reverted": recovered, "argv": argv,
                    "pid": loc["server"].get("pid"), "soak_s": 0.0}
        return {"target": target, "changed": False, "message": "already on %s and serving" % target}
    done = []
    try:
        with oplog.step("stop", "SIGTERM, drain up to %ss, then SIGKILL" % grace):
            stopped = shutdown.stop_server(ctx, grace=grace)
            oplog.emit("info", text=shutdown.summary(stopped))
            if stopped.get("stopped"):
                done.append("stopped the server")
        for m in newer:
            with oplog.step("revert", "release %s" % m["id"]):
                patch.revert_release(ctx, m["id"])
            done.append("reverted %s" % m["id"])
        ready = _gate(ctx, oplog, argv, None if target == releases.BASELINE else target, ready_timeout)
        soaked = _soak(ctx, oplog, soak)
    except AgentError as err:
        if not ctx.changed:
            raise
        # the host did change: say how far the rollback got, and never call it a pre-flight refusal
        raise AgentError("rollback to %s failed: %s%s" % (target, err, " (done before that: %s)" % ", ".join(done)
                                                           if done else ""),
                         "failed", target=target, log_tail=err.extra.get("log_tail") or [],
                         reason=err.extra.get("reason"))
    _set_state(ctx, last="rollback", target=target)
    return {"target": target, "changed": True, "reverted": recovered + [m["id"] for m in newer], "argv": argv,
            "pid": ready.get("pid"), "soak_s": soaked.get("soak_s")}


def deploy_context(ctx, files=(), **_):
    """Everything a deploy plan needs in one round trip: lock holder, patch files, server info (of our
    server only), and what is in the way that is not ours (the deploy itself will refuse it)."""
    loc = servers.locate(ctx)
    not_ours = servers.not_ours(ctx, loc)
    return {"holder": lock.live_holder(ctx), "patch": patch.patch_read(ctx, files=files),
            "info": serverinfo.server_info(ctx) if loc["server"] is not None else None,
            "not_ours": not_ours and not_ours["text"]}
