"""Host-changing operations (deploy, rollback, restart): started once, run by a detached worker, followed.

See oprecords for what an operation leaves in workdir/ops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from dynctl_agent import lock, oprecords, procfs, releases, servers, store, verbs
from dynctl_agent.protocol import LIMITS, AgentError, Context, outcome, seconds

# The worker (worker.py) runs this package from where this agent runs it, with the interpreter that runs it.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# op_follow reads the event log every FOLLOW_FAST_S for FOLLOW_FAST_FOR_S after its last new line, then every
# FOLLOW_S: a client waiting on a step's end hears it within tens of ms, a long quiet wait costs little.
FOLLOW_FAST_S, FOLLOW_FAST_FOR_S, FOLLOW_S = 0.02, 1.0, 0.1
_WORKER = os.path.join(_ROOT, "dynctl_agent", "worker.py")


def op_start(ctx, kind, params=None, op_id=None):
    """Claim op_id, take the host lock, start the detached worker, hand the lock to it, return the op id.

    The same op_id twice starts one worker: the second call answers already=True.
    """
    if kind not in verbs.OPS:
        raise AgentError("unknown operation %r" % kind, "usage")
    for name, value in (params or {}).items():
        if name in LIMITS:
            seconds(name, value)  # an unbounded wait is refused before anything is claimed
    op_id = op_id or oprecords.new_id(kind)
    oprecords.check_id(op_id)
    ctx.ensure_workdir()
    path = oprecords.op_file(ctx, op_id, ".json")
    existing = store.read_json(path)
    if existing is not None:
        return oprecords.already(existing, kind, op_id)
    verbs.check_params(kind, verbs.load(verbs.OPS[kind]), params or {}, leading=2)  # before anything is claimed
    request = {"id": op_id, "kind": kind, "params": params or {}, "client": ctx.client, "received": store.now_iso(),
               "host": {"name": ctx.name, "workdir": ctx.workdir, "python": ctx.python, "port": ctx.port,
                        "env": ctx.env, "launch": ctx.launch, "args": ctx.args, "keep_history": ctx.keep}}
    oprecords.room_check(ctx, kind, request)
    with lock.signals_deferred():
        try:
            os.makedirs(ctx.path("ops"), mode=0o700, exist_ok=True)
            claimed = store.write_json_atomic(path, request, exclusive=True)
        except OSError as err:
            raise AgentError("cannot record the %s request in %s: %s; nothing was changed"
                             % (kind, ctx.path("ops"), err.strerror or err), "preflight")
        if not claimed:
            return oprecords.already(store.read_json(path) or {}, kind, op_id)
        try:
            with lock.host_lock(ctx, kind, op=op_id) as holder:
                dead = holder.pop("took_over", None)
                if dead:
                    request["warning"] = ("took over the host lock of a %s by %s (pid %s) since %s, whose process "
                                          "is gone" % (dead.get("operation"), dead.get("who"), dead.get("pid"),
                                                       dead.get("started")))
                    store.write_json_atomic(path, request)
                oprecords.prune(ctx, keep_id=op_id)
                worker = spawn_detached([sys.executable, "-S", _WORKER, _ROOT, path],
                                        oprecords.op_file(ctx, op_id, ".log"), ctx.workdir)
                holder.update({"pid": worker, "pid_start": procfs.wait_start_time(worker), "op": op_id})
                # From here the worker speaks for the operation; it adopts the lock itself if this write is lost.
                with contextlib.suppress(OSError):
                    store.write_json_atomic(ctx.path("lock"), holder)
        except AgentError as err:
            oprecords.final(ctx, op_id, ok=False, kind=err.kind, error=str(err))
            raise
        except OSError as err:
            message = "cannot start the %s worker: %s; nothing was changed" % (kind, err.strerror or err)
            oprecords.final(ctx, op_id, ok=False, kind="preflight", error=message)
            raise AgentError(message, "preflight")
    ctx.changed = True
    return {"op_id": op_id, "worker_pid": worker, "already": False}


def spawn_detached(argv, log_path, cwd):
    """Start argv as an orphan in its own session (double fork): no longer our child, nothing that ends
    this agent or its SSH session reaches it. Returns its pid."""
    r, w = os.pipe()
    first = os.fork()
    if first == 0:  # pragma: no cover - runs in the forked child
        try:
            os.close(r)
            os.setsid()
            second = os.fork()
            if second == 0:
                os.close(w)
                signal.pthread_sigmask(signal.SIG_SETMASK, [])  # a deferred signal is ours, not the worker's
                os.chdir(cwd)
                null = os.open(os.devnull, os.O_RDONLY)
                log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                os.dup2(null, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.closerange(3, 65536)
                os.execv(argv[0], argv)
            os.write(w, str(second).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        pid = int(f.read() or 0)
    os.waitpid(first, 0)
    if not pid:
        raise AgentError("could not start the operation worker", "failed")
    return pid


def op_run(ctx, kind, params=None, op_id=None, from_line=0):
    """op_start and op_follow in one round trip; sent again with the same op_id, it only follows."""
    started = op_start(ctx, kind, params, op_id)
    for item in op_follow(ctx, op_id=started["op_id"], from_line=from_line):
        yield item


def op_current(ctx):
    """The live holder of the host lock (operation, who, pid, since), or None."""
    return {"holder": lock.live_holder(ctx)}


def _resolve(ctx, op_id):
    """An operation id, "latest" (the newest this host received), or None (the one running now)."""
    if op_id is None:
        holder = lock.live_holder(ctx)
        if not holder or not holder.get("op"):
            raise AgentError("no operation is running on %s" % ctx.name, "usage")
        return holder["op"]
    if op_id == "latest":
        ids = oprecords.op_ids(ctx)
        if not ids:
            raise AgentError("no operation has run on %s yet (workdir %s)" % (ctx.name, ctx.workdir), "usage")
        return ids[0]
    oprecords.check_id(op_id)
    return op_id


def _aftermath(ctx):
    """What the host looks like now, in words: the release in force and the server."""
    current = releases.current(ctx) or releases.BASELINE
    try:
        found = servers.find(ctx)
        server = "server %s, pid %s" % (found.get("state"), found.get("pid")) if found.get("pid") else "server down"
    except Exception as err:  # a report, not a transaction: say what could not be looked at
        server = "server state unknown (%s)" % err
    return "release in force: %s; %s" % (current, server)


def op_follow(ctx, op_id=None, from_line=0):
    """Yield the events of an operation (id, "latest", or the running one when None) until its final event."""
    op_id = _resolve(ctx, op_id)
    path = oprecords.op_file(ctx, op_id, ".jsonl")
    request = store.read_json(oprecords.op_file(ctx, op_id, ".json"))
    if request is None:
        known = ", ".join(oprecords.op_ids(ctx)[:5]) or "none"
        raise AgentError("no operation %s on %s (newest: %s)" % (op_id, ctx.name, known), "usage")
    kind = request.get("kind") or "operation"
    seen = 0
    pos = 0
    gone_since = None
    spot = None
    heard = time.monotonic()
    while True:
        lines = []
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
                end = chunk.rfind(b"\n") + 1
                pos += end
                lines = chunk[:end].splitlines()
        except FileNotFoundError:
            pass
        for raw in lines:
            seen += 1
            if seen <= from_line:
                continue
            event = oprecords.parse_event(raw)
            if event is None:  # a torn line (a writer killed half way): one event lost, not the operation's end
                event = {"type": "warning", "text": "event %d of the %s could not be read (%d bytes: %r...); "
                                                    "skipped" % (seen, kind, len(raw), raw[:40])}
            event["op_id"] = op_id
            event["op_kind"] = kind
            event["seq"] = seen
            yield {"ok": True, "op": event}  # the op's own ok/error stay inside, not the stream's
            if event.get("final"):
                return
        if spot is not None and not lines:  # the log read to its end once more: the final word comes last
            spot.update(op_id=op_id, op_kind=kind, seq=seen + 1)
            yield {"ok": True, "op": spot}
            return
        if not lines and spot is None:
            spot = oprecords.read_final_spot(ctx, op_id)  # where the worker put it when its log was full
            if spot is not None:
                continue
        if lines:
            gone_since = None
            heard = time.monotonic()
        else:
            holder = lock.live_holder(ctx)
            if holder is not None and holder.get("op") == op_id:
                gone_since = None
            elif gone_since is None:
                gone_since = time.monotonic()
            elif time.monotonic() - gone_since > oprecords.GONE_S:
                if seen == 0:  # the worker writes its first event before it does anything
                    verdict = {"kind": "preflight", "error": "the %s never started on %s (no worker took it up); "
                                                             "nothing was changed" % (kind, ctx.name)}
                else:
                    verdict = {"kind": "failed", "error": "the %s worker on %s died without finishing (see %s); "
                                                          "%s" % (kind, ctx.name, oprecords.op_file(ctx, op_id, ".log"),
                                                                  _aftermath(ctx))}
                verdict.update({"type": "final", "final": True, "ok": False, "op_id": op_id, "op_kind": kind,
                                "seq": seen + 1})
                yield {"ok": True, "op": verdict}
                return
        # a step's next event (and the final one) often follows within moments: look again soon, then less often
        time.sleep(FOLLOW_FAST_S if time.monotonic() - heard < FOLLOW_FAST_FOR_S else FOLLOW_S)


def op_detach(ctx, op_id, kind=None):
    """The client stops following op_id (Ctrl-C): say what became of it. An id this host has not received yet
    is claimed as cancelled, so a request still on its way starts nothing."""
    oprecords.check_id(op_id)
    path = oprecords.op_file(ctx, op_id, ".json")
    if store.read_json(path) is None:
        ctx.ensure_workdir()
        os.makedirs(ctx.path("ops"), mode=0o700, exist_ok=True)
        tomb = {"id": op_id, "kind": kind, "cancelled": True, "client": ctx.client, "received": store.now_iso()}
        if store.write_json_atomic(path, tomb, exclusive=True):
            oprecords.final(ctx, op_id, ok=False, kind="cancelled",
                      error="cancelled by %s before it started; nothing was changed" % ctx.who)
            return {"state": "cancelled", "op_id": op_id}
    final = oprecords.last_final(ctx, op_id)
    if final is not None:
        return {"state": "finished", "op_id": op_id, "final": final}
    return {"state": "running", "op_id": op_id, "holder": lock.live_holder(ctx)}


def op_list(ctx, limit=20):
    """The newest operations on this host: id, kind, who, when, and how each ended (or that it runs)."""
    running = (lock.live_holder(ctx) or {}).get("op")
    out = []
    for op_id in oprecords.op_ids(ctx)[:int(limit)]:
        request = store.read_json(oprecords.op_file(ctx, op_id, ".json")) or {}
        final = oprecords.last_final(ctx, op_id)
        if final is not None:
            state = "done" if final.get("ok") else (final.get("kind") or "failed")
        else:
            state = "running" if op_id == running else "unfinished"
        out.append({"id": op_id, "kind": request.get("kind"), "who": (request.get("client") or {}).get("user"),
                    "client_host": (request.get("client") or {}).get("hostname"),
                    "received": request.get("received"), "state": state,
                    "error": (final or {}).get("error")})
    return {"ops": out}


def _adopt_lock(ctx, request):
    """Make the host lock name this worker: op_start hands it over, and this covers a handover write it lost."""
    path = ctx.path("lock")
    holder = store.read_json(path) or {}
    if holder.get("op") != request["id"]:
        raise AgentError("the host lock was not handed to this %s (it names %s); nothing was changed"
                         % (request["kind"], holder.get("operation") or "no operation"), "busy")
    me = procfs.start_time(os.getpid())
    if holder.get("pid") != os.getpid() or holder.get("pid_start") != me:
        holder.update(pid=os.getpid(), pid_start=me)
        try:
            store.write_json_atomic(path, holder)
        except OSError as err:
            raise AgentError("cannot write the host lock %s: %s; nothing was changed" % (path, err.strerror or err),
                             "preflight")


def run_operation(request_path):
    """Entry point of the detached worker (worker.py)."""
    request = store.read_json(request_path)
    ctx = Context(request["host"], request.get("client"))
    oplog = oprecords.OpLog(ctx, request["id"], request["kind"])
    oplog.make_room()
    try:
        oplog.emit("started", required=True, kind=request["kind"], pid=os.getpid())
    except OSError as err:  # nobody would hear of what follows: do nothing (a follower says so)
        with contextlib.suppress(OSError):
            sys.stderr.write("cannot write %s: %s; not starting\n" % (oplog.path, err))
        oplog.release_room()
        with contextlib.suppress(OSError):
            os.unlink(oplog.spot)
        return 1
    try:
        _adopt_lock(ctx, request)
        if request.get("warning"):
            oplog.warn(request["warning"])
        result = verbs.load(verbs.OPS[request["kind"]])(ctx, oplog, **(request.get("params") or {}))
        final = {"ok": True}
        final.update(result or {})
    except AgentError as err:
        kind, message = outcome(ctx, err)
        final = {"ok": False, "kind": kind, "error": message}
        final.update(err.extra)
    except Exception as err:  # the worker must always leave a final word, even where its log cannot take a traceback
        with contextlib.suppress(Exception):
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        changed = " (this host had been changed before that: see %s)" % ctx.path("journal.jsonl") if ctx.changed else ""
        final = {"ok": False, "kind": "failed", "error": "%s: %s%s" % (type(err).__name__, err, changed)}
    finally:
        holder = store.read_json(ctx.path("lock")) or {}
        if holder.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ctx.path("lock"))
    if oplog.lost:
        final["events_lost"] = oplog.lost
    oplog.finish(final=True, **final)
    return 0 if final.get("ok") else 1
