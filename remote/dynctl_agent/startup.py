"""Starting the server detached, waiting until it serves (or crashed), and its log."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid

from dynctl.base import sglang
from dynctl_agent import hostinfo, httpclient, procfs, releases, servers, store
from dynctl_agent.protocol import AgentError

LOG_ROTATE = 256 << 20


def _rotate_log(path):
    store.rotate(path, LOG_ROTATE)


def start_server(ctx, argv, env=None, release=None, launch=None):
    """Start argv detached in its own session, log to workdir/server.log, write the pidfile; don't wait.

    launch: {"env", "cwd"} of an adopted server (releases.baseline_launch): its environment exactly (the
    host's and the configured one are not added) and its working directory.
    """
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise AgentError("start needs argv as a non-empty list of strings, got %r" % (argv,), "usage")
    env = env or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise AgentError("start needs env as a table of strings, got %r" % (env,), "usage")
    for where, text in [("argv[%d]" % i, a) for i, a in enumerate(argv)] + [
            ("env %s" % k, k + "=" + v) for k, v in sorted(env.items())]:
        if "\0" in text:
            raise AgentError("start: %s contains a NUL byte, which no command line or environment can carry"
                             % where, "usage")
    port = servers.argv_port(argv)
    if port is not None and port != str(ctx.port):
        raise AgentError("argv says --port %s but this host's port is %d" % (port, ctx.port), "usage")
    loc = servers.locate(ctx)
    server = loc["server"]
    if server is not None:
        if servers.argv_matches(server["argv"], argv):
            return {"already_running": True, "pid": server["pid"], "argv": server["argv"], "source": server["source"]}
        raise AgentError("a server is already running on port %d (pid %d, found by %s: %s); stop it first"
                         % (ctx.port, server["pid"], server["source"],
                            " ".join(sglang.redact_argv(server["argv"]))[:200]), "preflight")
    servers.preflight(ctx, loc, "start")
    if loc["leftovers"]:
        raise AgentError("processes of the previous server are still alive (pids %s); run `dynctl stop` first"
                         % ", ".join(map(str, sorted(loc["leftovers"]))), "preflight")
    ctx.ensure_workdir()
    if launch is None:  # a release built on the adopted launch starts in its environment and cwd
        launch = releases.adopted_launch_for(ctx, argv)
    log_path = ctx.path(servers.LOG)
    _rotate_log(log_path)
    marker = uuid.uuid4().hex
    full_env = dict(launch["env"]) if launch else hostinfo.server_env(ctx)
    full_env.update({k: os.path.expandvars(v) for k, v in env.items()})
    full_env[servers.MARKER_ENV] = marker
    # sglang titles its processes with setproctitle, which on Linux writes the title over the environment
    # block: /proc/PID/environ then loses the marker, and an orphan that left the session is not found as
    # the server's. SPT_NOENV keeps the title within argv's space (sglang's titles are short).
    full_env.setdefault("SPT_NOENV", "1")
    home = os.path.expanduser("~")
    cwd = home if os.path.isdir(home) else ctx.workdir  # relative paths in args resolve as in a login shell
    if launch and launch.get("cwd") and os.path.isdir(launch["cwd"]):
        cwd = launch["cwd"]
    previous = servers.read_pidfile(ctx)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as log:
        log.write(("==== dynctl start %s by %s release=%s argv=%s\n"
                   % (store.now_iso(), ctx.who, release, json.dumps(sglang.redact_argv(argv)))).encode())
        log.flush()
        record = {"argv": argv, "port": ctx.port, "started": store.now_iso(), "release": release, "marker": marker,
                  "log": log_path, "log_offset": log.tell(), "env": env, "who": ctx.who}
        if launch:
            record["adopted_launch"] = launch.get("adopted")
        # Recorded before the spawn: an agent killed between the spawn and the full record leaves a server
        # that its marker still finds as ours, never one that looks like a stranger's.
        try:
            servers.write_pidfile(ctx, servers.spawn_record(record))
        except OSError as err:
            raise AgentError("cannot record the new server in %s: %s; nothing was started"
                             % (ctx.path(servers.PIDFILE), err.strerror or err), "preflight")
        try:
            # own session: not tied to the SSH channel, killable as a whole; stdin closed so
            # nothing waits on us, stdout/stderr to the log so sshd sees EOF at once
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=full_env, cwd=cwd, start_new_session=True,
                                    close_fds=True)
        except OSError as err:
            _restore_pidfile(ctx, previous)
            store.journal(ctx, "start.failed", argv=argv, error=str(err))
            raise AgentError("cannot start %s on %s: %s" % (argv[0], ctx.name, err.strerror or err), "preflight")
    st = procfs.stat(proc.pid) or {}
    record.update(pid=proc.pid, pid_start=st.get("start"), pgid=st.get("pgid"), sid=st.get("sid"))
    try:
        servers.write_pidfile(ctx, record)
    except OSError as err:  # the spawning record would find it again, but a start that cannot write its record
        with contextlib.suppress(OSError):  # has no room for what follows: end it while it is provably ours
            os.killpg(proc.pid, signal.SIGKILL)  # its own session and group: it and whatever it forked so far
        proc.wait()
        _restore_pidfile(ctx, previous)
        raise AgentError("cannot record the new server in %s: %s; it was stopped again at once (pid %d), so nothing "
                         "was started" % (ctx.path(servers.PIDFILE), err.strerror or err, proc.pid), "preflight")
    ctx.changed = True
    store.journal(ctx, "start.spawned", pid=proc.pid, argv=argv, release=release, env_keys=sorted(env))
    return dict(record, already_running=False)


def _restore_pidfile(ctx, previous):
    """Put back the pidfile a start found (or none) when its spawn did not happen after all."""
    with contextlib.suppress(OSError):
        if previous is None:
            os.unlink(ctx.path(servers.PIDFILE))
        else:
            servers.write_pidfile(ctx, previous)


# -- readiness


def log_tail(path, lines, since=0):
    """Last `lines` lines of the log from byte offset `since`."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            start = max(since, size - max(lines, 1) * 4096)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    text = data.decode("utf-8", "replace").splitlines()
    if start > since and text:
        text = text[1:]  # the first line was cut in the middle
    return text[-lines:] if lines else []


def _check_ready(host, port, generate, token_ids=False, keys=None):
    """One readiness probe: /health_generate 200, then a real /generate that returns tokens.

    A server without a tokenizer (--skip-tokenizer-init) takes token ids, not text.
    """
    try:
        status, _ = httpclient.request(host, port, "GET", "/health_generate", timeout=25.0)
        if status != 200:
            return {"ready": False, "detail": "/health_generate answered %d" % status}
        if not generate:
            return {"ready": True}
        prompt = {"input_ids": [1, 2, 3, 4]} if token_ids else {"text": "Hello"}
        body = dict(prompt, sampling_params={"max_new_tokens": 4, "temperature": 0})
        status, raw = httpclient.request(host, port, "POST", "/generate", body=body, timeout=120.0, keys=keys)
    except httpclient.FAILURES as err:
        return {"ready": False, "detail": "%s" % (getattr(err, "strerror", None) or err.__class__.__name__)}
    if status != 200:
        hint = " (the server wants an API key)" if status in (401, 403) else ""
        return {"ready": False, "detail": "/generate answered %d%s" % (status, hint)}
    try:
        answer = json.loads(raw)
        answer = answer[0] if isinstance(answer, list) else answer
        meta = answer.get("meta_info") or {}
        tokens = int(meta.get("completion_tokens") or len(answer.get("output_ids") or []))
        text = answer.get("text") or ""
    except (ValueError, AttributeError, TypeError):
        return {"ready": False, "detail": "/generate answered non-JSON"}
    if tokens <= 0 and not text:
        return {"ready": False, "detail": "/generate returned no tokens"}
    return {"ready": True, "generate": {"tokens": tokens, "text": text[:80]}}


class _Probe(threading.Thread):
    """Readiness probe off the main loop, so a slow /health_generate never delays crash detection."""

    def __init__(self, host, port, generate, token_ids, keys=None):
        super().__init__(daemon=True)
        self.args_ = (host, port, generate, token_ids, keys)
        self.result = None

    def run(self):
        self.result = _check_ready(*self.args_)


# How long a process that logged a Traceback during start has to exit for it to count as a crash.
TRACEBACK_EXIT_S = 2.0


def wait_ready(ctx, ready_timeout=900.0, generate=True, poll=0.05):
    """Yield progress until the server answers ({"type": "log" | "warning" | "waiting", ...}); the last item is
    {"type": "ready", ...} or {"type": "failed", ...}."""
    rec = servers.read_pidfile(ctx)
    if rec and rec.get("spawning"):  # its start was cut short: the marker finds what it spawned
        rec = servers.locate(ctx)["record"]
    if not rec or not rec.get("pid") or rec.get("stopped"):
        why = "the last server was stopped at %s" % rec["stopped"] if rec and rec.get("stopped") else (
            "the start recorded at %s spawned nothing that runs" % rec["spawning"] if rec and rec.get("spawning")
            else "no pidfile")
        yield {"type": "failed", "reason": "not started", "message": "no server is starting in %s (%s)"
               % (ctx.workdir, why), "log_tail": []}
        return
    pid, start, log_path = int(rec["pid"]), rec.get("pid_start"), rec.get("log") or ctx.path(servers.LOG)
    host = servers.probe_host(rec.get("argv"))
    token_ids = "--skip-tokenizer-init" in (rec.get("argv") or [])
    keys = sglang.api_keys(rec.get("argv"))
    offset, partial, probe, last_yield = int(rec.get("log_offset") or 0), b"", None, time.monotonic()
    if rec.get("ready_at"):  # it was ready once: tracebacks logged while serving are not a failed start
        with contextlib.suppress(OSError):
            offset = os.path.getsize(log_path)
    t0 = time.monotonic()
    last_detail, next_probe = "not probed yet", t0
    store.journal(ctx, "ready.wait", pid=pid, timeout=ready_timeout)

    def failed(reason, message, **extra):
        tail = log_tail(log_path, 40, since=int(rec.get("log_offset") or 0))
        store.journal(ctx, "ready.failed", pid=pid, reason=reason, message=message)
        item = {"type": "failed", "reason": reason, "message": message, "log_tail": tail, "pid": pid,
                "elapsed": round(time.monotonic() - t0, 3), "alive": procfs.same(pid, start)}
        item.update(extra)
        return item

    while True:
        offset, partial, lines = _new_lines(log_path, offset, partial)
        if lines:
            last_yield = time.monotonic()
            yield {"type": "log", "lines": lines}
        # sglang logs it behind a prefix: "[... TP0] Scheduler hit an exception: Traceback (most ..."
        traceback = any("Traceback (most recent call last)" in ln for ln in lines)
        ended = _start_ended(pid, start, traceback)
        if ended is not None:
            yield failed(ended[0], ended[1], exit_code=ended[2])
            return
        if traceback:
            yield {"type": "warning", "text": "the server log shows a Traceback during start, but the server "
                                               "(pid %d) is still running; waiting for it to be ready" % pid}
        if probe is not None and not probe.is_alive():
            result, probe = probe.result or {}, None
            if result.get("ready"):
                elapsed = round(time.monotonic() - t0, 3)
                store.journal(ctx, "ready.ok", pid=pid, elapsed=elapsed)
                with contextlib.suppress(OSError):  # a record; the server serves whether or not it lands
                    servers.mark_pidfile(ctx, {"pid": pid}, ready_at=store.now_iso())
                yield {"type": "ready", "pid": pid, "elapsed": elapsed, "generate": result.get("generate")}
                return
            # probe often while a start is young (a fast server's readiness is seen at once), then back off
            last_detail = result.get("detail") or "not ready"
            next_probe = time.monotonic() + (0.1 if time.monotonic() - t0 < 10 else 1.0)
        if probe is None and time.monotonic() >= next_probe:
            probe = _Probe(host, ctx.port, generate, token_ids, keys)
            probe.start()
        elapsed = time.monotonic() - t0
        if elapsed >= ready_timeout:
            yield failed("timeout", "the server (pid %d) was not ready within %gs (last probe: %s)"
                         % (pid, ready_timeout, last_detail))
            return
        if time.monotonic() - last_yield >= 5.0:
            last_yield = time.monotonic()
            yield {"type": "waiting", "elapsed": round(elapsed, 1), "detail": last_detail}
        time.sleep(poll)


def _new_lines(log_path, offset, partial):
    """(offset, partial, lines): the whole lines logged since `offset`, the unfinished one kept for later."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            chunk = f.read(1 << 20)
    except OSError:
        chunk = b""
    if not chunk:
        return offset, partial, []
    parts = (partial + chunk).split(b"\n")
    partial = parts.pop()
    return offset + len(chunk), partial, [p.decode("utf-8", "replace") for p in parts]


def _start_ended(pid, start, traceback):
    """(reason, message, exit status) once the starting server is gone, or None while it runs.

    A crash logs its traceback and exits (sglang's children take the whole tree down), so a Traceback counts
    as a failed start only when the process is gone within the crash window; sglang also logs tracebacks for
    optional features it skips (a missing openai_harmony, say) and then serves normally."""
    status = procfs.reap(pid)
    if status is not None or not procfs.same(pid, start):
        code = "" if status is None else " with code %d" % status
        return "crash", "the server (pid %d) exited%s during start" % (pid, code), status
    if traceback and procfs.wait_until(lambda: not procfs.same(pid, start), TRACEBACK_EXIT_S, 0.05):
        status = procfs.reap(pid)
        code = "" if status is None else " with code %d" % status
        return "traceback", "the server (pid %d) logged a Traceback and exited%s during start" % (pid, code), status
    return None


def await_ready(ctx, oplog, ready_timeout):
    """An operation's readiness wait: wait_ready's items become its records (one "log" record a line), the
    ready item is returned, a failure raised with its reason, log tail and pid."""
    for item in wait_ready(ctx, ready_timeout=ready_timeout):
        kind = item.pop("type")
        if kind == "log":
            for line in item["lines"]:
                oplog.log(line)
        elif kind == "waiting":
            oplog.emit("waiting", seconds=item.get("elapsed"), detail=item.get("detail"))
        elif kind == "warning":
            oplog.emit("warning", text=item.get("text"))
        elif kind == "failed":
            raise AgentError(item.pop("message", None) or "the server did not become ready", "failed", **item)
        elif kind == "ready":
            return item
    raise AgentError("the readiness check ended without a verdict", "failed")


# -- logs


def follow_server_log(ctx, lines=20, max_seconds=None, poll=0.25):
    """Yield {"lines": [...]} as the log grows (handles rotation), with a heartbeat so a gone client ends us."""
    path = servers.log_path(ctx) or os.devnull
    yield {"lines": log_tail(path, lines)}
    try:
        offset = os.path.getsize(path)
    except OSError:
        offset = 0
    partial, t0, last = b"", time.monotonic(), time.monotonic()
    while max_seconds is None or time.monotonic() - t0 < max_seconds:
        try:
            size = os.path.getsize(path)
        except OSError:
            size = 0
        if size < offset:  # rotated or truncated
            offset, partial = 0, b""
        if size > offset:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read(1 << 20)
            offset += len(chunk)
            parts = (partial + chunk).split(b"\n")
            partial = parts.pop()
            if parts:
                last = time.monotonic()
                yield {"lines": [p.decode("utf-8", "replace") for p in parts]}
        if time.monotonic() - last >= 2.0:
            last = time.monotonic()
            yield {"heartbeat": True}
        time.sleep(poll)
