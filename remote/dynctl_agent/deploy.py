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

import contextlib
import os
import sys
import time
import traceback

from dynctl.base import sglang
from dynctl_agent import (
    launchconfig, lock, patch, prepared, procfs, releases, serverinfo, servers, shutdown, startup, store,
)
from dynctl_agent.protocol import AgentError, seconds

STATE_FILE = serverinfo.STATE_FILE
DEFAULT_SOAK_S = 5.0
# How long the read-back of a new server's threshold waits for /server_info; a server that does not answer
# in that time is rolled back (its threshold cannot be shown as in force).
VERIFY_WAIT_S = 5.0


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


def _gate(ctx, oplog, argv, release, ready_timeout, launch=None):
    """Start argv and wait until it serves; raise AgentError with the log tail when it does not.

    launch: the environment and cwd of an adopted server's launch (releases.baseline_launch)."""
    with oplog.step("start", " ".join(argv)):
        started = startup.start_server(ctx, argv, release=release, launch=launch)
        oplog.emit("info", text="server pid %s" % started.get("pid"))
    with oplog.step("ready", "waiting for /health_generate and one /generate"):
        return startup.await_ready(ctx, oplog, ready_timeout)


def _verify(ctx, oplog, strategy, threshold, effective=None):
    """The threshold the new server enforces, as it reports it; `effective` is what the plan expects a native
    server to enforce (the requested threshold after sglang's CUDA-graph padding)."""
    with oplog.step("verify", "reading the threshold back from /server_info"):
        info = serverinfo.server_info(ctx, VERIFY_WAIT_S)
        if info is None:
            raise AgentError("/server_info did not answer within %.0f s after the server became ready" % VERIFY_WAIT_S,
                             "failed")
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


def _take_over(ctx, oplog, taking):
    """Adopt the operator's server the operator asked to take over: its launch becomes the baseline release."""
    launch = servers.adoption(ctx, taking)
    releases.record_adopted(ctx, launch)
    oplog.emit("info", text="taking over pid %d, not started by dynctl, at the operator's word: its argv, "
                            "environment (%d variables) and cwd %s are the baseline release now"
                            % (taking["pid"], len(launch["env"]), launch["cwd"]))
    return launch


def _stop(ctx, grace, taking):
    """Stop our server, or the operator's server being taken over (pinned to its pid and start time)."""
    if taking is None:
        return shutdown.stop_server(ctx, grace=grace)
    return shutdown.stop_server(ctx, grace=grace, pid=taking["pid"], pid_start=taking["start"])


def op_deploy(ctx, oplog, files, sglang_version, strategy, threshold, launch_argv, baseline_argv,
              artifacts=None, grace=60, ready_timeout=900, soak=DEFAULT_SOAK_S, effective_threshold=None, adopt=None,
              staged=None, go_within=None):
    """go_within: prepare (every check and the validation, nothing changed), then wait up to that many seconds
    for the client's go (prepared.py) before the switch; without a go the deploy ends not started."""
    grace, ready_timeout, soak = seconds("grace", grace), seconds("ready_timeout", ready_timeout), seconds("soak", soak)
    loc = servers.locate(ctx)
    taking = servers.preflight(ctx, loc, "deploy", adopt)
    releases.require_records(ctx)
    package_dir = import_checked = None
    if go_within is not None:
        go_within = seconds("go_within", go_within)
        with oplog.step("prepare", "validate %d file(s) with %s and check that sglang starts with them; nothing "
                        "changes before the go" % (len(files), ctx.python)):
            ready_made = patch.prepare_release(ctx, files, sglang_version, artifacts, strategy)
        package_dir, staged = ready_made["package_dir"], ready_made["staged"] or staged
        import_checked = ready_made["import_check"]
        prepared.await_go(ctx, oplog, go_within, "deploy of threshold %s" % threshold)
        seen = loc["server"] or taking
        if seen is not None and not procfs.same(seen["pid"], seen["start"]):  # it ended while we waited
            loc = servers.locate(ctx)
            taking = servers.preflight(ctx, loc, "deploy", adopt)
    _recover(ctx, oplog)
    previous, previous_argv = _previous_argv(ctx, baseline_argv)
    previous_launch = None
    if previous is None:
        previous_argv, previous_launch = releases.baseline_launch(ctx, baseline_argv)
    running = loc["server"] or taking
    with oplog.step("switch", "validate with %s, back up, swap %d file(s)" % (ctx.python, len(files))):
        applied = patch.apply_release(ctx, files, sglang_version, strategy=strategy, threshold=threshold,
                                      launch_argv=launch_argv, artifacts=artifacts,
                                      effective_threshold=effective_threshold, staged=staged,
                                      package_dir=package_dir, import_checked=import_checked)
    release = applied["release"]
    try:
        argv = applied["manifest"]["launch_argv"]
        oplog.emit("info", text="release %s in force (files changed: %d)" % (release, len(files)))
        if taking is not None:  # what ran before is the operator's launch: a failed deploy restarts exactly that
            adopted = _take_over(ctx, oplog, taking)
            previous_argv = adopted["argv"]
            previous_launch = releases.adopted_launch(adopted)
        with oplog.step("stop", "SIGTERM, drain up to %ss, then SIGKILL" % grace):
            stopped = _stop(ctx, grace, taking)
            oplog.emit("info", text=shutdown.summary(stopped))
        ready = _gate(ctx, oplog, argv, release, ready_timeout)
        verified = _verify(ctx, oplog, strategy, threshold, effective_threshold)
        verified.update(_soak(ctx, oplog, soak))
    except Exception as err:  # not only a refusal: whatever failed after the switch, the switch is undone
        reason = failure_text(err)
        oplog.warn("deploy failed: %s" % reason)
        target = previous or releases.BASELINE
        rolled = _roll_back_after_failure(ctx, oplog, release, previous_argv, running, grace, ready_timeout, soak,
                                          previous_launch)
        extra = err.extra if isinstance(err, AgentError) else {}
        raise AgentError("deploy of release %s failed: %s; %s" % (release, reason, rolled), "failed",
                         rolled_back_to=target, failed_release=release,
                         log_tail=extra.get("log_tail") or [])
    with contextlib.suppress(OSError):  # the record of the last operation, not the transaction
        _set_state(ctx, last="deploy", release=release)
    result = {"release": release, "argv": argv, "previous": previous or releases.BASELINE, "pid": ready.get("pid"),
              "ready_seconds": ready.get("elapsed")}
    result.update(verified)
    return result


def failure_text(err):
    """What failed, in words: a refusal's own message; anything else by its type, its traceback to the worker's
    log (best effort: on a full disk the log cannot take it, and the rollback must go on regardless)."""
    if isinstance(err, AgentError):
        return str(err)
    with contextlib.suppress(Exception):
        traceback.print_exception(type(err), err, err.__traceback__)
        sys.stderr.flush()
    where = " (%s)" % err.filename if isinstance(err, OSError) and err.filename else ""
    return "%s: %s%s" % (type(err).__name__, getattr(err, "strerror", None) or err, where)


def _still_runs(old):
    """The process that served before the deploy (ours, or the operator's being taken over) is still that process."""
    return old is not None and old.get("pid") is not None and procfs.start_time(old["pid"]) == old.get("start")


def _roll_back_after_failure(ctx, oplog, release, previous_argv, old, grace, ready_timeout, soak=0, launch=None):
    """Undo a deploy that failed after its switch: stop whatever runs unless it is the old server still serving,
    revert the release, start the previous launch argv if the old server had been stopped. Each step is tried
    whatever the one before it did (a full disk, a crash), and the words returned say what was done and what
    was not. `launch` is the previous launch's env and cwd where it was the operator's adopted one."""
    problems = []
    still_serving = False
    oplog.release_room()  # the room reserved for this: a full disk must not keep the release applied
    with oplog.step("rollback", "restoring the previous release"):
        try:
            still_serving = (_still_runs(old) and
                             servers.health(servers.probe_host(old.get("argv")), ctx.port) == 200)
            if not still_serving:
                stopped = shutdown.stop_server(ctx, grace=min(grace, 30))
                oplog.emit("info", text=shutdown.summary(stopped))
        except Exception as err:
            problems.append("stopping the server failed: %s" % failure_text(err))
        try:
            patch.revert_release(ctx, release)
        except AgentError as err:
            if not err.extra.get("files_restored"):
                problems.append("reverting release %s FAILED: %s (its backups are in %s)"
                                % (release, err, ctx.path("releases", release)))
            else:
                problems.append(str(err))
        except Exception as err:
            problems.append("reverting release %s FAILED: %s (its backups are in %s)"
                            % (release, failure_text(err), ctx.path("releases", release)))
    in_force = releases.current(ctx)
    current = in_force or releases.BASELINE
    if any(p.startswith("reverting") for p in problems):
        return "; ".join(problems)
    files = ("rolled back the files to %s" % current if in_force != release else
             "restored the files of release %s" % release)
    if problems:
        files += " (%s)" % "; ".join(problems)
    if still_serving:
        return "%s; the previous server (pid %s) was never stopped and still serves" % (files, old["pid"])
    if old is None:
        if problems:
            return files + "; the server was not running before"
        return "rolled back to the previous release (the server was not running before; left stopped)"
    try:
        _gate(ctx, oplog, previous_argv, None if in_force == release else in_force, ready_timeout, launch)
        _soak(ctx, oplog, min(float(soak or 0), DEFAULT_SOAK_S))  # it served before: a short look will do
    except Exception as err:
        return "%s, but the previous server did not come back: %s" % (
            files if problems else "rolled back the files", failure_text(err))
    if problems:
        return "%s; the previous server is serving again" % files
    return "rolled back to %s, which is serving again" % current


def op_rollback(ctx, oplog, baseline_argv, to=None, grace=60, ready_timeout=900, soak=DEFAULT_SOAK_S, adopt=None):
    grace, ready_timeout, soak = seconds("grace", grace), seconds("ready_timeout", ready_timeout), seconds("soak", soak)
    releases.require_records(ctx)
    chosen = _rollback_target(ctx, to, releases.manifests(ctx))
    loc = servers.locate(ctx)
    taking = servers.preflight(ctx, loc, "rollback", adopt)
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
    argv, launch = (manifest or {}).get("launch_argv"), None
    if not argv:
        argv, launch = releases.baseline_launch(ctx, baseline_argv)
    healthy = loc["server"] is not None and servers.health("127.0.0.1", ctx.port) == 200
    if not newer and healthy and servers.argv_matches(loc["server"]["argv"], argv):
        with contextlib.suppress(OSError):
            _set_state(ctx, last="rollback", target=target)
        if recovered:  # the files did change: the interrupted release is undone; the server kept serving
            return {"target": target, "changed": True, "reverted": recovered, "argv": argv,
                    "pid": loc["server"].get("pid"), "soak_s": 0.0}
        return {"target": target, "changed": False, "message": "already on %s and serving" % target}
    done = []
    try:
        if taking is not None:
            adopted = _take_over(ctx, oplog, taking)
            done.append("adopted pid %d as the baseline" % taking["pid"])
            if not (manifest or {}).get("launch_argv"):
                argv = adopted["argv"]
                launch = releases.adopted_launch(adopted)
        with oplog.step("stop", "SIGTERM, drain up to %ss, then SIGKILL" % grace):
            stopped = _stop(ctx, grace, taking)
            oplog.emit("info", text=shutdown.summary(stopped))
            if stopped.get("stopped"):
                done.append("stopped the server")
        oplog.release_room()  # the room kept for undoing a change: the reverts' records and the start use it
        for m in newer:
            with oplog.step("revert", "release %s" % m["id"]):
                patch.revert_release(ctx, m["id"])
            done.append("reverted %s" % m["id"])
        ready = _gate(ctx, oplog, argv, None if target == releases.BASELINE else target, ready_timeout, launch)
        soaked = _soak(ctx, oplog, soak)
    except Exception as err:
        if not ctx.changed and isinstance(err, AgentError):
            raise
        # the host did change: say how far the rollback got, and never call it a pre-flight refusal
        extra = err.extra if isinstance(err, AgentError) else {}
        raise AgentError("rollback to %s failed: %s%s" % (target, failure_text(err),
                                                           " (done before that: %s)" % ", ".join(done) if done else ""),
                         "failed", target=target, log_tail=extra.get("log_tail") or [],
                         reason=extra.get("reason"))
    with contextlib.suppress(OSError):  # the record of the last operation, not the transaction
        _set_state(ctx, last="rollback", target=target)
    return {"target": target, "changed": True, "reverted": recovered + [m["id"] for m in newer], "argv": argv,
            "pid": ready.get("pid"), "soak_s": soaked.get("soak_s")}


def deploy_context(ctx, files=()):
    """Everything a deploy plan needs in one round trip: lock holder, patch files, server info (of our
    server only), and what is in the way that is not ours (the deploy itself will refuse it)."""
    loc = servers.locate(ctx)
    not_ours = servers.not_ours(ctx, loc)
    operator = None
    if not_ours is not None and not_ours["kind"] == "operator":
        operator = {k: not_ours[k] for k in ("pid", "start", "cmdline", "uid", "owner", "adoptable", "hint")}
    adopted = releases.adopted(ctx)
    return {"holder": lock.live_holder(ctx), "patch": patch.patch_read(ctx, files=files),
            "info": serverinfo.server_info(ctx) if loc["server"] is not None else None,
            "not_ours": not_ours and not_ours["text"], "operator": operator,
            "adopted": releases.adopted_summary(ctx),
            "config_files": _config_files(ctx, loc.get("operator"), adopted)}


def _config_files(ctx, operator, adopted):
    """Each launch a deploy may build on whose argv names a `--config` YAML, with that file merged in as sglang
    merges it ({"configured" | "operator" | "adopted": {"argv": [...]} or {"error": why}}), so the plan reads
    the speculation settings the server will really run with."""
    candidates = [("configured", ctx.args, os.path.expanduser("~"))]
    if operator is not None:
        candidates.append(("operator", operator["argv"], _cwd(operator["pid"])))
    if adopted is not None:
        candidates.append(("adopted", adopted["argv"], adopted.get("cwd")))
    out = {}
    for name, argv, cwd in candidates:
        if sglang.CONFIG_FLAG not in (argv or []):
            continue
        try:
            out[name] = {"argv": sglang.merge_config_args(argv, cwd=cwd)}
        except (OSError, ValueError) as err:
            out[name] = {"error": "%s: %s" % (launchconfig.flag_value(argv, sglang.CONFIG_FLAG),
                                              getattr(err, "strerror", None) or err)}
    return out


def _cwd(pid):
    try:
        return procfs.cwd(pid)
    except OSError:
        return None
