"""Stopping the server: SIGTERM to the main pid, SIGKILL after the grace, a sweep of its own tree only,
then the port and the GPU memory free. Nothing that is not provably ours is ever signalled."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from dynctl.base import sglang
from dynctl_agent import hostinfo, nvidia, procfs, servers, store
from dynctl_agent.protocol import AgentError

def send_signal(ctx, pid, start, sig, why):
    """Send sig to pid only while it is still the process we collected; True when sent."""
    if not procfs.same(pid, start):
        return False
    cmdline = procfs.cmdline(pid)[:8]  # read while the process is there: after a SIGKILL it may be gone
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError as err:
        raise AgentError("cannot signal pid %d (%s): %s"
                         % (pid, " ".join(sglang.redact_argv(procfs.cmdline(pid)))[:80], err.strerror))
    store.journal(ctx, "stop.signal", pid=pid, signal=signal.Signals(sig).name, why=why, cmdline=cmdline)
    return True


def _operator_pid(ctx, loc, pid, pid_start):
    """The process the operator named with `stop --pid`, as a server to stop; refuses anything else.

    Only our own server, or a launcher of an sglang server for this port that dynctl did not start
    (the operator's listening one, or an "unmanaged" one; a plain stop signals neither), may be named;
    the start time, when given, pins the very process the operator confirmed.
    """
    pid = int(pid)
    st = procfs.stat(pid)
    if st is None or st["state"] in ("Z", "X"):
        raise AgentError("pid %d is not running; nothing was signalled" % pid, "preflight")
    if pid_start is not None and st["start"] != int(pid_start):
        raise AgentError("pid %d is no longer the process that was confirmed (it was restarted or the pid was "
                         "reused); nothing was signalled" % pid, "preflight")
    server = loc["server"]
    if server is not None and server["pid"] == pid:
        return server
    if pid in loc["leftovers"]:
        return None  # a leftover of our previous server: the ordinary sweep takes it
    op = loc.get("operator")
    if op is not None and op["pid"] == pid:
        return dict(op)
    if pid not in loc["unmanaged"]:
        what = " ".join(sglang.redact_argv(procfs.cmdline(pid)))[:200]
        raise AgentError("pid %d (%s) is not an sglang server for port %d; dynctl stops only that server, so "
                         "nothing was signalled" % (pid, what, ctx.port), "preflight")
    return dict(pid=pid, start=st["start"], sid=st["sid"], source="operator", marker=None, argv=procfs.cmdline(pid))


def summary(result):
    """One line for the stop step of deploy, rollback and restart: what was stopped, or that nothing was."""
    if not result.get("stopped"):
        return result.get("message") or "no server was running"
    swept = result.get("swept") or []
    if result.get("pid") is None:
        return "no server was running; swept %d leftover process(es) of the previous server (pids %s)" % (
            len(swept), ", ".join(str(p["pid"]) for p in swept) or "none")
    if result.get("source") in ("operator", "adopted"):
        line = "stopped pid %s (not started by dynctl; taken over at the operator's word)" % result["pid"]
    else:
        line = "stopped pid %s (found by %s)" % (result["pid"], result.get("source"))
    if swept:
        line += "; swept %d leftover process(es) of its tree" % len(swept)
    return line


def stop_server(ctx, grace=60.0, port_timeout=30.0, gpu_timeout=60.0, pid=None, pid_start=None):
    """SIGTERM the main pid, SIGKILL after grace, sweep its tree, wait for the port and the GPU to be free.

    pid: the operator's explicit choice (`dynctl stop --pid N`), the only way a launcher that dynctl did
    not start, found by its command line alone, is ever signalled.
    """
    t0 = time.monotonic()
    loc = servers.locate(ctx)
    server, leftovers = loc["server"], dict(loc["leftovers"])
    if pid is not None:
        server = _operator_pid(ctx, loc, pid, pid_start)
        if server is not None and server["source"] == "operator":
            table = procfs.table()
            loc["tree"] = servers.tree_of(table, server["pid"], server["start"], server["sid"] == server["pid"], None)
            leftovers = {}
            loc["foreign"] = [p for p in loc["foreign"] if p not in loc["tree"]]
    if server is None and not leftovers:
        return _nothing_to_stop(ctx, loc)
    ctx.changed = True
    smi = hostinfo.nvidia_smi_path(ctx)
    gpu_before = nvidia.compute_pids(smi, hostinfo.server_env(ctx)) if smi else None
    tree = dict(loc["tree"])
    tree.update(leftovers)
    out = {"stopped": True, "pid": server["pid"] if server else None, "source": server["source"] if server else None,
           "escalated": False, "swept": [], "grace_s": grace, "timings": {}, "warnings": []}
    store.journal(ctx, "stop.begin", pid=out["pid"], source=out["source"], grace=grace, tree=sorted(tree),
                  leftovers=sorted(leftovers))
    t_exit = time.monotonic() if server is None else _terminate(ctx, server, grace, tree, out)
    _sweep(ctx, tree, out)
    t_swept = time.monotonic()
    _wait_port_free(ctx, tree, port_timeout, out)
    out["timings"]["exit_to_port_free_s"] = round(time.monotonic() - t_exit, 4)
    out["timings"]["sweep_s"] = round(t_swept - t_exit, 4)
    store.journal(ctx, "stop.port_free", port=ctx.port, after_exit_s=out["timings"]["exit_to_port_free_s"],
                  swept=[d["pid"] for d in out["swept"]])
    out["gpu"] = _wait_gpu_released(ctx, smi, gpu_before, tree, gpu_timeout, t_exit, out)
    rec = servers.read_pidfile(ctx)
    if rec and not rec.get("stopped") and (server is None or server["source"] != "operator"):
        rec["stopped"] = store.now_iso()
        try:
            servers.write_pidfile(ctx, rec)
        except OSError as err:
            out["warnings"].append("the server is stopped, but %s could not record it (%s)"
                                   % (ctx.path(servers.PIDFILE), err.strerror or err))
    out["timings"]["total_s"] = round(time.monotonic() - t0, 4)
    store.journal(ctx, "stop.done", **out["timings"])
    return out


def _nothing_to_stop(ctx, loc):
    """No server of ours and no leftover of one: record it as stopped and say what else holds the port."""
    rec = loc["record"]
    if rec and not rec.get("stopped"):
        rec["stopped"] = store.now_iso()
        with contextlib.suppress(OSError):  # a record: a full disk must not make a stop fail
            servers.write_pidfile(ctx, rec)
    not_ours = servers.not_ours(ctx, loc)
    msg = "server already stopped"
    if not_ours and not_ours["kind"] == "operator":
        msg = ("stop refused: no server started by dynctl runs, and %s; nothing was changed and nothing was "
               "killed -- %s" % (not_ours["text"], not_ours["hint"]))
    elif not_ours:
        msg += "; %s: left alone -- %s" % (not_ours["text"], not_ours["hint"])
    store.journal(ctx, "stop.noop", port=ctx.port, pidfile=loc["pidfile"],
                  not_ours=not_ours and {k: not_ours[k] for k in ("kind", "pid")})
    return {"stopped": False, "message": msg, "pidfile": loc["pidfile"],
            "port_owner": servers.describe(loc["foreign"][0]) if loc["foreign"] else None,
            "not_ours": not_ours}


def _terminate(ctx, server, grace, tree, out):
    """SIGTERM the main pid, SIGKILL once the grace is over; add the children it started while draining to
    `tree`. Returns when it exited (monotonic)."""
    pid, start = server["pid"], server["start"]
    with contextlib.suppress(OSError):  # "draining" in status; a full disk must not keep the server up
        servers.mark_pidfile(ctx, server, stopping=store.now_iso())
    t_term = time.monotonic()
    send_signal(ctx, pid, start, signal.SIGTERM, "stop: drain")
    gone = lambda: procfs.reap(pid) is not None or not procfs.same(pid, start)  # noqa: E731
    if not procfs.wait_until(gone, grace, 0.01):
        out["escalated"] = True
        send_signal(ctx, pid, start, signal.SIGKILL, "stop: grace %gs over" % grace)
        if not procfs.wait_until(gone, 10.0):
            raise AgentError("pid %d survived SIGKILL for 10 s (state %s); the host needs attention"
                             % (pid, (procfs.stat(pid) or {}).get("state")))
    t_exit = time.monotonic()
    out["timings"]["sigterm_to_exit_s"] = round(t_exit - t_term, 4)
    store.journal(ctx, "stop.exited", pid=pid, escalated=out["escalated"], after_s=out["timings"]["sigterm_to_exit_s"])
    # children that appeared while it drained belong to it too
    table = procfs.table()
    for p, st in table.items():
        if st["start"] >= start and st["state"] not in ("Z", "X") and p not in tree and (
                (server["sid"] == pid and st["sid"] == pid) or (server["marker"] and servers.has_marker(p, server["marker"]))):
            tree[p] = st["start"]
    return t_exit


def _sweep(ctx, tree, out):
    """SIGKILL what is left of the server's tree (each still the process collected), and wait until it is gone."""
    survivors = {p: s for p, s in tree.items() if procfs.same(p, s)}
    for p, s in sorted(survivors.items()):
        desc = servers.describe(p)
        if send_signal(ctx, p, s, signal.SIGKILL, "stop: sweep survivor of the server"):
            out["swept"].append(desc)
    if not procfs.wait_until(lambda: not any(procfs.same(p, s) for p, s in survivors.items()), 10.0, 0.005):
        left = [p for p, s in survivors.items() if procfs.same(p, s)]
        raise AgentError("processes of the old server survived SIGKILL: %s" % ", ".join(map(str, left)))


def _wait_port_free(ctx, tree, port_timeout, out):
    """Until the port is free, or held by a process that is not the server's (a warning then)."""
    foreign, scanned = [], [0.0]

    def port_settled():
        if not procfs.port_in_use(ctx.port) and procfs.port_bindable(ctx.port):  # cheap: no pid scan once free
            return True
        if time.monotonic() - scanned[0] < 0.1:  # who holds it: a scan of every process, so not too often
            return False
        scanned[0] = time.monotonic()
        held = procfs.listening_pids(ctx.port)
        foreign[:] = [p for p in held if p not in tree]
        return bool(foreign) or (not held and not procfs.port_in_use(ctx.port))

    if not procfs.wait_until(port_settled, port_timeout, 0.005):
        raise AgentError("port %d is still in use %gs after the server exited" % (ctx.port, port_timeout))
    if foreign:
        out["warnings"].append("port %d was taken by a process dynctl does not manage: pid %d (%s)"
                               % (ctx.port, foreign[0], " ".join(sglang.redact_argv(procfs.cmdline(foreign[0])))[:120]))


def _wait_gpu_released(ctx, smi, before, tree, timeout, t_exit, out):
    if not smi:
        return {"checked": False, "why": "nvidia-smi not found in the server's PATH"}
    if before is None:
        out["warnings"].append("nvidia-smi at %s did not answer; GPU release not verified" % smi)
        return {"checked": False, "why": "nvidia-smi failed", "nvidia_smi": smi}
    held_before = sorted(p for p in before if p in tree)
    if before and not held_before and not any(procfs.stat(p) for p in before):
        out["warnings"].append("nvidia-smi lists pids not visible here (%s): in a container it may show host "
                               "pids; GPU release not verified" % ", ".join(map(str, sorted(before))))
    still = held_before
    deadline = time.monotonic() + timeout
    while True:
        now = nvidia.compute_pids(smi, hostinfo.server_env(ctx))
        still = sorted(p for p in (now or {}) if p in tree) if now is not None else still
        if now is not None and not still:
            break
        if time.monotonic() >= deadline:
            raise AgentError("GPU memory is still held by pid(s) %s of the old server %gs after it exited"
                             % (", ".join(map(str, still)), timeout))
        time.sleep(0.05)  # one query takes ~20 ms on an H200
    elapsed = round(time.monotonic() - t_exit, 4)
    out["timings"]["exit_to_gpu_released_s"] = elapsed
    store.journal(ctx, "stop.gpu_released", held_before=held_before, after_exit_s=elapsed)
    return {"checked": True, "nvidia_smi": smi, "held_before": held_before, "released_after_exit_s": elapsed}
