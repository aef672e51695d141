"""dynctl's host agent: one stdlib-only file, uploaded under its content hash, fed JSON, answering JSON.

Run as `python dynctl_agent.py` with a request on stdin:
    {"protocol": 1, "verb": "inspect", "params": {...}, "host": {...}, "client": {...}}
It answers one JSON object on stdout:
    {"protocol": 1, "ok": true, "changed": false, "result": {...}}
    {"protocol": 1, "ok": false, "kind": "preflight"|"failed"|"usage"|"busy", "error": "..."}
Streaming verbs answer one JSON object per line and end with a line carrying "done": true.

Every verb is idempotent and does its whole transaction here on the host, so a dropped SSH
connection never leaves half a change. psutil is used when the interpreter has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import errno
import getpass
import hashlib
import http.client
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

PROTOCOL = 1

try:  # sglang's own interpreter ships psutil; anything else may not
    import psutil  # type: ignore
except Exception:  # pragma: no cover - depends on the host
    psutil = None

VERBS = {}
STREAM_VERBS = set()


def verb(name, stream=False):
    def register(fn):
        VERBS[name] = fn
        if stream:
            STREAM_VERBS.add(name)
        return fn

    return register


class AgentError(Exception):
    """A refusal or failure the client shows to the operator as is."""

    def __init__(self, message, kind="failed", **extra):
        super().__init__(message)
        self.kind = kind
        self.extra = extra


def outcome(ctx, err):
    """(kind, message) to report: a pre-flight refusal promises that nothing changed (exit 3), so once
    something did, the same refusal is a failure (exit 1) and says so."""
    if err.kind == "preflight" and ctx.changed:
        return "failed", "%s (but this host had already been changed before that: see %s)" % (
            err, ctx.path("journal.jsonl"))
    return err.kind, str(err)


class Context:
    """What the client told us about the host, with paths expanded here."""

    def __init__(self, host, client):
        self.workdir = os.path.abspath(os.path.expanduser(host.get("workdir") or "~/.dynctl"))
        self.python = host.get("python") or sys.executable
        self.port = int(host.get("port") or 30000)
        self.env = dict(host.get("env") or {})
        self.launch = list(host.get("launch") or [])
        self.args = list(host.get("args") or [])
        self.name = host.get("name") or socket.gethostname()
        self.keep = _keep_history(host.get("keep_history"))
        self.client = client or {}
        self.changed = False

    @property
    def who(self):
        return self.client.get("user") or "unknown"

    def ensure_workdir(self):
        try:
            os.makedirs(self.workdir, mode=0o700, exist_ok=True)
        except OSError as err:
            raise AgentError("cannot create workdir %s: %s" % (self.workdir, err.strerror), "preflight")
        if not os.access(self.workdir, os.W_OK | os.X_OK):
            raise AgentError("workdir %s is not writable by %s" % (self.workdir, getpass.getuser()), "preflight")
        return self.workdir

    def path(self, *parts):
        return os.path.join(self.workdir, *parts)


KEEP_HISTORY = 20  # finished releases and operation records kept in workdir (the config's keep_history)


def _keep_history(value):
    if value is None:
        return KEEP_HISTORY
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AgentError("keep_history must be an integer >= 1, got %r" % (value,), "usage")
    return value


def workdir_problem(workdir):
    """Why `workdir` cannot be used, or None: a relative one would follow whatever directory the agent was
    started in (the login or container home over SSH and pct, the client's cwd locally)."""
    if not workdir or not os.path.isabs(os.path.expanduser(workdir)):
        return "workdir %r is relative: use an absolute path, or ~/... for the remote home" % (workdir,)
    return None


# --------------------------------------------------------------------------- journal and lock


def now_iso():
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def journal(ctx, event, **fields):
    """Append one JSON line to workdir/journal.jsonl (0600)."""
    ctx.ensure_workdir()
    record = {"t": now_iso(), "event": event, "who": ctx.who}
    record.update(fields)
    fd = os.open(ctx.path("journal.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def pid_alive(pid):
    """True for a live, non-zombie process (zombies count as gone)."""
    if pid <= 0:
        return False
    if psutil is not None:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def process_start_time(pid):
    """Kernel start time of pid in clock ticks (guards against pid reuse), or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@contextlib.contextmanager
def host_lock(ctx, operation, op=None):
    """One operation per host: workdir/lock names the holder; a dead holder's lock is taken over.

    Re-entrant for the process that holds it: an operation worker runs verbs that take the lock themselves.
    """
    ctx.ensure_workdir()
    path = ctx.path("lock")
    held = _read_json(path) or {}
    if held.get("pid") == os.getpid() and held.get("pid_start") == process_start_time(os.getpid()):
        yield held
        return
    me = {
        "operation": operation,
        "who": ctx.who,
        "client_host": ctx.client.get("hostname"),
        "pid": os.getpid(),
        "pid_start": process_start_time(os.getpid()),
        "started": now_iso(),
        "op": op,
    }
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            holder = _read_json(path)
            if holder is None:  # being written right now, or garbage: look again
                time.sleep(0.05)
                holder = _read_json(path) or {}
            hpid = int(holder.get("pid") or 0)
            if pid_alive(hpid) and process_start_time(hpid) == holder.get("pid_start"):
                raise AgentError(
                    "host is busy: %s by %s (pid %s on %s) since %s"
                    % (holder.get("operation"), holder.get("who"), hpid, ctx.name, holder.get("started")),
                    "busy",
                    holder=holder,
                )
            journal(ctx, "lock.takeover", previous=holder)
            me["took_over"] = holder  # the caller warns: an operation died holding the host
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            continue
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
        except OSError as err:  # a full disk: an empty lock would read as "being written" to the next one
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise AgentError("cannot write the host lock %s: %s; nothing was changed" % (path, err.strerror or err),
                             "preflight")
        break
    else:
        raise AgentError("could not take the host lock %s" % path, "busy")
    try:
        yield me
    finally:
        with contextlib.suppress(FileNotFoundError):
            if (_read_json(path) or {}).get("pid") == os.getpid():
                os.unlink(path)


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGHUP, SIGTERM and SIGINT until the block ends: a few steps that must happen together (claim an
    operation, take the lock, start its worker, hand the lock over) are not cut in two by a dropped
    connection; a signal that came meanwhile is delivered afterwards."""
    held = {signal.SIGHUP, signal.SIGTERM, signal.SIGINT}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def hangup_shield():
    """A dropped SSH channel must not interrupt a transaction half way: SIGHUP is ignored meanwhile."""
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, old)


def write_json_atomic(path, obj, exclusive=False):
    """Replace `path` with `obj` as JSON (0600): a temp file beside it, fsync, rename. Readers see old or new.

    exclusive: create `path` only if it does not exist yet (a hard link instead of the rename); returns
    False, writing nothing, when it does. A failed write (a full disk) leaves no temp file behind.
    """
    tmp = "%s.tmp.%d" % (path, os.getpid())
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- inspect


def server_env(ctx):
    """The host's environment plus the configured `env`; values may refer to $VARS of the host."""
    env = dict(os.environ)
    for key, value in ctx.env.items():
        env[key] = os.path.expandvars(value)
    return env


def run_python(ctx, code, *args, timeout=60):
    """Run a snippet with the server's interpreter and environment; returns (rc, out, err)."""
    try:
        proc = subprocess.run(
            [ctx.python, "-c", code] + [str(a) for a in args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=server_env(ctx),
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise AgentError("python interpreter %s not found on %s" % (ctx.python, ctx.name), "preflight")
    except PermissionError:
        raise AgentError("python interpreter %s is not executable on %s" % (ctx.python, ctx.name), "preflight")
    except subprocess.TimeoutExpired:
        raise AgentError("%s did not answer within %ss" % (ctx.python, timeout), "failed")
    return proc.returncode, proc.stdout, proc.stderr


# Finds sglang without importing it: find_spec on a top-level name locates the package without
# executing its __init__, and the version comes from the dist-info or the setuptools-scm file.
_FIND_SGLANG = r"""
import importlib.util, json, os, re, sys
out = {"python": sys.executable, "python_version": "%d.%d.%d" % sys.version_info[:3]}
spec = importlib.util.find_spec("sglang")
if spec is None or not spec.submodule_search_locations:
    out["sglang"] = None
else:
    pkg = list(spec.submodule_search_locations)[0]
    version = None
    try:
        import importlib.metadata as md
        for dist in md.distributions(path=[os.path.dirname(pkg)]):
            if (dist.metadata["Name"] or "").lower() == "sglang":
                version = dist.version
                break
    except Exception:
        pass
    if version is None:
        try:
            text = open(os.path.join(pkg, "_version.py")).read()
            m = re.search(r"^(?:__version__|version)\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
            version = m.group(1) if m else None
        except OSError:
            pass
    out["sglang"] = {"version": version, "package_dir": pkg}
print(json.dumps(out))
"""


def find_sglang(ctx):
    rc, out, err = run_python(ctx, _FIND_SGLANG)
    if rc != 0:
        raise AgentError("%s failed while looking for sglang: %s" % (ctx.python, err.strip()[-500:]), "preflight")
    return json.loads(out.strip().splitlines()[-1])


def listening_pids(port):
    """Pids listening on TCP `port` (any address); empty when none or not visible."""
    pids = set()
    if psutil is not None:
        try:
            for c in psutil.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                    pids.add(c.pid)
            return sorted(pids)
        except (psutil.Error, OSError):
            pass
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(parts[9])
        except OSError:
            continue
    if not inodes:
        return []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir("/proc/%s/fd" % pid):
                link = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    pids.add(int(pid))
                    break
        except OSError:
            continue
    return sorted(pids)


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def port_in_use(port, host="127.0.0.1"):
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@verb("inspect")
def inspect_host(ctx, **_):
    found = find_sglang(ctx)
    try:
        usage = shutil.disk_usage(ctx.workdir if os.path.isdir(ctx.workdir) else os.path.dirname(ctx.workdir) or "/")
        free = usage.free
    except OSError:
        free = None
    workdir = {
        "path": ctx.workdir,
        "exists": os.path.isdir(ctx.workdir),
        "writable": os.access(ctx.workdir, os.W_OK) if os.path.isdir(ctx.workdir) else _creatable(ctx.workdir),
        "free_bytes": free,
    }
    listeners = [{"pid": pid, "cmdline": cmdline(pid)} for pid in listening_pids(ctx.port)]
    return {
        "hostname": socket.gethostname(),
        "python": found["python"],
        "python_version": found["python_version"],
        "sglang": found["sglang"],
        "workdir": workdir,
        "nvidia_smi": shutil.which("nvidia-smi", path=server_env(ctx).get("PATH")),
        "psutil": psutil is not None,
        "port": ctx.port,
        "port_listeners": listeners,
        "port_in_use": bool(listeners) or port_in_use(ctx.port),
        "agent_pid": os.getpid(),
    }


def _creatable(path):
    parent = os.path.dirname(path.rstrip("/")) or "/"
    while not os.path.isdir(parent) and parent != "/":
        parent = os.path.dirname(parent)
    return os.access(parent, os.W_OK)


@verb("ping")
def ping(ctx, **_):
    return {"pong": True, "time": time.time()}


# ---- operations
#
# A host-changing operation (deploy, rollback, restart) runs as ONE detached agent process on the host, in
# its own session, holding the host lock under its own pid. The client only starts it and follows its event
# file, so a dropped SSH connection never interrupts a critical sequence: the worker finishes, and the next
# client sees either the lock held by a live worker (and can follow it) or the final state.
#
# The client chooses the operation's id and sends it with the request, so starting is idempotent: the
# request file is claimed exclusively, and the same id sent again (by a client whose connection dropped
# before it saw a word) starts nothing and follows what the first request started. Every claimed id ends
# with a final event: the worker's, the refusal's (host busy), or a cancellation (op_detach: the client gave
# up before the host had the request). A follower that finds no worker and no final says what the host did.
#
#   workdir/ops/<id>.json      the request (kind, params, client, received)
#   workdir/ops/<id>.jsonl     events, one JSON object per line; the last one has "final": true
#   workdir/ops/<id>.log       the worker's own stdout/stderr (tracebacks land here)
#
# The newest keep_history records are kept (op_start prunes older ones; never the running one).

OPS = {}
_OP_ID = re.compile(r"^\d{8}T\d{6}-[a-z]+-[0-9a-f]{6,32}$")
_OP_GONE_S = 2.0  # how long a follower waits for a worker it cannot see before it calls it gone
_OP_ROOM = 1 << 20  # free bytes an operation wants in workdir on top of its request (events, journal, state)
_TMP_NAME = re.compile(r"\.tmp\.(\d+)$")


def operation(name):
    def register(fn):
        OPS[name] = fn
        return fn

    return register


def _op_append(path, record):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(record, default=str) + "\n").encode())
    finally:
        os.close(fd)


class OpLog:
    """Events of one operation, appended to its .jsonl and mirrored into the journal.

    The events are the client's view, not the transaction: a write that fails (a full disk) costs the view,
    never the operation half way. Only the first event must land, or the worker does nothing at all.
    """

    def __init__(self, ctx, op_id, kind):
        self.ctx = ctx
        self.op_id = op_id
        self.kind = kind
        self.path = ctx.path("ops", op_id + ".jsonl")
        self.t0 = time.monotonic()
        self.step_t0 = {}
        self.lost = 0

    def emit(self, type_, required=False, **fields):
        record = {"t": now_iso(), "elapsed": round(time.monotonic() - self.t0, 3), "type": type_}
        record.update(fields)
        try:
            _op_append(self.path, record)
        except OSError:
            if required:
                raise
            self.lost += 1
            return
        if type_ != "log":
            with contextlib.suppress(OSError, AgentError):
                journal(self.ctx, "%s.%s" % (self.kind, type_), op=self.op_id,
                        **{k: v for k, v in fields.items() if k != "lines"})

    @contextlib.contextmanager
    def step(self, name, detail=None):
        self.emit("step_started", step=name, detail=detail)
        t0 = time.monotonic()
        yield
        self.emit("step_done", step=name, seconds=round(time.monotonic() - t0, 3))

    def log(self, line):
        self.emit("log", text=line)

    def warn(self, text):
        self.emit("warning", text=text)


def _new_op_id(kind):
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return "%s-%s-%s" % (stamp, kind, os.urandom(6).hex())


def _op_check_id(op_id):
    if not isinstance(op_id, str) or not _OP_ID.match(op_id):
        raise AgentError("bad operation id %r (expected YYYYMMDDTHHMMSS-KIND-HEX, as `dynctl ops list` shows)"
                         % (op_id,), "usage")


def _op_file(ctx, op_id, ext):
    return ctx.path("ops", op_id + ext)


def _op_final(ctx, op_id, **fields):
    """The final word for an id whose worker never ran (refused, or cancelled before it started)."""
    record = {"t": now_iso(), "elapsed": 0.0, "type": "final", "final": True}
    record.update(fields)
    with contextlib.suppress(OSError):
        _op_append(_op_file(ctx, op_id, ".jsonl"), record)


def _op_last_final(ctx, op_id):
    try:
        with open(_op_file(ctx, op_id, ".jsonl"), "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        with contextlib.suppress(ValueError):
            event = json.loads(raw)
            if event.get("final"):
                return event
    return None


def _op_ids(ctx):
    """Claimed operation ids, newest first (by when this host received them)."""
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir(ctx.path("ops")):
            if name.endswith(".json") and _OP_ID.match(name[:-5]):
                with contextlib.suppress(OSError):
                    found.append((os.stat(ctx.path("ops", name)).st_mtime_ns, name[:-5]))
    return [op_id for _, op_id in sorted(found, reverse=True)]


def _op_already(existing, kind, op_id):
    if existing.get("kind") not in (None, kind):
        raise AgentError("operation id %s is already used by a %s, not a %s" % (op_id, existing.get("kind"), kind),
                         "usage")
    return {"op_id": op_id, "worker_pid": None, "already": True}


def _op_size(n):
    return "%.1f MiB" % (n / (1 << 20)) if n >= 1 << 20 else "%d KiB" % (n // 1024)


def _op_room_check(ctx, kind, request):
    """Refuse, before anything is written, where workdir cannot hold the backups and records of the operation."""
    need = _OP_ROOM + 2 * len(json.dumps(request, default=str))  # the request, and backups about as large
    try:
        free = shutil.disk_usage(ctx.workdir).free
    except OSError:
        return
    if free < need:
        raise AgentError("no space left in workdir %s on %s: %s free, a %s needs about %s (its request, backups "
                         "and records); free some space there; nothing was changed"
                         % (ctx.workdir, ctx.name, _op_size(free), kind, _op_size(need)), "preflight")


def _op_prune(ctx, keep_id=None):
    """Keep the newest ctx.keep operation records, never the running one; drop temp files of dead writers."""
    removed = []
    for folder in (ctx.workdir, ctx.path("ops")):  # temp files of writers killed half way (state, pidfile, ...)
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                m = _TMP_NAME.search(name)
                if m and not pid_alive(int(m.group(1))):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, name))
    running = (_read_json(ctx.path("lock")) or {}).get("op")
    for op_id in _op_ids(ctx)[ctx.keep:]:
        if op_id in (keep_id, running):
            continue
        for ext in (".json", ".jsonl", ".log"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_op_file(ctx, op_id, ext))
        removed.append(op_id)
    if removed:
        with contextlib.suppress(OSError, AgentError):
            journal(ctx, "ops.pruned", ops=removed, keep=ctx.keep)
    return removed


@verb("op_start")
def op_start(ctx, kind, params=None, op_id=None, **_):
    """Claim op_id, take the host lock, start the detached worker, hand the lock to it, return the op id.

    The same op_id twice starts one worker: the second call answers already=True.
    """
    if kind not in OPS:
        raise AgentError("unknown operation %r" % kind, "usage")
    op_id = op_id or _new_op_id(kind)
    _op_check_id(op_id)
    ctx.ensure_workdir()
    path = _op_file(ctx, op_id, ".json")
    existing = _read_json(path)
    if existing is not None:
        return _op_already(existing, kind, op_id)
    request = {"id": op_id, "kind": kind, "params": params or {}, "client": ctx.client, "received": now_iso(),
               "host": {"name": ctx.name, "workdir": ctx.workdir, "python": ctx.python, "port": ctx.port,
                        "env": ctx.env, "launch": ctx.launch, "args": ctx.args, "keep_history": ctx.keep}}
    _op_room_check(ctx, kind, request)
    with signals_deferred():
        try:
            os.makedirs(ctx.path("ops"), mode=0o700, exist_ok=True)
            claimed = write_json_atomic(path, request, exclusive=True)
        except OSError as err:
            raise AgentError("cannot record the %s request in %s: %s; nothing was changed"
                             % (kind, ctx.path("ops"), err.strerror or err), "preflight")
        if not claimed:
            return _op_already(_read_json(path) or {}, kind, op_id)
        try:
            with host_lock(ctx, kind, op=op_id) as holder:
                dead = holder.pop("took_over", None)
                if dead:
                    request["warning"] = ("took over the host lock of a %s by %s (pid %s) since %s, whose process "
                                          "is gone" % (dead.get("operation"), dead.get("who"), dead.get("pid"),
                                                       dead.get("started")))
                    write_json_atomic(path, request)
                _op_prune(ctx, keep_id=op_id)
                worker = _spawn_detached([sys.executable, os.path.abspath(__file__), "--op", path],
                                         _op_file(ctx, op_id, ".log"), ctx.workdir)
                holder.update({"pid": worker, "pid_start": _wait_start_time(worker), "op": op_id})
                # From here the worker speaks for the operation; it adopts the lock itself if this write is lost.
                with contextlib.suppress(OSError):
                    write_json_atomic(ctx.path("lock"), holder)
        except AgentError as err:
            _op_final(ctx, op_id, ok=False, kind=err.kind, error=str(err))
            raise
        except OSError as err:
            message = "cannot start the %s worker: %s; nothing was changed" % (kind, err.strerror or err)
            _op_final(ctx, op_id, ok=False, kind="preflight", error=message)
            raise AgentError(message, "preflight")
    ctx.changed = True
    return {"op_id": op_id, "worker_pid": worker, "already": False}


def _spawn_detached(argv, log_path, cwd):
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


def _wait_start_time(pid):
    for _ in range(100):
        start = process_start_time(pid)
        if start is not None:
            return start
        time.sleep(0.01)
    return None


def _lock_holder(ctx):
    holder = _read_json(ctx.path("lock"))
    if not holder:
        return None
    pid = int(holder.get("pid") or 0)
    if pid_alive(pid) and process_start_time(pid) == holder.get("pid_start"):
        return holder
    return None


@verb("op_run", stream=True)
def op_run(ctx, kind, params=None, op_id=None, from_line=0, **_):
    """op_start and op_follow in one round trip; sent again with the same op_id, it only follows."""
    started = op_start(ctx, kind, params, op_id)
    for item in op_follow(ctx, op_id=started["op_id"], from_line=from_line):
        yield item


@verb("op_current")
def op_current(ctx, **_):
    """The live holder of the host lock (operation, who, pid, since), or None."""
    return {"holder": _lock_holder(ctx)}


def _op_resolve(ctx, op_id):
    """An operation id, "latest" (the newest this host received), or None (the one running now)."""
    if op_id is None:
        holder = _lock_holder(ctx)
        if not holder or not holder.get("op"):
            raise AgentError("no operation is running on %s" % ctx.name, "usage")
        return holder["op"]
    if op_id == "latest":
        ids = _op_ids(ctx)
        if not ids:
            raise AgentError("no operation has run on %s yet (workdir %s)" % (ctx.name, ctx.workdir), "usage")
        return ids[0]
    _op_check_id(op_id)
    return op_id


def _op_aftermath(ctx):
    """What the host looks like now, in words: the release in force and the server."""
    current = _pt_current(ctx) or BASELINE
    try:
        found = find_server(ctx)
        server = "server %s, pid %s" % (found.get("state"), found.get("pid")) if found.get("pid") else "server down"
    except Exception as err:  # a report, not a transaction: say what could not be looked at
        server = "server state unknown (%s)" % err
    return "release in force: %s; %s" % (current, server)


@verb("op_follow", stream=True)
def op_follow(ctx, op_id=None, from_line=0, **_):
    """Yield the events of an operation (id, "latest", or the running one when None) until its final event."""
    op_id = _op_resolve(ctx, op_id)
    path = _op_file(ctx, op_id, ".jsonl")
    request = _read_json(_op_file(ctx, op_id, ".json"))
    if request is None:
        known = ", ".join(_op_ids(ctx)[:5]) or "none"
        raise AgentError("no operation %s on %s (newest: %s)" % (op_id, ctx.name, known), "usage")
    kind = request.get("kind") or "operation"
    seen = 0
    pos = 0
    gone_since = None
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
            event = json.loads(raw)
            event["op_id"] = op_id
            event["op_kind"] = kind
            event["seq"] = seen
            yield {"ok": True, "op": event}  # the op's own ok/error stay inside, not the stream's
            if event.get("final"):
                return
        if lines:
            gone_since = None
        else:
            holder = _lock_holder(ctx)
            if holder is not None and holder.get("op") == op_id:
                gone_since = None
            elif gone_since is None:
                gone_since = time.monotonic()
            elif time.monotonic() - gone_since > _OP_GONE_S:
                if seen == 0:  # the worker writes its first event before it does anything
                    verdict = {"kind": "preflight", "error": "the %s never started on %s (no worker took it up); "
                                                             "nothing was changed" % (kind, ctx.name)}
                else:
                    verdict = {"kind": "failed", "error": "the %s worker on %s died without finishing (see %s); "
                                                          "%s" % (kind, ctx.name, _op_file(ctx, op_id, ".log"),
                                                                  _op_aftermath(ctx))}
                verdict.update({"type": "final", "final": True, "ok": False, "op_id": op_id, "op_kind": kind,
                                "seq": seen + 1})
                yield {"ok": True, "op": verdict}
                return
        time.sleep(0.1)


@verb("op_detach")
def op_detach(ctx, op_id, kind=None, **_):
    """The client stops following op_id (Ctrl-C): say what became of it. An id this host has not received yet
    is claimed as cancelled, so a request still on its way starts nothing."""
    _op_check_id(op_id)
    path = _op_file(ctx, op_id, ".json")
    if _read_json(path) is None:
        ctx.ensure_workdir()
        os.makedirs(ctx.path("ops"), mode=0o700, exist_ok=True)
        tomb = {"id": op_id, "kind": kind, "cancelled": True, "client": ctx.client, "received": now_iso()}
        if write_json_atomic(path, tomb, exclusive=True):
            _op_final(ctx, op_id, ok=False, kind="cancelled",
                      error="cancelled by %s before it started; nothing was changed" % ctx.who)
            return {"state": "cancelled", "op_id": op_id}
    final = _op_last_final(ctx, op_id)
    if final is not None:
        return {"state": "finished", "op_id": op_id, "final": final}
    return {"state": "running", "op_id": op_id, "holder": _lock_holder(ctx)}


@verb("op_list")
def op_list(ctx, limit=20, **_):
    """The newest operations on this host: id, kind, who, when, and how each ended (or that it runs)."""
    running = (_lock_holder(ctx) or {}).get("op")
    out = []
    for op_id in _op_ids(ctx)[:int(limit)]:
        request = _read_json(_op_file(ctx, op_id, ".json")) or {}
        final = _op_last_final(ctx, op_id)
        if final is not None:
            state = "done" if final.get("ok") else (final.get("kind") or "failed")
        else:
            state = "running" if op_id == running else "unfinished"
        out.append({"id": op_id, "kind": request.get("kind"), "who": (request.get("client") or {}).get("user"),
                    "client_host": (request.get("client") or {}).get("hostname"),
                    "received": request.get("received"), "state": state,
                    "error": (final or {}).get("error")})
    return {"ops": out}


def _op_adopt_lock(ctx, request):
    """Make the host lock name this worker: op_start hands it over, and this covers a handover write it lost."""
    path = ctx.path("lock")
    holder = _read_json(path) or {}
    if holder.get("op") != request["id"]:
        raise AgentError("the host lock was not handed to this %s (it names %s); nothing was changed"
                         % (request["kind"], holder.get("operation") or "no operation"), "busy")
    me = process_start_time(os.getpid())
    if holder.get("pid") != os.getpid() or holder.get("pid_start") != me:
        holder.update(pid=os.getpid(), pid_start=me)
        write_json_atomic(path, holder)


def run_operation(request_path):
    """Entry point of the detached worker (`dynctl_agent.py --op REQUEST`)."""
    request = _read_json(request_path)
    ctx = Context(request["host"], request.get("client"))
    oplog = OpLog(ctx, request["id"], request["kind"])
    try:
        oplog.emit("started", required=True, kind=request["kind"], pid=os.getpid())
    except OSError as err:  # nobody would hear of what follows: do nothing (a follower says so)
        sys.stderr.write("cannot write %s: %s; not starting\n" % (oplog.path, err))
        return 1
    try:
        _op_adopt_lock(ctx, request)
        if request.get("warning"):
            oplog.warn(request["warning"])
        result = OPS[request["kind"]](ctx, oplog, **(request.get("params") or {}))
        final = {"ok": True}
        final.update(result or {})
    except AgentError as err:
        kind, message = outcome(ctx, err)
        final = {"ok": False, "kind": kind, "error": message}
        final.update(err.extra)
    except Exception as err:  # the worker must always leave a final word
        import traceback

        traceback.print_exc()
        final = {"ok": False, "kind": "failed", "error": "%s: %s" % (type(err).__name__, err)}
    finally:
        holder = _read_json(ctx.path("lock")) or {}
        if holder.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ctx.path("lock"))
    if oplog.lost:
        final["events_lost"] = oplog.lost
    oplog.emit("final", final=True, **final)
    return 0 if final.get("ok") else 1


@operation("restart")
def op_restart(ctx, oplog, **params):
    """The restart verb's stop → start → ready, run by the worker: its items become the operation's events."""
    for item in verb_server_restart(ctx, **params):
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


# ---- bench (issue 7)
#
# The load generator of `dynctl bench` runs here, next to the server: its timings are the server's and
# not the SSH path's, and 256 streams cost one SSH channel, not 256 forwarded ones. Measured with
# benchmarks/bench_loadgen.py at 256 streams: here ~7 % of a core at 5,000 tok/s (0.8 % at the seed box's
# speed) and 0.1 % on the client; through a local forward 58 % of a client core and failed requests.
# Closed loop: each of C workers keeps one HTTP/1.1 connection and sends its next streaming
# /v1/completions request when the previous one has ended. Raw timings go back to the client, which
# computes the statistics (dynctl/bench/stats.py).


_BENCH_GAUGES = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "queued",
    "sglang:gen_throughput": "gen_throughput",
    "sglang:spec_accept_length": "accept_length",
    "sglang:spec_enabled": "spec_enabled",
    "sglang:spec_disable_threshold": "threshold",
    "sglang:spec_disabled_steps_total": "disabled_steps",
    "sglang:generation_tokens_total": "generation_tokens",
}
_BENCH_LABEL = re.compile(r'(\w+)="([^"]*)"')
_BENCH_REPLICA_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")  # ranks that repeat the same batch
_BENCH_THRESHOLD_KEY = "speculative_disable_batch_threshold"
_BENCH_VOCAB = range(1000, 20000)  # token ids every real vocabulary has


def bench_parse_metrics(text):
    """The few sglang series bench samples, summed over DP ranks; decode steps per cuda-graph mode.

    With --enable-metrics-for-all-schedulers every TP rank repeats the same batch: only rank 0 counts.
    """
    out = {}
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        try:
            number = float(value)
        except ValueError:
            continue
        labels = dict(_BENCH_LABEL.findall(head))
        if any(labels.get(k, "0") != "0" for k in _BENCH_REPLICA_LABELS):
            continue
        if name == "sglang:cuda_graph_passes_total":
            key = "passes_" + labels.get("mode", "unknown")
        elif name == "sglang:realtime_tokens_total":
            key = "tokens_" + labels.get("mode", "unknown")
        else:
            key = _BENCH_GAUGES.get(name)
        if key is not None and number == number and abs(number) != float("inf"):  # NaN: "no value yet"
            out[key] = out.get(key, 0.0) + number
    return out


def _bench_url(host, port, path):
    return "http://%s:%d%s" % (host, port, path)


def _bench_get_json(host, port, path, timeout):
    with urllib.request.urlopen(_bench_url(host, port, path), timeout=timeout) as resp:
        return json.loads(resp.read().decode("utf-8", "replace"))


def _bench_server_info(host, port, timeout):
    try:
        return _bench_get_json(host, port, "/server_info", timeout)
    except urllib.error.HTTPError as err:
        if err.code != 404:
            raise
        return _bench_get_json(host, port, "/get_server_info", timeout)  # before the rename


def _bench_thresholds(info):
    states = info.get("internal_states") or []
    return [s.get(_BENCH_THRESHOLD_KEY) for s in states if isinstance(s, dict) and _BENCH_THRESHOLD_KEY in s]


@verb("bench_probe")
def bench_probe(ctx, host="127.0.0.1", port=None, timeout=10.0, **_):
    """Is the server answering, which model, which speculation, and is the threshold live-switchable."""
    port = int(port or ctx.port)
    where = "%s:%d" % (host, port)
    try:
        models = _bench_get_json(host, port, "/v1/models", timeout)
        info = _bench_server_info(host, port, timeout)
    except (OSError, ValueError) as err:  # URLError and HTTPError are OSErrors
        return {"reachable": False, "where": where, "error": str(getattr(err, "reason", None) or err)}
    data = models.get("data") or [{}]
    thresholds = _bench_thresholds(info)
    metrics = True
    try:
        with urllib.request.urlopen(_bench_url(host, port, "/metrics"), timeout=timeout) as resp:
            metrics = "sglang:" in resp.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        metrics = False
    return {
        "reachable": True,
        "where": where,
        "model": data[0].get("id"),
        "version": info.get("version"),
        "speculative_algorithm": info.get("speculative_algorithm"),
        "threshold": thresholds[0] if thresholds else None,
        "threshold_live": bool(thresholds),
        "metrics": metrics,
        # a server without a tokenizer takes token ids on /generate, not text on /v1/completions
        "token_ids": bool(info.get("skip_tokenizer_init")),
    }


@verb("set_threshold")
def set_threshold(ctx, threshold, host="127.0.0.1", port=None, timeout=10.0, **_):
    """Set the speculation threshold live, then read back what every scheduler has in force."""
    port = int(port or ctx.port)
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < -1:
        raise AgentError("threshold must be an integer >= -1, got %r" % (threshold,), "usage")
    if port == ctx.port:  # never send a change to a listener that is not our server
        loc = locate_server(ctx)
        found = _lc_not_ours(ctx, loc) if loc["server"] is None else None
        if found is not None and found["kind"] in ("foreign", "hidden"):
            raise AgentError("%s; the threshold was not sent (%s)" % (found["text"], found["hint"]), "preflight",
                             not_ours=found["text"])
    body = json.dumps({"server_args": {_BENCH_THRESHOLD_KEY: threshold}}).encode()
    req = urllib.request.Request(_bench_url(host, port, "/set_internal_state"), data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    where = "%s:%d" % (host, port)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
    except (OSError, ValueError) as err:
        reason = getattr(err, "reason", None)
        if isinstance(err, ConnectionRefusedError) or isinstance(reason, ConnectionRefusedError):
            # Nothing was sent, so nothing changed ("down": exit 3), unlike a request that failed half-way.
            raise AgentError("no server is listening on %s, so there is no live threshold to change; start "
                             "it (dynctl start), or deploy the threshold (dynctl deploy --threshold %d), which "
                             "starts it" % (where, threshold), "down") from None
        raise AgentError("server at %s: cannot change the threshold: /set_internal_state %s"
                         % (where, _threshold_http_failure(err, timeout)), "failed") from None
    try:
        info = _bench_server_info(host, port, timeout)
    except (OSError, ValueError) as err:
        raise AgentError("server at %s took the threshold change, but reading it back failed: /server_info %s"
                         % (where, _threshold_http_failure(err, timeout)), "failed") from None
    in_force = _bench_thresholds(info)
    if not in_force:  # /set_internal_state answers "updated" even for keys it ignores: trust the read-back
        raise AgentError("server at %s has no %s in /server_info internal_states: it is not patched, so "
                         "the threshold cannot change live" % (where, _BENCH_THRESHOLD_KEY), "preflight")
    if any(v != threshold for v in in_force):
        raise AgentError("server at %s did not take threshold %d: in force %s (is the running server the "
                         "patched release?)" % (where, threshold, in_force), "failed")
    journal(ctx, "threshold.set", threshold=threshold)
    return {"threshold": threshold, "in_force": in_force}


def _threshold_http_failure(err, timeout):
    """What went wrong with one HTTP request to the server, in words (never urllib's repr)."""
    if isinstance(err, urllib.error.HTTPError):
        return "answered HTTP %d %s" % (err.code, err.reason)
    reason = getattr(err, "reason", None) or err
    if isinstance(reason, (socket.timeout, TimeoutError)):  # distinct classes before Python 3.10
        return "got no answer within %g s" % timeout
    if isinstance(reason, OSError) and reason.strerror:
        return "failed: %s" % reason.strerror
    return "failed: %s" % (reason or type(err).__name__)


async def _bench_read_head(reader):
    """Status, lower-cased headers and whether the server spoke HTTP/1.0 (no keep-alive)."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("server closed the connection before answering")
    parts = status_line.split(None, 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip().lower()
    return status, headers, status_line.startswith(b"HTTP/1.0")


async def _bench_body(reader, headers):
    """The response body as it arrives: chunked, sized, or until the server closes."""
    if "chunked" in headers.get("transfer-encoding", ""):
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ConnectionResetError("connection closed in the middle of the response")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 65536))
            if not data:
                raise ConnectionResetError("connection closed in the middle of the response")
            left -= len(data)
            yield data
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


class _BenchLevel:
    """One closed-loop level: C workers, warm-up, then a window of a duration or a request count."""

    def __init__(self, host, port, model, concurrency, input_len, output_len, duration, num_prompts,
                 warmup, seed, sample_s, idle_timeout, max_level_s, token_ids=False):
        self.host, self.port, self.model = host, port, model
        self.token_ids = token_ids
        self.concurrency = concurrency
        self.input_len, self.output_len = input_len, output_len
        self.duration, self.num_prompts = duration, num_prompts
        self.warmup = warmup
        self.rng = random.Random(seed)
        self.sample_s, self.idle_timeout, self.max_level_s = sample_s, idle_timeout, max_level_s
        self.t0 = time.perf_counter()
        self.w0 = 0.0 if warmup == 0 else None
        self.w1 = None
        self.warm_claimed = self.warm_done = 0
        self.measured_claimed = self.measured_done = 0
        self.failed = self.warmup_failed = 0
        self.records = []
        self.errors = {}
        self.samples = []
        self.metrics_note = None
        self.metrics_missing = False
        self.timed_out = False
        self.stop = False
        self.window_open = asyncio.Event()
        self.finished = asyncio.Event()
        self.busy = {}  # worker id -> (writer, last activity)
        if self.w0 is not None:
            self.w1 = duration
            self.window_open.set()

    def now(self):
        return time.perf_counter() - self.t0

    # -- requests
    def _body(self):
        if self.token_ids:  # ids low enough for any vocabulary
            return json.dumps({
                "input_ids": [self.rng.randrange(10, 1000) for _ in range(self.input_len)], "stream": True,
                "sampling_params": {"max_new_tokens": self.output_len, "temperature": 0.0, "ignore_eos": True},
            }).encode()
        prompt = self.rng.choices(_BENCH_VOCAB, k=self.input_len)  # exact length without a tokenizer
        return json.dumps({
            "model": self.model, "prompt": prompt, "max_tokens": self.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }).encode()

    def _claim(self):
        """'warm' or 'measure' for the next request, None when this level sends no more."""
        if self.stop:
            return None
        if self.warm_claimed < self.warmup:
            self.warm_claimed += 1
            return "warm"
        if self.num_prompts is not None:
            if self.measured_claimed >= self.num_prompts:
                return None
            self.measured_claimed += 1
        return "measure"

    def _note_error(self, message):
        message = message.strip().splitlines()[0][:200] if message.strip() else "error"
        if message in self.errors or len(self.errors) < 20:
            self.errors[message] = self.errors.get(message, 0) + 1

    def _finish(self, kind, record, error):
        now = self.now()
        if kind == "warm":
            self.warm_done += 1
            if error:
                self.warmup_failed += 1
                self._note_error(error)
            if self.warm_done >= self.warmup and self.w0 is None:
                self.w0 = now
                if self.duration is not None:
                    self.w1 = now + self.duration
                self.window_open.set()
            return
        if error:
            if self.num_prompts is not None or (self.w0 is not None and (self.w1 is None or now <= self.w1)):
                self.failed += 1
            self._note_error(error)
        elif record is not None:
            self.records.append(record)
        if self.num_prompts is not None:
            self.measured_done += 1
            if self.measured_done >= self.num_prompts:
                self.w1 = now
                self.stop = True
                self.finished.set()

    async def _connect(self):
        return await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 10.0)

    async def _request(self, wid, conn, record):
        """One streaming request on `conn`; fills `record`; returns (conn to reuse or None, error or None)."""
        reader, writer = conn
        body = self._body()
        path = "/generate" if self.token_ids else "/v1/completions"
        head = ("POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                "Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n" % (path, self.host, self.port, len(body)))
        start = time.perf_counter()
        record["s"] = round(start - self.t0, 6)
        self.busy[wid] = [writer, start, None]  # writer, last activity, why the watchdog cut it
        writer.write(head.encode() + body)
        await writer.drain()
        status, headers, http10 = await _bench_read_head(reader)
        keep = headers.get("connection") != "close" and not http10
        times, cums = [], []
        state = {"buf": b"", "cum": 0, "usage": None, "error": None}

        def on_data(data, t):
            buf = state["buf"] + data
            while True:
                i = buf.find(b"\n")
                if i < 0:
                    break
                line, buf = buf[:i].strip(), buf[i + 1:]
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    continue
                try:
                    obj = json.loads(payload)
                except ValueError:
                    state["error"] = "unparsable stream event: %r" % payload[:80]
                    continue
                if "error" in obj or obj.get("object") == "error":
                    err = obj.get("error", obj)
                    state["error"] = "server error: %s" % (err.get("message") if isinstance(err, dict) else err)
                    continue
                # OpenAI completions carry usage and choices; sglang's /generate meta_info and output_ids
                usage = obj.get("usage") or obj.get("meta_info") or {}
                choices = obj.get("choices") or []
                text = choices[0].get("text") if choices else (obj.get("output_ids") or obj.get("text"))
                if usage.get("completion_tokens") is not None:
                    state["usage"] = int(usage["completion_tokens"])
                if text:
                    state["cum"] = state["usage"] if state["usage"] is not None else state["cum"] + 1
                    times.append(int((t - start) * 1e6))
                    cums.append(state["cum"])
            state["buf"] = buf

        record["t"], record["k"] = times, cums
        async for data in _bench_body(reader, headers):
            now = time.perf_counter()
            self.busy[wid][1] = now
            if status == 200:
                on_data(data, now)
            else:
                state["error"] = "HTTP %d: %s" % (status, data[:200].decode("utf-8", "replace"))
        record["e"] = int((time.perf_counter() - start) * 1e6)
        if status != 200 and state["error"] is None:
            state["error"] = "HTTP %d" % status
        record["n"] = state["usage"] if state["usage"] is not None else state["cum"]
        if cums and cums[-1] == len(cums):  # one token per chunk: the counts say nothing new
            del record["k"]
        if state["error"] is None and not times:
            state["error"] = "stream ended without any token"
        return (conn if keep else None), state["error"]

    async def _worker(self, wid):
        conn = None
        while True:
            kind = self._claim()
            if kind is None:
                break
            record, error = {}, None
            for attempt in (1, 2):
                reused = conn is not None
                try:
                    if conn is None:
                        conn = await self._connect()
                    conn, error = await self._request(wid, conn, record)
                    break
                except asyncio.CancelledError:
                    if kind == "measure" and record.get("t"):
                        record["a"] = 1  # cut at the end of the window: its tokens so far still count
                        record["e"] = int((time.perf_counter() - self.t0 - record["s"]) * 1e6)
                        record["n"] = record["k"][-1]
                        self.records.append(record)
                    self._close(conn)
                    raise
                except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as err:
                    self._close(conn)
                    conn = None
                    entry = self.busy.get(wid)
                    # a kept-alive connection the server closed in between: one silent retry, nothing was sent
                    if attempt == 1 and reused and not record.get("t") and not (entry and entry[2]):
                        record = {}
                        continue
                    error = entry[2] if entry and entry[2] else ("%s: %s" % (type(err).__name__, err)).rstrip(": ")
                    break
                finally:
                    self.busy.pop(wid, None)
            self._finish(kind, None if error else record, error)
            if error and conn is None:
                await asyncio.sleep(0.2)  # server down or restarting: do not spin
        self._close(conn)

    @staticmethod
    def _close(conn):
        if conn is not None:
            with contextlib.suppress(Exception):
                conn[1].transport.abort()

    async def _watchdog(self):
        while True:
            await asyncio.sleep(1.0)
            now = time.perf_counter()
            for entry in list(self.busy.values()):
                if entry[2] is None and now - entry[1] > self.idle_timeout:
                    entry[2] = "no data from the server for %g s" % self.idle_timeout
                    entry[0].transport.abort()

    async def _sample(self, edge=False):
        """One /metrics scrape; `edge` ones are taken at the window's ends, for exact counter deltas."""
        if self.metrics_missing:
            return
        try:
            status, text = await asyncio.wait_for(self._get_text("/metrics"), 5.0)
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError) as err:
            self.metrics_note = "metrics unreadable: %s" % (err or type(err).__name__,)
            return  # a restarting server: try again at the next tick
        if status == 404 or (status == 200 and "sglang:" not in text):
            self.metrics_missing = True
            self.metrics_note = "no sglang metrics at /metrics (start the server with --enable-metrics)"
            return
        if status != 200:
            self.metrics_note = "/metrics answered HTTP %d" % status
            return
        sample = bench_parse_metrics(text)
        sample["t"] = round(self.now(), 3)
        if edge:
            sample["edge"] = 1
        self.samples.append(sample)

    async def _sampler(self):
        while not self.metrics_missing:
            await self._sample()
            await asyncio.sleep(self.sample_s)

    async def _get_text(self, path):
        """(status, body) of one GET on a fresh connection."""
        reader, writer = await self._connect()
        try:
            writer.write(("GET %s HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n"
                          % (path, self.host, self.port)).encode())
            await writer.drain()
            status, headers, _ = await _bench_read_head(reader)
            chunks = [c async for c in _bench_body(reader, headers)]
            return status, b"".join(chunks).decode("utf-8", "replace")
        finally:
            writer.transport.abort()

    async def _until(self, event, *others):
        """Wait for `event` (or any of `others` to end) until the level's time cap; True if it fired."""
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait([waiter, *others], timeout=max(0.0, self.max_level_s - self.now()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return event.is_set()

    async def run(self):
        workers = [asyncio.ensure_future(self._worker(i)) for i in range(self.concurrency)]
        helpers = [asyncio.ensure_future(self._watchdog()), asyncio.ensure_future(self._sampler())]
        all_done = asyncio.ensure_future(asyncio.gather(*workers, return_exceptions=True))
        try:
            if not await self._until(self.window_open, all_done):
                self.timed_out = not all_done.done()
                return
            await self._sample(edge=True)
            if self.duration is not None:
                cap = min(self.w1, self.max_level_s) - self.now()
                await asyncio.wait([all_done], timeout=max(0.0, cap))
                self.timed_out = self.now() < self.w1 - 0.01 and not all_done.done()
            elif not await self._until(self.finished, all_done):
                self.timed_out = not all_done.done()
            await self._sample(edge=True)  # the load still runs: counters up to the window's end
        finally:
            self.stop = True
            end = self.now()
            if self.w0 is None:
                self.w0 = end
            if self.w1 is None or self.w1 > end:
                self.w1 = end
            for task in workers + helpers:
                task.cancel()
            # bounded: a task that ignores its cancellation must not keep the level (and the host) busy
            await asyncio.wait([*workers, *helpers, all_done], timeout=10.0)

    def tick(self):
        phase = "warmup" if self.w0 is None else "measure"
        latest = self.samples[-1] if self.samples else {}
        return {"ok": True, "event": "tick", "phase": phase, "elapsed": round(self.now(), 3),
                "warmup_done": self.warm_done, "completed": len(self.records), "failed": self.failed,
                "running": latest.get("running"), "window_elapsed": round(self.now() - self.w0, 3)
                if self.w0 is not None else None}

    def result(self, cpu_s):
        wall = self.now()
        return {
            "ok": True, "event": "level", "concurrency": self.concurrency, "window": [self.w0, self.w1],
            "records": self.records, "failed": self.failed, "warmup": self.warmup,
            "warmup_failed": self.warmup_failed, "errors": self.errors, "samples": self.samples,
            "metrics_note": self.metrics_note, "timed_out": self.timed_out,
            "loadgen": {"cpu_s": round(cpu_s, 3), "wall_s": round(wall, 3),
                        "cpu_percent": round(100.0 * cpu_s / wall, 1) if wall > 0 else None},
        }


def _bench_cpu_s():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


@verb("bench_level", stream=True)
def bench_level(ctx, concurrency, input_len, output_len, duration=None, num_prompts=None, warmup=None,
                model=None, seed=0, host="127.0.0.1", port=None, tick_s=1.0, sample_s=0.5,
                idle_timeout=300.0, max_level_s=None, **_):
    """Run one closed-loop level; yield a tick about every tick_s, then the raw level result."""
    port = int(port or ctx.port)
    for name, value in (("concurrency", concurrency), ("input_len", input_len), ("output_len", output_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AgentError("%s must be a positive integer, got %r" % (name, value), "usage")
    if (duration is None) == (num_prompts is None):
        raise AgentError("give exactly one of duration and num_prompts", "usage")
    warmup = concurrency if warmup is None else int(warmup)
    if max_level_s is None:
        max_level_s = 3600.0 + (duration or 0)
    probe = bench_probe(ctx, host=host, port=port)
    if not probe["reachable"]:
        raise AgentError("server at %s not answering: %s" % (probe["where"], probe["error"]), "unreachable")
    level_args = (host, port, model or probe["model"], concurrency, input_len, output_len, duration, num_prompts,
                  warmup, seed, sample_s, idle_timeout, max_level_s, probe["token_ids"])
    loop = asyncio.new_event_loop()
    try:
        level = loop.run_until_complete(_bench_make_level(level_args))
        cpu0 = _bench_cpu_s()
        task = loop.create_task(level.run())
        # The loop only runs inside run_until_complete: between slices we write one small tick line.
        while not task.done():
            loop.run_until_complete(asyncio.wait([task], timeout=tick_s))
            if not task.done():
                yield level.tick()
        task.result()
        yield level.result(_bench_cpu_s() - cpu0)
    finally:
        with contextlib.suppress(Exception):  # streams cut mid-body leave response generators open
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _bench_make_level(args):
    return _BenchLevel(*args)  # built inside the loop: its Events bind to it on Python < 3.10


# ---- watch (issue 6)
#
# `watch` is the live feed of the TUI: ONE long-lived call per host that samples everything on the host
# itself and answers one JSON line per interval, so the client never opens a channel per refresh and
# a slow host never piles up requests. Raw values only (Prometheus text, nvidia-smi CSV, log lines): the
# client parses them with dynctl.metrics, the same code `dynctl status` uses.


# Never route 127.0.0.1 through an http_proxy the host's environment may set.
_WATCH_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_WATCH_METRICS_CAP = 4 << 20
_WATCH_LOG_SCAN = 256 << 10  # how far back the first sample looks for state marks
_WATCH_LOG_CAP = 1 << 20  # most log bytes read per interval; a flood beyond that is skipped
# Lines the client needs even when the tail it is sent is cut: speculation transitions, the drain, and the
# patch's warnings that the threshold cannot act.
_WATCH_MARKS = ("Speculation enabled", "Speculation disabled", "SIGTERM received", "is not armed:", "never fires:")
_WATCH_MAX_MARKS = 200
_WATCH_OWN_REQUESTS = ('"GET /metrics HTTP/1.1"', '"GET /server_info HTTP/1.1"', '"GET /v1/loads?include=core HTTP/1.1"')
# Same query as dynctl.metrics.GPU_QUERY; the index first cuts the looping output into one block per period.
_WATCH_GPU_FIELDS = "index,uuid,name,utilization.gpu,memory.used,memory.total"
_WATCH_INFO_KEYS = ("version", "model_path", "served_model_name", "tp_size", "dp_size", "enable_dp_attention",
                    "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                    "speculative_num_draft_tokens", "speculative_disable_batch_threshold", "speculative_adaptive",
                    "max_running_requests", "disable_overlap_schedule")
_WATCH_STATE_KEYS = ("speculative_disable_batch_threshold", "avg_spec_accept_length", "last_gen_throughput",
                     "effective_max_running_requests_per_dp")


def _watch_get(port, path, timeout, cap):
    with _WATCH_HTTP.open("http://127.0.0.1:%d%s" % (port, path), timeout=timeout) as resp:
        return resp.read(cap)


def _watch_http_error(err):
    if isinstance(err, urllib.error.HTTPError):
        return "HTTP %d" % err.code
    reason = getattr(err, "reason", err)
    if isinstance(reason, socket.timeout) or isinstance(err, socket.timeout):
        return "timed out"
    return str(getattr(reason, "strerror", None) or reason)


def _watch_metrics(ctx, timeout):
    """The sglang: samples of /metrics, without histogram buckets (the client needs none of them)."""
    t0 = time.time()
    try:
        raw = _watch_get(ctx.port, "/metrics", timeout, _WATCH_METRICS_CAP).decode("utf-8", "replace")
    except (OSError, ValueError, urllib.error.URLError) as err:
        return {"ok": False, "error": _watch_http_error(err)}
    keep = []
    for line in raw.splitlines():
        if line.startswith("sglang:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if not (name.endswith("_bucket") or name.endswith("_created")):
                keep.append(line)
        elif line.startswith("# TYPE sglang:"):
            keep.append(line)
    return {"ok": True, "text": "\n".join(keep) + "\n", "ms": round((time.time() - t0) * 1000, 1)}


def _watch_loads(ctx, timeout):
    """/v1/loads?include=core (sglang >= 0.5.8): the scheduler's batch right now. The /metrics gauges are
    only written every decode_log_interval steps and, once idle, every 30 s (scheduler_runtime_checker_mixin
    check_memory), so they lag exactly when load moves."""
    try:
        data = json.loads(_watch_get(ctx.port, "/v1/loads?include=core", timeout, 1 << 20).decode("utf-8", "replace"))
    except (OSError, ValueError, urllib.error.URLError) as err:
        return {"ok": False, "error": _watch_http_error(err)}
    loads = data.get("loads") if isinstance(data, dict) else None
    if not isinstance(loads, list):
        return {"ok": False, "error": "/v1/loads without a loads list"}
    keep = ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens",
            "token_usage", "gen_throughput")
    return {"ok": True, "loads": [{k: d.get(k) for k in keep} for d in loads if isinstance(d, dict)]}


def _watch_server_info(ctx, timeout):
    try:
        data = json.loads(_watch_get(ctx.port, "/server_info", timeout, 8 << 20).decode("utf-8", "replace"))
    except (OSError, ValueError, urllib.error.URLError) as err:
        return {"ok": False, "error": _watch_http_error(err)}
    if not isinstance(data, dict):
        return {"ok": False, "error": "/server_info is not a JSON object"}
    out = {k: data[k] for k in _WATCH_INFO_KEYS if k in data}
    states = data.get("internal_states")
    first = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    out["internal_state"] = {k: first[k] for k in _WATCH_STATE_KEYS if k in first}
    return {"ok": True, "data": out}


_WATCH_BOOT = []


def _watch_boot_time():
    if not _WATCH_BOOT:
        try:
            with open("/proc/stat") as f:
                _WATCH_BOOT.append(next(int(ln.split()[1]) for ln in f if ln.startswith("btime ")))
        except (OSError, StopIteration, ValueError):
            _WATCH_BOOT.append(None)
    return _WATCH_BOOT[0]


def _watch_started(pid):
    """Epoch seconds when pid started, or None."""
    ticks, boot = process_start_time(pid), _watch_boot_time()
    if ticks is None or boot is None:
        return None
    return boot + ticks / float(os.sysconf("SC_CLK_TCK"))


class _WatchProcess:
    """The server as locate_server decides it (ours, not ours, nobody), cheaply enough for every second.

    The full decision walks /proc and the port's sockets, so it is taken again only when the pidfile
    changed, the process it named is gone, or a few seconds have passed; in between, the answer stands.
    """

    FULL_EVERY = 5.0

    def __init__(self, ctx):
        self.ctx = ctx
        self.answer, self.key, self.at, self.pid_start = None, None, 0.0, None

    def _pidfile_key(self):
        try:
            st = os.stat(self.ctx.path(SERVER_PIDFILE))
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None

    def sample(self, now):
        key = self._pidfile_key()
        answer = self.answer
        if (answer is None or key != self.key or now - self.at >= self.FULL_EVERY
                or (answer["pid"] is not None and not _lc_same(answer["pid"], self.pid_start))):
            self.answer, self.key, self.at = self._decide(), key, now
        return dict(self.answer)

    def _decide(self):
        ctx = self.ctx
        loc = locate_server(ctx)
        server, rec = loc["server"], loc["record"] or {}
        self.pid_start = server["start"] if server else None
        if server is None:
            out = {"pid": None, "alive": False, "source": None}
        else:
            from_pidfile = server["source"] == "pidfile"
            out = {"pid": server["pid"], "alive": True, "source": server["source"],
                   "started": _watch_started(server["pid"]),
                   "stopping": rec.get("stopping") if from_pidfile and not rec.get("stopped") else None,
                   "release": rec.get("release") if from_pidfile else None}
        not_ours = _lc_not_ours(ctx, loc)
        if not_ours is not None:
            out["not_ours"] = {k: not_ours[k] for k in ("kind", "pid", "cmdline", "text")}
        if loc["leftovers"]:
            out["leftovers"] = sorted(loc["leftovers"])
        return out


class _WatchLog:
    """New lines of the server log since the last sample; follows truncation and replacement."""

    PROOF = 64  # bytes before our position that must still be there, or the file was rewritten

    def __init__(self, path, max_lines):
        self.path = path
        self.max_lines = max_lines
        self.f = None
        self.ino = None
        self.pos = 0
        self.partial = b""
        self.proof = b""

    def _rewritten(self):
        """Truncated and refilled to the same size or beyond: the bytes we last read are gone."""
        if not self.proof:
            return False
        self.f.seek(self.pos - len(self.proof))
        return self.f.read(len(self.proof)) != self.proof

    def _open(self, at_end):
        self.close()
        f = open(self.path, "rb")
        st = os.fstat(f.fileno())
        self.f, self.ino, self.partial, self.proof = f, st.st_ino, b"", b""
        self.pos = max(0, st.st_size - _WATCH_LOG_SCAN) if at_end else 0
        return self.pos > 0

    def close(self):
        if self.f is not None:
            self.f.close()
            self.f = None

    def sample(self, first=False):
        out = {"path": self.path, "lines": [], "marks": [], "decode": None, "dropped": 0, "skipped_bytes": 0,
               "reset": False}
        try:
            if self.f is None:
                cut = self._open(at_end=first)
                out["reset"] = not first
            else:
                st = os.stat(self.path)
                if st.st_ino != self.ino or st.st_size < self.pos or self._rewritten():  # a new server run
                    cut = self._open(at_end=False)
                    out["reset"] = True
                else:
                    cut = False
            size = os.fstat(self.f.fileno()).st_size
            if size - self.pos > _WATCH_LOG_CAP:
                out["skipped_bytes"] = size - _WATCH_LOG_CAP - self.pos
                self.pos, self.partial, self.proof, cut = size - _WATCH_LOG_CAP, b"", b"", True
            self.f.seek(self.pos)
            chunk = self.f.read(size - self.pos)
        except OSError as err:
            self.close()
            out["error"] = "%s: %s" % (self.path, err.strerror or err)
            return out
        self.pos += len(chunk)
        if chunk:
            self.proof = (self.proof + chunk)[-self.PROOF:]
        data = self.partial + chunk
        end = data.rfind(b"\n") + 1
        self.partial = data[end:]
        lines = data[:end].decode("utf-8", "replace").splitlines()
        if cut and lines:
            lines = lines[1:]  # the first line starts mid-way
        # uvicorn logs every request at INFO; our own polling would fill the tail with itself
        lines = [ln for ln in lines if not any(q in ln for q in _WATCH_OWN_REQUESTS)]
        for line in lines:
            if line.startswith("==== dynctl start "):  # the lifecycle's header: earlier marks are another run's
                out["marks"] = []
            if "Decode batch" in line:
                out["decode"] = line
            if any(m in line for m in _WATCH_MARKS):
                out["marks"].append(line)
        out["marks"] = out["marks"][-_WATCH_MAX_MARKS:]
        out["dropped"] += max(0, len(lines) - self.max_lines)
        out["lines"] = lines[-self.max_lines:] if self.max_lines else []
        return out


class _WatchGpus:
    """One long-lived `nvidia-smi --query-gpu ... -lms` read by a thread that keeps the last full block.

    NVML stays initialised between samples: a fresh call costs 20-30 ms on an H200 with persistence mode
    on (measured), more without it; the loop costs 0.05 % of a core at 1 Hz (measured)."""

    RETRY_EVERY = 30.0

    def __init__(self, ctx, interval):
        self.exe = shutil.which("nvidia-smi", path=server_env(ctx).get("PATH"))
        self.env = server_env(ctx)
        self.ms = max(100, int(interval * 1000))
        self.lock = threading.Lock()
        self.latest = None
        self.error = None if self.exe else "nvidia-smi not found on the server's PATH"
        self.proc = None
        self.started = 0.0

    def _start(self, now):
        self.started = now
        try:
            self.proc = subprocess.Popen(
                [self.exe, "--query-gpu=" + _WATCH_GPU_FIELDS, "--format=csv,noheader,nounits",
                 "-lms", str(self.ms)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
            )
        except OSError as err:
            self.error = "nvidia-smi: %s" % (err.strerror or err)
            return
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc):
        # One block per period, one line per GPU in index order: a block ends when the index starts over.
        # It is published as soon as it has as many GPUs as the last one had (no wait for the next period).
        block, last, size, noise = [], None, None, []
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").strip()
            head = line.split(",", 1)[0]
            if not head.isdigit():
                noise.append(line)
                continue
            index = int(head)
            if last is not None and index <= last:
                if size is None or len(block) != size:
                    self._publish(block)
                size, block = len(block), []
            last = index
            block.append(line)
            if size is not None and len(block) == size:
                self._publish(block)
        proc.wait()
        with self.lock:
            self.error = ("nvidia-smi exited %s: %s" % (proc.returncode, " ".join(noise)[-300:])).strip(": ")

    def _publish(self, block):
        with self.lock:
            self.latest = {"ok": True, "csv": "\n".join(block) + "\n", "t": time.time()}
            self.error = None

    def sample(self, now):
        if self.exe is None:
            return {"ok": False, "error": self.error}
        if (self.proc is None or self.proc.poll() is not None) and now - self.started >= self.RETRY_EVERY:
            self._start(now)
        with self.lock:
            if self.latest is not None and now - self.latest["t"] < max(5.0, 3 * self.ms / 1000.0):
                return dict(self.latest)
            return {"ok": False, "error": self.error or "waiting for nvidia-smi"}

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _watch_release(ctx):
    """The manifest of the release in force: workdir/current names it (see the patch section)."""
    try:
        with open(ctx.path("current")) as f:
            release_id = f.read().strip()
    except OSError:
        return None
    if not release_id or "/" in release_id or release_id.startswith("."):
        return None
    manifest = _read_json(ctx.path("releases", release_id, "manifest.json")) or {}
    out = {k: manifest.get(k) for k in ("strategy", "threshold", "sglang_version", "created", "who", "state")}
    out["id"] = release_id
    return out


def _watch_lock(ctx):
    holder = _read_json(ctx.path("lock"))
    if not holder:
        return None
    pid = int(holder.get("pid") or 0)
    if not (pid_alive(pid) and process_start_time(pid) == holder.get("pid_start")):
        return None
    return {k: holder.get(k) for k in ("operation", "who", "client_host", "started", "op")}


def _watch_number(value, name, low, high, kind=float):
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise AgentError("watch: %s must be a number, got %r" % (name, value), "usage")
    if not low <= number <= high:
        raise AgentError("watch: %s must be between %s and %s, got %s" % (name, low, high, number), "usage")
    return number


class _WatchStop(BrokenPipeError):
    """SIGTERM from the client closing its end: the same as a broken pipe, so main() ends quietly."""


def _watch_sigterm(signum, frame):
    raise _WatchStop()


@verb("watch", stream=True)
def watch(ctx, interval=1.0, log_lines=50, gpus=True, max_items=None, info_every=5.0, **_):
    """Yield one sample of the server, its GPUs and its log every `interval` seconds, on the host itself."""
    interval = _watch_number(interval, "interval", 0.05, 60.0)
    log_lines = _watch_number(log_lines, "log_lines", 0, 5000, int)
    info_every = _watch_number(info_every, "info_every", 0.0, 3600.0)
    max_items = None if max_items is None else _watch_number(max_items, "max_items", 1, 10 ** 9, int)
    proc, log = _WatchProcess(ctx), _WatchLog(ctx.path("server.log"), log_lines)
    gpu = _WatchGpus(ctx, interval) if gpus else None
    previous = None
    if threading.current_thread() is threading.main_thread():  # a closed stream ends us by SIGTERM
        previous = signal.signal(signal.SIGTERM, _watch_sigterm)
    seq, slot, info_at, last_pid, last_http, loads_missing_at = 0, time.time(), None, None, None, None
    try:
        while True:
            start = time.time()
            budget = interval * 0.8
            item = {"ok": True, "seq": seq, "t": start, "utc_offset": time.localtime(start).tm_gmtoff,
                    "interval": interval, "port": ctx.port}
            item["process"] = proc.sample(start)
            pid = item["process"]["pid"]
            if pid is None:  # whatever answers on the port is not our server: its numbers are not ours either
                item["metrics"] = {"ok": False, "error": "no server of ours on port %d" % ctx.port}
            else:
                item["metrics"] = _watch_metrics(ctx, max(0.05, budget * 0.4))
                if loads_missing_at is None or start - loads_missing_at >= 60:  # an older sglang: now and then
                    item["loads"] = _watch_loads(ctx, max(0.05, start + budget * 0.6 - time.time()))
                    loads_missing_at = start if item["loads"].get("error", "").startswith("HTTP 404") else None
            if pid is not None and (info_at is None or start - info_at >= info_every or pid != last_pid
                                    or item["metrics"]["ok"] != last_http):
                item["server_info"] = _watch_server_info(ctx, max(0.05, start + budget - time.time()))
                info_at = start
            last_pid, last_http = pid, item["metrics"]["ok"]
            item["gpus"] = gpu.sample(start) if gpu else None
            item["log"] = log.sample(first=seq == 0)
            item["release"] = _watch_release(ctx)
            item["lock"] = _watch_lock(ctx)
            item["sample_ms"] = round((time.time() - start) * 1000, 1)
            yield item
            seq += 1
            if max_items is not None and seq >= max_items:
                return
            slot += interval
            now = time.time()
            if slot < now:  # a slow sample: skip the missed slots instead of bursting to catch up
                slot = now
            time.sleep(slot - now)
    except _WatchStop:
        return
    finally:
        log.close()
        if gpu:
            gpu.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# ---- lifecycle (issue 5)
#
# The server is started in its own session with a marker in its environment, so everything it spawns
# can be found again -- children that setsid() away, orphans that outlive it -- without ever matching
# a process by name. Every kill is of a (pid, start time) pair collected from that server, so a
# recycled pid is never signalled. Zombies count as gone.


SERVER_PIDFILE = "server.json"
SERVER_LOG = "server.log"
SERVER_MARKER_ENV = "DYNCTL_SERVER_ID"
_LC_LOG_ROTATE = 256 << 20
_LC_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_LC_SGLANG_PORT = 30000


def _lc_stat(pid):
    """(ppid, pgid, sid, start_ticks, state) of pid from /proc, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return {"ppid": int(fields[1]), "pgid": int(fields[2]), "sid": int(fields[3]),
                "start": int(fields[19]), "state": fields[0]}
    except (OSError, IndexError, ValueError):
        return None


def _lc_table():
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _lc_stat(int(name))
            if st is not None:
                table[int(name)] = st
    return table


def _lc_same(pid, start):
    """pid is still the live (non-zombie) process that started at `start`."""
    st = _lc_stat(pid)
    return st is not None and st["state"] not in ("Z", "X") and st["start"] == start


def _lc_uptime(start_ticks):
    try:
        with open("/proc/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
        return max(0.0, time.time() - (btime + start_ticks / float(_LC_CLK_TCK)))
    except (OSError, StopIteration, ValueError):
        return None


def _lc_has_marker(pid, marker):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return (b"\0%s=%s\0" % (SERVER_MARKER_ENV.encode(), marker.encode())) in b"\0" + f.read() + b"\0"
    except OSError:
        return False


def _lc_argv_port(argv):
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--port="):
            return arg.split("=", 1)[1]
    return None


def _lc_argv_matches(cmd, argv):
    """cmd (from /proc) is what exec'ing argv gives: equal, or behind a shebang interpreter."""
    if not cmd or not argv:
        return False
    if cmd == argv:
        return True
    tail = list(argv[1:])
    head = cmd[: len(cmd) - len(tail)] if tail else cmd
    if tail and cmd[len(cmd) - len(tail):] != tail:
        return False
    return any(os.path.basename(h) == os.path.basename(argv[0]) for h in head)


def _lc_runs_module(cmd, module):
    """cmd is `python [opts] -m module ...` (a `-c` before it makes it a decoy, not a server)."""
    i = 1
    while i < len(cmd):
        arg = cmd[i]
        if arg == "-c" or not arg.startswith("-"):
            return False
        if arg == "-m":
            return i + 1 < len(cmd) and cmd[i + 1] == module
        if arg.startswith("-m"):
            return arg[2:] == module
        i += 2 if arg in ("-X", "-W") else 1
    return False


def _lc_contains(cmd, part):
    """part appears in cmd right at the start or behind an interpreter and one option."""
    n = len(part)
    return n > 0 and any(cmd[i:i + n] == list(part) for i in range(0, min(3, len(cmd) - n + 1)))


def _lc_looks_like_server(ctx, cmd):
    """cmd runs sglang's launcher, or the configured launch command, on ctx.port."""
    if not cmd:
        return False
    launch = list(ctx.launch or [])
    runs = _lc_runs_module(cmd, "sglang.launch_server")
    if not runs and len(launch) >= 3 and launch[-2] == "-m":
        runs = _lc_runs_module(cmd, launch[-1])
    elif not runs and launch:
        runs = _lc_contains(cmd, launch[1:] or launch)
    if not runs:
        return False
    port = _lc_argv_port(cmd)
    return str(ctx.port) == port if port is not None else ctx.port == _LC_SGLANG_PORT


def _lc_tree(table, pid, start, leads_session, marker):
    """{pid: start} of the server and everything it spawned: descendants, its session, marker holders."""
    tree = {pid: start}
    children = {}
    for p, st in table.items():
        children.setdefault(st["ppid"], []).append(p)
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in tree and table[child]["start"] >= start:
                tree[child] = table[child]["start"]
                todo.append(child)
    for p, st in table.items():
        if p in tree or st["start"] < start or st["state"] in ("Z", "X"):
            continue
        if (leads_session and st["sid"] == pid) or (marker and _lc_has_marker(p, marker)):
            tree[p] = st["start"]
    return tree


def _lc_pidfile(ctx):
    return _read_json(ctx.path(SERVER_PIDFILE)) if os.path.isdir(ctx.workdir) else None


def _lc_write_pidfile(ctx, record):
    ctx.ensure_workdir()
    write_json_atomic(ctx.path(SERVER_PIDFILE), record)


def _lc_describe(pid, start=None):
    out = {"pid": pid, "cmdline": cmdline(pid)}
    if start is not None:
        out["start"] = start
    return out


def _lc_is_recorded(pid, rec):
    """The live pid runs the recorded command line, or (retitled by setproctitle) carries our marker."""
    return _lc_argv_matches(cmdline(pid), rec.get("argv") or []) or bool(
        rec.get("marker") and _lc_has_marker(pid, rec["marker"]))


def _lc_leftovers(table, rec):
    """Live processes of a previous server that is gone: its session and whatever carries its marker.

    Session members count only while pid `rec.pid` is free or still ours: the kernel keeps a pid
    reserved while it names a session, so a new leader with that pid means a new, foreign session.
    """
    old, start, marker = int(rec["pid"]), rec.get("pid_start"), rec.get("marker")
    if start is None:
        return {}
    lead = table.get(old)
    # a zombie cannot be a recycled pid; a live process must be the very one we started
    session_ours = lead is None or (lead["start"] == start and (
        lead["state"] in ("Z", "X") or _lc_is_recorded(old, rec)))
    found = {}
    for p, st in table.items():
        if st["state"] in ("Z", "X") or st["start"] < start or (p == old and not session_ours):
            continue
        if (session_ours and st["sid"] == old) or (marker and _lc_has_marker(p, marker)):
            found[p] = st["start"]
    return found


def locate_server(ctx):
    """The one decision about who runs on our port: ours, not ours (named), or nobody.

    Ours: the pidfile's process (checked against its start time and command line), else the sglang (or
    configured) launcher listening on the port. Everything else that matters is named, never claimed:
    "foreign" listeners on the port, and "unmanaged" launchers found only by their command line (not
    listening, not in our pidfile, without our marker) -- those are refused, never signalled. Status, the
    watch stream, stop, start, deploy and rollback all read this same answer.

    Returns {"server": {...} or None, "record": pidfile, "pidfile": note, "tree": {pid: start},
    "leftovers": {pid: start} of a previous server, "foreign": [pids], "unmanaged": {pid: start}}.
    """
    rec = _lc_pidfile(ctx) or None
    table = _lc_table()
    server, note = None, "absent"
    if rec and rec.get("pid"):
        pid = int(rec["pid"])
        st = table.get(pid)
        if rec.get("stopped"):
            note = "stopped"
        elif st is None or st["state"] in ("Z", "X"):
            note = "stale: pid %d is gone" % pid
        elif st["start"] != rec.get("pid_start") or not _lc_is_recorded(pid, rec):
            note = "stale: pid %d now belongs to another process (%s)" % (pid, " ".join(cmdline(pid))[:120])
        else:
            note = "ok"
            server = dict(pid=pid, start=st["start"], sid=st["sid"], source="pidfile",
                          marker=rec.get("marker"), argv=cmdline(pid))
    leftovers = _lc_leftovers(table, rec) if rec and rec.get("pid") and server is None else {}
    live = {p: st for p, st in table.items() if st["state"] not in ("Z", "X") and p not in leftovers}
    listeners = listening_pids(ctx.port)
    if server is None:
        for pid in listeners:
            if pid in live and _lc_looks_like_server(ctx, cmdline(pid)):
                server = dict(pid=pid, start=live[pid]["start"], sid=live[pid]["sid"], source="port",
                              marker=None, argv=cmdline(pid))
                break
    tree = {}
    if server is not None:
        tree = _lc_tree(table, server["pid"], server["start"], server["sid"] == server["pid"], server["marker"])
        leftovers = {p: s for p, s in leftovers.items() if p not in tree}
    found = [p for p in live if p != os.getpid() and p not in tree and _lc_looks_like_server(ctx, cmdline(p))]
    found = [p for p in found if live[p]["ppid"] not in found]  # the launcher, not its children
    unmanaged = {p: live[p]["start"] for p in sorted(found, key=lambda p: live[p]["start"])}
    foreign = [p for p in listeners if p not in tree and p not in leftovers]
    return {"server": server, "record": rec, "pidfile": note, "tree": tree, "leftovers": leftovers,
            "foreign": foreign, "unmanaged": unmanaged}


def _lc_not_ours(ctx, loc):
    """What stands in our server's way that dynctl will not touch, named for the operator; None if nothing.

    {"kind": "unmanaged" | "foreign" | "hidden", "pid", "start", "cmdline", "text", "hint"}
    """
    for pid, start in loc["unmanaged"].items():
        cmd = cmdline(pid)
        return {"kind": "unmanaged", "pid": pid, "start": start, "cmdline": cmd,
                "text": "pid %d (%s) looks like an sglang server for port %d, but dynctl did not start it and it "
                        "is not listening on the port" % (pid, " ".join(cmd)[:200], ctx.port),
                "hint": "stop it yourself, or run `dynctl stop --pid %d` to have dynctl stop it" % pid}
    if loc["foreign"]:  # even next to our running server (another address): the next start would fail
        pid = loc["foreign"][0]
        cmd = cmdline(pid)
        return {"kind": "foreign", "pid": pid, "start": process_start_time(pid), "cmdline": cmd,
                "text": "port %d is held by pid %d (%s), which dynctl does not manage"
                        % (ctx.port, pid, " ".join(cmd)[:200]),
                "hint": "stop it yourself or change the port in the config"}
    if loc["server"] is None and not loc["leftovers"] and port_in_use(ctx.port):
        return {"kind": "hidden", "pid": None, "start": None, "cmdline": [],
                "text": "port %d is in use by a process %s cannot see" % (ctx.port, getpass.getuser()),
                "hint": "find it with `ss -ltnp` as root"}
    return None


def _lc_preflight(ctx, loc, action):
    """Refuse `action` before it changes anything when something that is not ours is in the way."""
    found = _lc_not_ours(ctx, loc)
    if found is None:
        return
    journal(ctx, "%s.refused" % action, reason=found["kind"], pid=found["pid"], cmdline=found["cmdline"][:8])
    raise AgentError("%s refused: %s; nothing was changed and nothing was killed -- %s"
                     % (action, found["text"], found["hint"]), "preflight",
                     not_ours={k: found[k] for k in ("kind", "pid", "start", "cmdline")})


def _lc_probe_host(argv):
    host = None
    for i, arg in enumerate(argv or []):
        if arg == "--host" and i + 1 < len(argv):
            host = argv[i + 1]
        elif arg.startswith("--host="):
            host = arg.split("=", 1)[1]
    return "127.0.0.1" if host in (None, "", "0.0.0.0", "::", "[::]", "localhost") else host


def _lc_http(host, port, method, path, body=None, timeout=5.0):
    """(status, body bytes); raises OSError/HTTPException when nothing sensible came back."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _lc_health(host, port, timeout=3.0):
    try:
        return _lc_http(host, port, "GET", "/health", timeout=timeout)[0]
    except (OSError, http.client.HTTPException):
        return None


def find_server(ctx):
    """State of the managed server: down / starting / ready / draining, with pid, uptime and port owner."""
    loc = locate_server(ctx)
    server, rec = loc["server"], loc["record"] or {}
    not_ours = _lc_not_ours(ctx, loc)
    out = {"state": "down", "pid": None, "source": None, "argv": None, "uptime_s": None, "started": None,
           "release": None, "health": None, "port": ctx.port, "pidfile": loc["pidfile"],
           "log": ctx.path(SERVER_LOG), "port_owner": None,
           "leftovers": [_lc_describe(p) for p in sorted(loc["leftovers"])],
           "unmanaged": [_lc_describe(p, s) for p, s in loc["unmanaged"].items()],
           "not_ours": not_ours, "in_force": _dp_launch_in_force(ctx)}
    if loc["foreign"]:
        out["port_owner"] = _lc_describe(loc["foreign"][0])
    if server is None:
        return out
    from_pidfile = server["source"] == "pidfile"
    out.update(pid=server["pid"], source=server["source"], argv=server["argv"], uptime_s=_lc_uptime(server["start"]),
               started=rec.get("started") if from_pidfile else None,
               release=rec.get("release") if from_pidfile else None)
    out["health"] = _lc_health(_lc_probe_host(server["argv"]), ctx.port)
    if from_pidfile and rec.get("stopping"):
        out["state"] = "draining"
    elif out["health"] == 200:
        out["state"] = "ready"
    else:
        out["state"] = "starting"
    return out


# -- stop


def nvidia_smi_path(ctx):
    return shutil.which("nvidia-smi", path=server_env(ctx).get("PATH"))


def gpu_compute_pids(smi, env=None):
    """{pid: used MiB} of the compute processes nvidia-smi lists; None when it cannot say."""
    try:
        proc = subprocess.run([smi, "--query-compute-apps=" + _LC_APPS_QUERY, "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_compute_apps(proc.stdout) if proc.returncode == 0 else None


# The same query as dynctl.metrics.APPS_QUERY; uuid and pid come before the process name, which may hold commas.
_LC_APPS_QUERY = "gpu_uuid,pid,process_name,used_memory"


def parse_compute_apps(text):
    """{pid: used MiB or None} from `--query-compute-apps=gpu_uuid,pid,process_name,used_memory` (noheader, nounits)."""
    pids = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[1].isdigit():
            try:
                pids[int(parts[1])] = float(parts[-1])
            except ValueError:  # [N/A] in some containers and MIG setups
                pids[int(parts[1])] = None
    return pids


def _lc_port_bindable(port):
    """No listener holds port on any address: a bind (never a listen) succeeds. ~50 us, where reading
    /proc/net/tcp or scanning every process's fds takes 10-20 ms."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "held"
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((addr, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return False
        finally:
            s.close()
    return True


def _lc_signal(ctx, pid, start, sig, why):
    """Send sig to pid only while it is still the process we collected; True when sent."""
    if not _lc_same(pid, start):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError as err:
        raise AgentError("cannot signal pid %d (%s): %s" % (pid, " ".join(cmdline(pid))[:80], err.strerror))
    journal(ctx, "stop.signal", pid=pid, signal=signal.Signals(sig).name, why=why, cmdline=cmdline(pid)[:8])
    return True


def _lc_wait_until(cond, timeout, step=0.02):
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


def _lc_reap(pid):
    """Collect our own child's exit status (the agent that started a server may still be its parent)."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if done != pid:
        return None
    return os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status


def _lc_mark_pidfile(ctx, server, **fields):
    rec = _lc_pidfile(ctx)
    if rec and server and rec.get("pid") == server["pid"]:
        rec.update(fields)
        _lc_write_pidfile(ctx, rec)


def _lc_operator_pid(ctx, loc, pid, pid_start):
    """The process the operator named with `stop --pid`, as a server to stop; refuses anything else.

    Only our own server, or a launcher of an sglang server for this port that dynctl did not start
    (an "unmanaged" one, which a plain stop never signals), may be named; the start time, when given,
    pins the very process the operator confirmed.
    """
    pid = int(pid)
    st = _lc_stat(pid)
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
    if pid not in loc["unmanaged"]:
        what = " ".join(cmdline(pid))[:200]
        raise AgentError("pid %d (%s) is not an sglang server for port %d; dynctl stops only that server, so "
                         "nothing was signalled" % (pid, what, ctx.port), "preflight")
    return dict(pid=pid, start=st["start"], sid=st["sid"], source="operator", marker=None, argv=cmdline(pid))


def _lc_stop_summary(result):
    """One line for the stop step of deploy, rollback and restart: what was stopped, or that nothing was."""
    if not result.get("stopped"):
        return result.get("message") or "no server was running"
    swept = result.get("swept") or []
    if result.get("pid") is None:
        return "no server was running; swept %d leftover process(es) of the previous server (pids %s)" % (
            len(swept), ", ".join(str(p["pid"]) for p in swept) or "none")
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
    loc = locate_server(ctx)
    server, leftovers = loc["server"], dict(loc["leftovers"])
    if pid is not None:
        server = _lc_operator_pid(ctx, loc, pid, pid_start)
        if server is not None and server["source"] == "operator":
            table = _lc_table()
            loc["tree"] = _lc_tree(table, server["pid"], server["start"], server["sid"] == server["pid"], None)
            leftovers = {}
    if server is None and not leftovers:
        rec = loc["record"]
        if rec and not rec.get("stopped"):
            rec["stopped"] = now_iso()
            _lc_write_pidfile(ctx, rec)
        not_ours = _lc_not_ours(ctx, loc)
        msg = "server already stopped"
        if not_ours:
            msg += "; %s: left alone -- %s" % (not_ours["text"], not_ours["hint"])
        journal(ctx, "stop.noop", port=ctx.port, pidfile=loc["pidfile"],
                not_ours=not_ours and {k: not_ours[k] for k in ("kind", "pid")})
        return {"stopped": False, "message": msg, "pidfile": loc["pidfile"],
                "port_owner": _lc_describe(loc["foreign"][0]) if loc["foreign"] else None,
                "not_ours": not_ours}
    ctx.changed = True
    smi = nvidia_smi_path(ctx)
    gpu_before = gpu_compute_pids(smi, server_env(ctx)) if smi else None
    tree = dict(loc["tree"])
    tree.update(leftovers)
    out = {"stopped": True, "pid": server["pid"] if server else None, "source": server["source"] if server else None,
           "escalated": False, "swept": [], "grace_s": grace, "timings": {}, "warnings": []}
    journal(ctx, "stop.begin", pid=out["pid"], source=out["source"], grace=grace, tree=sorted(tree),
            leftovers=sorted(leftovers))
    t_exit = time.monotonic()
    if server is not None:
        pid, start = server["pid"], server["start"]
        _lc_mark_pidfile(ctx, server, stopping=now_iso())
        t_term = time.monotonic()
        _lc_signal(ctx, pid, start, signal.SIGTERM, "stop: drain")
        gone = lambda: _lc_reap(pid) is not None or not _lc_same(pid, start)  # noqa: E731
        if not _lc_wait_until(gone, grace, 0.01):
            out["escalated"] = True
            _lc_signal(ctx, pid, start, signal.SIGKILL, "stop: grace %gs over" % grace)
            if not _lc_wait_until(gone, 10.0):
                raise AgentError("pid %d survived SIGKILL for 10 s (state %s); the host needs attention"
                                 % (pid, (_lc_stat(pid) or {}).get("state")))
        t_exit = time.monotonic()
        out["timings"]["sigterm_to_exit_s"] = round(t_exit - t_term, 4)
        journal(ctx, "stop.exited", pid=pid, escalated=out["escalated"], after_s=out["timings"]["sigterm_to_exit_s"])
        # children that appeared while it drained belong to it too
        table = _lc_table()
        for p, st in table.items():
            if st["start"] >= start and st["state"] not in ("Z", "X") and p not in tree and (
                    (server["sid"] == pid and st["sid"] == pid) or (server["marker"] and _lc_has_marker(p, server["marker"]))):
                tree[p] = st["start"]
    survivors = {p: s for p, s in tree.items() if _lc_same(p, s)}
    for p, s in sorted(survivors.items()):
        desc = _lc_describe(p)
        if _lc_signal(ctx, p, s, signal.SIGKILL, "stop: sweep survivor of the server"):
            out["swept"].append(desc)
    if not _lc_wait_until(lambda: not any(_lc_same(p, s) for p, s in survivors.items()), 10.0, 0.005):
        left = [p for p, s in survivors.items() if _lc_same(p, s)]
        raise AgentError("processes of the old server survived SIGKILL: %s" % ", ".join(map(str, left)))
    t_swept = time.monotonic()

    foreign, scanned = [], [0.0]

    def port_settled():
        if not port_in_use(ctx.port) and _lc_port_bindable(ctx.port):  # cheap: no pid scan once free
            return True
        if time.monotonic() - scanned[0] < 0.1:  # who holds it: a scan of every process, so not too often
            return False
        scanned[0] = time.monotonic()
        held = listening_pids(ctx.port)
        foreign[:] = [p for p in held if p not in tree]
        return bool(foreign) or (not held and not port_in_use(ctx.port))

    if not _lc_wait_until(port_settled, port_timeout, 0.005):
        raise AgentError("port %d is still in use %gs after the server exited" % (ctx.port, port_timeout))
    if foreign:
        out["warnings"].append("port %d was taken by a process dynctl does not manage: pid %d (%s)"
                               % (ctx.port, foreign[0], " ".join(cmdline(foreign[0]))[:120]))
    t_port = time.monotonic()
    out["timings"]["exit_to_port_free_s"] = round(t_port - t_exit, 4)
    out["timings"]["sweep_s"] = round(t_swept - t_exit, 4)
    journal(ctx, "stop.port_free", port=ctx.port, after_exit_s=out["timings"]["exit_to_port_free_s"],
            swept=[d["pid"] for d in out["swept"]])
    out["gpu"] = _lc_wait_gpu_released(ctx, smi, gpu_before, tree, gpu_timeout, t_exit, out)
    rec = _lc_pidfile(ctx)
    if rec and not rec.get("stopped") and (server is None or server["source"] != "operator"):
        rec["stopped"] = now_iso()
        _lc_write_pidfile(ctx, rec)
    out["timings"]["total_s"] = round(time.monotonic() - t0, 4)
    journal(ctx, "stop.done", **out["timings"])
    return out


def _lc_wait_gpu_released(ctx, smi, before, tree, timeout, t_exit, out):
    if not smi:
        return {"checked": False, "why": "nvidia-smi not found in the server's PATH"}
    if before is None:
        out["warnings"].append("nvidia-smi at %s did not answer; GPU release not verified" % smi)
        return {"checked": False, "why": "nvidia-smi failed", "nvidia_smi": smi}
    held_before = sorted(p for p in before if p in tree)
    if before and not held_before and not any(_lc_stat(p) for p in before):
        out["warnings"].append("nvidia-smi lists pids not visible here (%s): in a container it may show host "
                               "pids; GPU release not verified" % ", ".join(map(str, sorted(before))))
    still = held_before
    deadline = time.monotonic() + timeout
    while True:
        now = gpu_compute_pids(smi, server_env(ctx))
        still = sorted(p for p in (now or {}) if p in tree) if now is not None else still
        if now is not None and not still:
            break
        if time.monotonic() >= deadline:
            raise AgentError("GPU memory is still held by pid(s) %s of the old server %gs after it exited"
                             % (", ".join(map(str, still)), timeout))
        time.sleep(0.05)  # one query takes ~20 ms on an H200
    elapsed = round(time.monotonic() - t_exit, 4)
    out["timings"]["exit_to_gpu_released_s"] = elapsed
    journal(ctx, "stop.gpu_released", held_before=held_before, after_exit_s=elapsed)
    return {"checked": True, "nvidia_smi": smi, "held_before": held_before, "released_after_exit_s": elapsed}


# -- start


def _lc_rotate_log(path):
    with contextlib.suppress(OSError):
        if os.path.getsize(path) > _LC_LOG_ROTATE:
            os.replace(path, path + ".1")


def start_server(ctx, argv, env=None, release=None):
    """Start argv detached in its own session, log to workdir/server.log, write the pidfile; don't wait."""
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise AgentError("start needs argv as a non-empty list of strings, got %r" % (argv,), "usage")
    env = env or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise AgentError("start needs env as a table of strings, got %r" % (env,), "usage")
    port = _lc_argv_port(argv)
    if port is not None and port != str(ctx.port):
        raise AgentError("argv says --port %s but this host's port is %d" % (port, ctx.port), "usage")
    loc = locate_server(ctx)
    server = loc["server"]
    if server is not None:
        if _lc_argv_matches(server["argv"], argv):
            return {"already_running": True, "pid": server["pid"], "argv": server["argv"], "source": server["source"]}
        raise AgentError("a server is already running on port %d (pid %d, found by %s: %s); stop it first"
                         % (ctx.port, server["pid"], server["source"], " ".join(server["argv"])[:200]), "preflight")
    _lc_preflight(ctx, loc, "start")
    if loc["leftovers"]:
        raise AgentError("processes of the previous server are still alive (pids %s); run `dynctl stop` first"
                         % ", ".join(map(str, sorted(loc["leftovers"]))), "preflight")
    ctx.ensure_workdir()
    log_path = ctx.path(SERVER_LOG)
    _lc_rotate_log(log_path)
    marker = uuid.uuid4().hex
    full_env = server_env(ctx)
    full_env.update({k: os.path.expandvars(v) for k, v in env.items()})
    full_env[SERVER_MARKER_ENV] = marker
    home = os.path.expanduser("~")
    cwd = home if os.path.isdir(home) else ctx.workdir  # relative paths in args resolve as in a login shell
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as log:
        log.write(("==== dynctl start %s by %s release=%s argv=%s\n"
                   % (now_iso(), ctx.who, release, json.dumps(argv))).encode())
        log.flush()
        offset = log.tell()
        try:
            # own session: not tied to the SSH channel, killable as a whole; stdin closed so
            # nothing waits on us, stdout/stderr to the log so sshd sees EOF at once
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=full_env, cwd=cwd, start_new_session=True,
                                    close_fds=True)
        except OSError as err:
            journal(ctx, "start.failed", argv=argv, error=str(err))
            raise AgentError("cannot start %s on %s: %s" % (argv[0], ctx.name, err.strerror or err), "preflight")
    st = _lc_stat(proc.pid) or {}
    record = {"pid": proc.pid, "pid_start": st.get("start"), "pgid": st.get("pgid"), "sid": st.get("sid"),
              "argv": argv, "port": ctx.port, "started": now_iso(), "release": release, "marker": marker,
              "log": log_path, "log_offset": offset, "env": env, "who": ctx.who}
    _lc_write_pidfile(ctx, record)
    ctx.changed = True
    journal(ctx, "start.spawned", pid=proc.pid, argv=argv, release=release, env_keys=sorted(env))
    return dict(record, already_running=False)


# -- readiness


def _lc_log_tail(path, lines, since=0):
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


def _lc_check_ready(host, port, generate, token_ids=False):
    """One readiness probe: /health_generate 200, then a real /generate that returns tokens.

    A server without a tokenizer (--skip-tokenizer-init) takes token ids, not text.
    """
    try:
        status, _ = _lc_http(host, port, "GET", "/health_generate", timeout=25.0)
        if status != 200:
            return {"ready": False, "detail": "/health_generate answered %d" % status}
        if not generate:
            return {"ready": True}
        prompt = {"input_ids": [1, 2, 3, 4]} if token_ids else {"text": "Hello"}
        body = dict(prompt, sampling_params={"max_new_tokens": 4, "temperature": 0})
        status, raw = _lc_http(host, port, "POST", "/generate", body=body, timeout=120.0)
    except (OSError, http.client.HTTPException) as err:
        return {"ready": False, "detail": "%s" % (getattr(err, "strerror", None) or err.__class__.__name__)}
    if status != 200:
        return {"ready": False, "detail": "/generate answered %d" % status}
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


class _LcProbe(threading.Thread):
    """Readiness probe off the main loop, so a slow /health_generate never delays crash detection."""

    def __init__(self, host, port, generate, token_ids):
        super().__init__(daemon=True)
        self.args_ = (host, port, generate, token_ids)
        self.result = None

    def run(self):
        self.result = _lc_check_ready(*self.args_)


# How long a process that logged a Traceback during start has to exit for it to count as a crash.
TRACEBACK_EXIT_S = 2.0


def wait_ready(ctx, ready_timeout=900.0, generate=True, poll=0.1):
    """Yield progress until the server answers; the last item is {"event": "ready"} or {"event": "failed"}."""
    rec = _lc_pidfile(ctx)
    if not rec or not rec.get("pid") or rec.get("stopped"):
        why = "the last server was stopped at %s" % rec["stopped"] if rec and rec.get("stopped") else "no pidfile"
        yield {"event": "failed", "reason": "not started", "message": "no server is starting in %s (%s)"
               % (ctx.workdir, why), "log_tail": []}
        return
    pid, start, log_path = int(rec["pid"]), rec.get("pid_start"), rec.get("log") or ctx.path(SERVER_LOG)
    host = _lc_probe_host(rec.get("argv"))
    token_ids = "--skip-tokenizer-init" in (rec.get("argv") or [])
    offset, partial, probe, last_yield = int(rec.get("log_offset") or 0), b"", None, time.monotonic()
    if rec.get("ready_at"):  # it was ready once: tracebacks logged while serving are not a failed start
        with contextlib.suppress(OSError):
            offset = os.path.getsize(log_path)
    t0 = time.monotonic()
    last_detail, next_probe = "not probed yet", t0
    journal(ctx, "ready.wait", pid=pid, timeout=ready_timeout)

    def failed(reason, message, **extra):
        tail = _lc_log_tail(log_path, 40, since=int(rec.get("log_offset") or 0))
        journal(ctx, "ready.failed", pid=pid, reason=reason, message=message)
        item = {"event": "failed", "reason": reason, "message": message, "log_tail": tail, "pid": pid,
                "elapsed": round(time.monotonic() - t0, 3), "alive": _lc_same(pid, start)}
        item.update(extra)
        return item

    while True:
        lines, traceback = [], False
        try:
            with open(log_path, "rb") as f:
                f.seek(offset)
                chunk = f.read(1 << 20)
        except OSError:
            chunk = b""
        if chunk:
            offset += len(chunk)
            data = partial + chunk
            parts = data.split(b"\n")
            partial = parts.pop()
            lines = [p.decode("utf-8", "replace") for p in parts]
            # sglang logs it behind a prefix: "[... TP0] Scheduler hit an exception: Traceback (most ..."
            traceback = any("Traceback (most recent call last)" in ln for ln in lines)
        if lines:
            last_yield = time.monotonic()
            yield {"event": "log", "lines": lines}
        status = _lc_reap(pid)
        if status is not None or not _lc_same(pid, start):
            code = "" if status is None else " with code %d" % status
            yield failed("crash", "the server (pid %d) exited%s during start" % (pid, code), exit_code=status)
            return
        if traceback:
            # A crash logs its traceback and exits (sglang's children take the whole tree down), so
            # a Traceback counts as a failed start only when the process is gone within the crash
            # window; sglang also logs tracebacks for optional features it skips (a missing
            # openai_harmony, say) and then serves normally.
            if _lc_wait_until(lambda: not _lc_same(pid, start), TRACEBACK_EXIT_S, 0.05):
                status = _lc_reap(pid)
                code = "" if status is None else " with code %d" % status
                yield failed("traceback", "the server (pid %d) logged a Traceback and exited%s during start"
                             % (pid, code), exit_code=status)
                return
            yield {"event": "warning", "text": "the server log shows a Traceback during start, but the server "
                                               "(pid %d) is still running; waiting for it to be ready" % pid}
        if probe is not None and not probe.is_alive():
            result, probe = probe.result or {}, None
            if result.get("ready"):
                elapsed = round(time.monotonic() - t0, 3)
                journal(ctx, "ready.ok", pid=pid, elapsed=elapsed)
                _lc_mark_pidfile(ctx, {"pid": pid}, ready_at=now_iso())
                yield {"event": "ready", "pid": pid, "elapsed": elapsed, "generate": result.get("generate")}
                return
            # probe often while a start is young (a fast server's readiness is seen at once), then back off
            last_detail = result.get("detail") or "not ready"
            next_probe = time.monotonic() + (0.1 if time.monotonic() - t0 < 10 else 1.0)
        if probe is None and time.monotonic() >= next_probe:
            probe = _LcProbe(host, ctx.port, generate, token_ids)
            probe.start()
        elapsed = time.monotonic() - t0
        if elapsed >= ready_timeout:
            yield failed("timeout", "the server (pid %d) was not ready within %gs (last probe: %s)"
                         % (pid, ready_timeout, last_detail))
            return
        if time.monotonic() - last_yield >= 5.0:
            last_yield = time.monotonic()
            yield {"event": "waiting", "elapsed": round(elapsed, 1), "detail": last_detail}
        time.sleep(poll)


# -- logs


def follow_server_log(ctx, lines=20, max_seconds=None, poll=0.25):
    """Yield {"lines": [...]} as the log grows (handles rotation), with a heartbeat so a gone client ends us."""
    path = ctx.path(SERVER_LOG)
    yield {"lines": _lc_log_tail(path, lines)}
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


# -- verbs


def _lc_no_extra(name, extra):
    if extra:
        raise AgentError("%s: unknown parameter(s) %s" % (name, ", ".join(sorted(extra))), "usage")


@verb("server_find")
def verb_server_find(ctx, **extra):
    _lc_no_extra("server_find", extra)
    return find_server(ctx)


@verb("server_stop")
def verb_server_stop(ctx, grace=60, port_timeout=30, gpu_timeout=60, pid=None, pid_start=None, **extra):
    _lc_no_extra("server_stop", extra)
    with host_lock(ctx, "stop"), hangup_shield():
        return stop_server(ctx, float(grace), float(port_timeout), float(gpu_timeout), pid, pid_start)


def _lc_resolve_launch(ctx, argv, release, baseline_argv):
    """(argv, release, how) of a start: the caller's argv, else the one recorded with the release in force
    (what deploy started, so a start after a stop keeps the threshold), else the configured one."""
    if argv is not None:
        return argv, release, "the given launch argv"
    in_force = _dp_launch_in_force(ctx)
    if in_force is not None and in_force["argv"]:
        return in_force["argv"], in_force["release"], "the launch argv of release %s" % in_force["release"]
    if baseline_argv:
        why = ("release %s records none" % in_force["release"]) if in_force else "no release in force"
        return list(baseline_argv), None, "the configured launch argv (%s)" % why
    return None, release, None


@verb("server_start")
def verb_server_start(ctx, argv=None, env=None, release=None, baseline_argv=None, **extra):
    _lc_no_extra("server_start", extra)
    with host_lock(ctx, "start"), hangup_shield():
        argv, release, how = _lc_resolve_launch(ctx, argv, release, baseline_argv)
        if argv is None:
            raise AgentError("start: no argv given, no release in force and no configured launch", "usage")
        result = start_server(ctx, argv, env, release)
        result["launch"] = how
        return result


def _lc_raise_failed(items):
    """Stream items as the client expects them (ok: true each); a failure ends the stream as an error."""
    for item in items:
        if item.get("event") == "failed":
            extra = {k: v for k, v in item.items() if k not in ("message", "event")}
            raise AgentError(item["message"], "failed", **extra)
        item.setdefault("ok", True)
        yield item


@verb("server_wait_ready", stream=True)
def verb_server_wait_ready(ctx, ready_timeout=900, generate=True, **extra):
    _lc_no_extra("server_wait_ready", extra)
    return _lc_raise_failed(wait_ready(ctx, float(ready_timeout), bool(generate)))


@verb("server_restart", stream=True)
def verb_server_restart(ctx, argv=None, env=None, release=None, grace=60, ready_timeout=900, baseline_argv=None,
                        **extra):
    """stop → start → wait_ready in one agent process, so a dropped connection cannot leave it between."""
    _lc_no_extra("server_restart", extra)
    with host_lock(ctx, "restart"):
        with hangup_shield():
            rec = _lc_pidfile(ctx) or {}
            argv, release, how = _lc_resolve_launch(ctx, argv, release, baseline_argv)
            if argv is None:  # the last start, as recorded (the pidfile is 0600: env values may be secret)
                argv, how = rec.get("argv"), "the launch argv of the last start"
                release = rec.get("release") if release is None else release
                if not argv:
                    raise AgentError("restart: no argv given and no previous start recorded in %s" % ctx.workdir,
                                     "usage")
            if env is None and rec.get("argv") == argv:
                env = rec.get("env")
            _lc_preflight(ctx, locate_server(ctx), "restart")
            stopped = stop_server(ctx, float(grace))
            try:
                started = start_server(ctx, argv, env, release)
            except AgentError as err:
                if not ctx.changed:
                    raise
                raise AgentError("restart: %s, but the new server was not started: %s"
                                 % (_lc_stop_summary(stopped), err), "failed", **err.extra)
            started["launch"] = how
        yield {"ok": True, "event": "stopped", "result": stopped}
        yield {"ok": True, "event": "started", "result": started}
        for item in _lc_raise_failed(wait_ready(ctx, float(ready_timeout))):
            yield item


@verb("server_logs")
def verb_server_logs(ctx, lines=200, **extra):
    _lc_no_extra("server_logs", extra)
    path = ctx.path(SERVER_LOG)
    return {"path": path, "exists": os.path.isfile(path), "lines": _lc_log_tail(path, int(lines))}


@verb("server_logs_follow", stream=True)
def verb_server_logs_follow(ctx, lines=20, max_seconds=None, **extra):
    _lc_no_extra("server_logs_follow", extra)
    return _lc_raise_failed(follow_server_log(ctx, int(lines), None if max_seconds is None else float(max_seconds)))


# ---- patch (issue 3)
#
# Files of the speculation patch are changed as one transaction on the host, and every change is a
# release that can be reverted byte for byte.
#
#   workdir/current                          id of the release in force (absent: none)
#   workdir/releases/<id>/manifest.json      {id, seq, created, who, sglang_version, strategy, threshold,
#                                             launch_argv, package_dir, files: [{path, sha256_before,
#                                             sha256_after}], artifacts, import_check, state}
#   workdir/releases/<id>/orig/<relpath>     original bytes of each file the release changed (none for
#                                             files it created: sha256_before is null)
#   workdir/releases/<id>/<artifact>         files the client asked to keep with the release (the native
#                                             strategy's adaptive config JSON); "{release_dir}" in
#                                             launch_argv is replaced by this directory
#
# <id> is "<seq:04d>-<UTC time>"; seq grows by one per release. state is "applying" (backups complete,
# swap under way, or interrupted), "applied", or "reverted". A release may change no file at all (native
# strategy, or a new threshold on an already patched tree): it still records threshold and launch_argv.
# `current` is the newest release whose state is "applied". Releases stack: only the one in force can be
# reverted, so rollback = revert_release(current) + restart with the launch_argv of the new `current`.
#
# apply_release() and revert_release() take no lock themselves: the patch_* verbs wrap them in host_lock,
# and an operation worker that already holds the lock (issue 5) calls them directly.


PATCH_FLAG = "--speculative-disable-batch-threshold"
_PT_ID = re.compile(r"^(\d{4,})-\d{8}T\d{6}Z$")
_PT_ARTIFACT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

# py_compile each candidate (the server's interpreter decides what compiles); results name the target
_PT_COMPILE = r"""
import json, os, py_compile, sys, tempfile
out = []
for cand, target in json.loads(sys.argv[1]):
    fd, cfile = tempfile.mkstemp(suffix=".pyc")
    os.close(fd)
    try:
        # the candidate's own name: CPython re-reads the error's source line from that file
        py_compile.compile(cand, cfile=cfile, doraise=True)
        out.append({"target": target, "ok": True})
    except py_compile.PyCompileError as e:
        v = e.exc_value
        out.append({"target": target, "ok": False, "type": e.exc_type_name,
                    "msg": getattr(v, "msg", None) or str(v), "lineno": getattr(v, "lineno", None),
                    "line": ((getattr(v, "text", None) or "").strip().splitlines() or [""])[0][:160]})
    finally:
        os.unlink(cfile)
print(json.dumps(out))
"""


def _pt_target(package_dir, rel):
    """Absolute path of `rel` inside the sglang package; refuses paths that leave it."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/"):
        raise AgentError("bad file path %r: expected a path relative to the sglang package" % (rel,), "usage")
    return os.path.join(package_dir, *rel.split("/"))


def _pt_symlink_on_path(package_dir, rel):
    """The first symlink among the target and its directories below the package dir, else None."""
    path = package_dir
    for part in rel.split("/"):
        path = os.path.join(path, part)
        if os.path.islink(path):
            return path
    return None


def _pt_write_bytes(path, data, mode=0o644, exclusive=True):
    """Write `data` to a new file (exclusive) or over one; a write that fails (a full disk) removes a file it
    created, so no partial copy is left behind."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError:
        if exclusive:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    finally:
        os.close(fd)


def interrupted_release_message(release):
    return ("release %s was interrupted mid-switch: `dynctl rollback` reverts it and restarts what ran before it "
            "(`dynctl patch revert --release %s` reverts the files alone); nothing was changed" % (release, release))


def _pt_journal(ctx, event, **fields):
    """Journal a step; a full disk must not stop a transaction half way (the manifest is the record)."""
    with contextlib.suppress(OSError, AgentError):
        journal(ctx, event, **fields)


def _pt_releases_dir(ctx):
    return ctx.path("releases")


def _pt_manifests(ctx):
    """All release manifests, newest first."""
    root = _pt_releases_dir(ctx)
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        if _PT_ID.match(name):
            manifest = _read_json(os.path.join(root, name, "manifest.json"))
            if manifest:
                found.append(manifest)
    return sorted(found, key=lambda m: m.get("seq", 0), reverse=True)


def _pt_prune(ctx):
    """Keep the newest ctx.keep releases. Older ones go only when reverted: a release in force (rollback needs
    its backups), an interrupted one, and the one the server was started from (its argv may name a file in it)
    always stay. Directories a killed apply left without a manifest never held a swap and go too."""
    root = _pt_releases_dir(ctx)
    manifests = _pt_manifests(ctx)  # newest first
    protected = {_pt_current(ctx), (_lc_pidfile(ctx) or {}).get("release")}
    doomed = [m["id"] for m in manifests[ctx.keep:] if m.get("state") == "reverted" and m["id"] not in protected]
    with contextlib.suppress(OSError):
        listed = {m["id"] for m in manifests}
        doomed += [n for n in os.listdir(root) if _PT_ID.match(n) and n not in listed
                   and not os.path.exists(os.path.join(root, n, "manifest.json"))]
    for release in doomed:
        shutil.rmtree(os.path.join(root, release), ignore_errors=True)
    if doomed:
        _pt_journal(ctx, "releases.pruned", releases=doomed, keep=ctx.keep)
    return doomed


def _pt_next_id(ctx):
    seqs = [int(m.group(1)) for m in (_PT_ID.match(n) for n in os.listdir(_pt_releases_dir(ctx))) if m]
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    seq = max(seqs, default=0) + 1
    return seq, "%04d-%s" % (seq, stamp)


def _pt_update_current(ctx):
    """Point `current` at the newest applied release (or remove it); return that id."""
    applied = [m for m in _pt_manifests(ctx) if m.get("state") == "applied"]
    path = ctx.path("current")
    if applied:
        tmp = "%s.tmp.%d" % (path, os.getpid())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a leftover of a killed writer with our pid
        _pt_write_bytes(tmp, (applied[0]["id"] + "\n").encode(), 0o600)
        os.replace(tmp, path)
        return applied[0]["id"]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return None


def _pt_current(ctx):
    try:
        with open(ctx.path("current")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _pt_sha(path):
    return sha256_file(path) if os.path.isfile(path) else None


def _pt_record_hashes(package_dir, files):
    """sha256 (hex) of `files` as listed in the installed wheel's RECORD, when there is one."""
    import base64
    import csv

    parent = os.path.dirname(package_dir)
    want = {"sglang/" + rel: rel for rel in files}
    out = {}
    for name in os.listdir(parent):
        if not (name.startswith("sglang-") and name.endswith(".dist-info")):
            continue
        try:
            with open(os.path.join(parent, name, "RECORD"), newline="") as f:
                for row in csv.reader(f):
                    if len(row) >= 2 and row[0] in want and row[1].startswith("sha256="):
                        digest = base64.urlsafe_b64decode(row[1][7:] + "=" * (-len(row[1][7:]) % 4))
                        out[want[row[0]]] = digest.hex()
        except (OSError, ValueError):
            continue
    return out


def _pt_sglang(ctx):
    found = find_sglang(ctx)
    if not found.get("sglang"):
        raise AgentError("sglang is not importable by %s" % (found.get("python") or ctx.python), "preflight")
    return found


def _pt_drop_pycache(target):
    """Remove the compiled copies of `target`, so no stale bytecode outlives a swap."""
    cache = os.path.join(os.path.dirname(target), "__pycache__")
    stem = os.path.splitext(os.path.basename(target))[0] + "."
    dropped = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(cache):
            if name.startswith(stem) and name.endswith(".pyc") and name.count(".") >= 2:
                os.unlink(os.path.join(cache, name))
                dropped.append(name)
    return dropped


@verb("patch_read")
def patch_read(ctx, files=(), **_):
    """The sglang found on the host, the text and sha256 of `files`, RECORD hashes, and the releases."""
    found = _pt_sglang(ctx)
    package_dir = found["sglang"]["package_dir"]
    out = {}
    for rel in files:
        path = _pt_target(package_dir, rel)
        link = _pt_symlink_on_path(package_dir, rel)
        if not os.path.isfile(path):
            out[rel] = None if link is None else {"text": None, "sha256": None, "symlink": link}
            continue
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise AgentError("%s is not UTF-8 (byte %d)" % (path, err.start), "preflight")
        out[rel] = {"text": text, "sha256": hashlib.sha256(data).hexdigest(), "symlink": link}
    manifests = _pt_manifests(ctx)
    current = _pt_current(ctx)
    return {
        "python": found["python"],
        "python_version": found["python_version"],
        "sglang": found["sglang"],
        "files": out,
        "record": _pt_record_hashes(package_dir, files),
        "current": current,
        "release": next((m for m in manifests if m["id"] == current), None),
        "incomplete": [m["id"] for m in manifests if m.get("state") == "applying"],
    }


def _pt_import_check(ctx, swapped, timeout):
    """Run `python -m sglang.launch_server --help` and require the flag.

    Returns {"ran": bool, "ok": bool, "detail": str}; ran=False when sglang's dependencies are not
    importable here (a host without torch, say), which says nothing about the patch.
    """
    try:
        proc = subprocess.run([ctx.python, "-m", "sglang.launch_server", "--help"], capture_output=True,
                              text=True, timeout=timeout, env=server_env(ctx), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"ran": False, "ok": False, "detail": "import check could not run: %s" % err}
    if proc.returncode == 0:
        if PATCH_FLAG in proc.stdout:
            return {"ran": True, "ok": True, "detail": "launch_server --help lists %s" % PATCH_FLAG}
        return {"ran": True, "ok": False, "detail": "launch_server --help does not list %s" % PATCH_FLAG}
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else "exit code %d" % proc.returncode
    frames = re.findall(r'^\s*File "([^"]+)", line (\d+)', proc.stderr, re.M)
    # Ours only when it breaks in a file we swapped; a dependency the host lacks (torch, numpy,
    # ...) stops the import before any of our code runs and says nothing about the patch.
    ours = bool(frames) and os.path.realpath(frames[-1][0]) in swapped
    if ours and last.startswith(("ModuleNotFoundError", "ImportError")):
        ours = "'sglang" in last or '"sglang' in last
    if ours:
        return {"ran": True, "ok": False, "detail": "%s line %s: %s" % (frames[-1][0], frames[-1][1], last)}
    return {"ran": False, "ok": False, "detail": "import check could not run: %s" % last}


def _pt_stage_original(release_dir, entry, package_dir):
    """Write the original of one file beside its target (mode and owner as recorded); return that temp path,
    or None for a file the release created. A write that fails leaves nothing behind."""
    if entry["sha256_before"] is None:
        return None
    target = _pt_target(package_dir, entry["path"])
    backup = os.path.join(release_dir, "orig", *entry["path"].split("/"))
    with open(backup, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != entry["sha256_before"]:
        raise AgentError("backup %s does not match its recorded sha256; %s left as is" % (backup, target), "failed")
    tmp = os.path.join(os.path.dirname(target), ".%s.dynctl-restore.%d" % (os.path.basename(target), os.getpid()))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of a killed restore with our pid
    _pt_write_bytes(tmp, data, entry.get("mode") or 0o644)
    try:
        os.chmod(tmp, entry.get("mode") or 0o644)  # not narrowed by the umask
        if entry.get("uid") is not None and os.geteuid() == 0:
            os.chown(tmp, entry["uid"], entry["gid"])
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def _pt_stage_originals(release_dir, entries, package_dir):
    """Every original written beside its target before the first is put back, so a full disk or a read-only
    folder stops the restore with nothing restored, never half way. Returns [(entry, temp path or None)]."""
    staged = []
    try:
        for entry in entries:
            staged.append((entry, _pt_stage_original(release_dir, entry, package_dir)))
    except BaseException:
        _pt_discard_staged(staged)
        raise
    return staged


def _pt_discard_staged(staged):
    for _, tmp in staged:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _pt_put_back(entry, tmp, package_dir):
    """Rename a staged original over its target (or remove a file the release created); check its sha256."""
    target = _pt_target(package_dir, entry["path"])
    if tmp is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
    else:
        os.replace(tmp, target)
        if sha256_file(target) != entry["sha256_before"]:
            raise AgentError("%s does not match its original sha256 after restore" % target, "failed")
    _pt_drop_pycache(target)


def apply_release(ctx, files, sglang_version, strategy="patch", threshold=None, launch_argv=None,
                  artifacts=None, import_check_timeout=300.0):
    """Swap in new file texts as one transaction and record a release (caller holds the host lock).

    files: [{path, sha256_before, sha256_after, text}] (paths relative to the sglang package).
    Order: preflight → candidates written next to targets → py_compile with the host's python →
    originals backed up → manifest (state applying) → os.replace each → stale __pycache__ dropped →
    import check → manifest (state applied) and `current`. A failure before the swap changes nothing
    and leaves no release directory; a failure after it restores every original first.
    """
    found = _pt_sglang(ctx)
    package_dir = found["sglang"]["package_dir"]
    if found["sglang"]["version"] != sglang_version:
        raise AgentError("sglang here is %s, but the plan was made for %s; plan again"
                         % (found["sglang"]["version"], sglang_version), "preflight")
    ctx.ensure_workdir()
    os.makedirs(_pt_releases_dir(ctx), mode=0o700, exist_ok=True)
    incomplete = [m["id"] for m in _pt_manifests(ctx) if m.get("state") == "applying"]
    if incomplete:
        raise AgentError(interrupted_release_message(incomplete[0]), "preflight")
    for name in artifacts or {}:
        if not _PT_ARTIFACT.match(name) or name in ("manifest.json", "orig"):
            raise AgentError("bad release artifact name %r" % (name,), "usage")

    # -- preflight: every target as the plan saw it, none reached through a symlink
    entries = []
    for item in files:
        rel = item["path"]
        target = _pt_target(package_dir, rel)
        link = _pt_symlink_on_path(package_dir, rel)
        if link is not None:
            raise AgentError("%s is a symlink (to %s): refusing to patch through it; nothing was changed"
                             % (link, os.path.realpath(link)), "preflight")
        now = _pt_sha(target)
        if now != item["sha256_before"]:
            raise AgentError("%s changed since it was read (sha256 %s, expected %s); nothing was changed"
                             % (target, now, item["sha256_before"]), "preflight")
        data = item["text"].encode("utf-8")
        if hashlib.sha256(data).hexdigest() != item["sha256_after"]:
            raise AgentError("%s: the new text does not match its sha256_after" % rel, "usage")
        entries.append({"path": rel, "target": target, "data": data, "sha256_before": item["sha256_before"],
                        "sha256_after": item["sha256_after"]})
    _pt_journal(ctx, "patch.apply.begin", sglang_version=sglang_version, strategy=strategy, threshold=threshold,
                files=[e["path"] for e in entries])

    candidates = []

    def drop_candidates():
        for e in candidates:
            with contextlib.suppress(OSError):  # absent, or never created (a read-only folder)
                os.unlink(e["candidate"])

    # -- candidates next to their targets, same mode (and owner, when we may)
    try:
        for e in entries:
            target = e["target"]
            e["candidate"] = os.path.join(os.path.dirname(target),
                                          ".%s.dynctl-new.%d" % (os.path.basename(target), os.getpid()))
            st = os.stat(target) if e["sha256_before"] is not None else None
            e["mode"], e["uid"], e["gid"] = ((stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) if st
                                             else (0o644, None, None))
            candidates.append(e)  # before the write: a half-written candidate (a full disk) is ours to remove
            _pt_write_bytes(e["candidate"], e["data"], e["mode"])
            os.chmod(e["candidate"], e["mode"])  # not narrowed by the umask
            if st is not None and os.geteuid() == 0:
                os.chown(e["candidate"], st.st_uid, st.st_gid)
    except OSError as err:
        drop_candidates()
        _pt_journal(ctx, "patch.apply.refused", step="candidates", error=str(err))
        raise AgentError("cannot write next to %s: %s; nothing was changed" % (e["target"], err.strerror or err),
                         "preflight")
    _pt_journal(ctx, "patch.candidates.written", files=[e["path"] for e in entries])

    # -- compile with the server's interpreter
    if entries:
        rc, out, err = run_python(ctx, _PT_COMPILE, json.dumps([[e["candidate"], e["target"]] for e in entries]),
                                  timeout=120)
        if rc != 0:
            drop_candidates()
            raise AgentError("py_compile with %s failed: %s; nothing was changed" % (ctx.python, err.strip()[-500:]),
                             "preflight")
        bad = [r for r in json.loads(out.strip().splitlines()[-1]) if not r["ok"]]
        if bad:
            drop_candidates()
            first = bad[0]
            _pt_journal(ctx, "patch.apply.refused", step="py_compile", errors=bad)
            raise AgentError("candidate for %s does not compile with %s: line %s: %s: %s%s; nothing was changed"
                             % (first["target"], ctx.python, first["lineno"], first["type"], first["msg"],
                                " (%s)" % first["line"] if first["line"] else ""), "preflight", compile_errors=bad)
        _pt_journal(ctx, "patch.candidates.compiled", files=[e["path"] for e in entries])

    # -- back up the originals into a new release directory, then the manifest
    seq, release_id = _pt_next_id(ctx)
    release_dir = os.path.join(_pt_releases_dir(ctx), release_id)
    manifest = {
        "id": release_id, "seq": seq, "created": now_iso(), "who": ctx.who, "client": ctx.client.get("hostname"),
        "sglang_version": sglang_version, "package_dir": package_dir, "python": ctx.python, "strategy": strategy,
        "threshold": threshold,
        "launch_argv": None if launch_argv is None else [str(a).replace("{release_dir}", release_dir)
                                                          for a in launch_argv],
        "files": [{"path": e["path"], "sha256_before": e["sha256_before"], "sha256_after": e["sha256_after"],
                   "mode": e["mode"], "uid": e["uid"], "gid": e["gid"]} for e in entries],
        "artifacts": sorted(artifacts or {}), "import_check": None, "state": "applying",
    }
    try:
        os.makedirs(release_dir, mode=0o700)
        for e in entries:
            if e["sha256_before"] is None:
                continue
            backup = os.path.join(release_dir, "orig", *e["path"].split("/"))
            os.makedirs(os.path.dirname(backup), mode=0o700, exist_ok=True)
            with open(e["target"], "rb") as f:
                original = f.read()
            if hashlib.sha256(original).hexdigest() != e["sha256_before"]:
                raise AgentError("%s changed during the backup; nothing was changed" % e["target"], "preflight")
            _pt_write_bytes(backup, original, 0o600)
            if sha256_file(backup) != e["sha256_before"]:
                raise AgentError("backup of %s does not read back intact; nothing was changed" % e["target"],
                                 "preflight")
        for name, text in (artifacts or {}).items():
            _pt_write_bytes(os.path.join(release_dir, name), text.encode("utf-8"), 0o600)
        write_json_atomic(os.path.join(release_dir, "manifest.json"), manifest)
    except (OSError, AgentError) as err:
        drop_candidates()
        shutil.rmtree(release_dir, ignore_errors=True)
        _pt_journal(ctx, "patch.apply.failed", step="backup", release=release_id, error=str(err))
        if isinstance(err, AgentError):
            raise
        raise AgentError("cannot back up the originals into %s on %s: %s; nothing was swapped and no release was "
                         "kept: nothing was changed" % (release_dir, ctx.name, err.strerror or err), "preflight")
    _pt_journal(ctx, "patch.backup.done", release=release_id, dir=release_dir)

    # -- swap; from here on a failure puts every original back
    swapped = []

    def roll_back(reason):
        problems = []
        try:
            staged = _pt_stage_originals(release_dir, list(reversed(swapped)), package_dir)
        except (OSError, AgentError) as err:
            staged = []
            problems.append("staging the originals: %s" % (getattr(err, "strerror", None) or err))
        for e, tmp in staged:
            try:
                _pt_put_back(e, tmp, package_dir)
            except (OSError, AgentError) as err:
                problems.append("%s: %s" % (e["target"], err))
                _pt_discard_staged([(e, tmp)])
        drop_candidates()
        if not problems:
            shutil.rmtree(release_dir, ignore_errors=True)
        _pt_journal(ctx, "patch.apply.rolled_back", release=release_id, reason=reason, problems=problems)
        if problems:
            raise AgentError("%s; rolling back FAILED for %s (backups kept in %s)"
                             % (reason, "; ".join(problems), release_dir), "failed")
        ctx.changed = False
        raise AgentError("%s; every original was restored" % reason, "failed")

    dropped = []
    try:
        for e in entries:
            os.replace(e["candidate"], e["target"])
            swapped.append(e)
            candidates.remove(e)
            _pt_journal(ctx, "patch.swap.file", release=release_id, path=e["path"], sha256=e["sha256_after"])
            ctx.changed = True
            dropped += _pt_drop_pycache(e["target"])
    except OSError as err:
        roll_back("swapping %s failed: %s" % (e["target"], err.strerror or err))
    if dropped:
        _pt_journal(ctx, "patch.pycache.dropped", release=release_id, files=dropped)

    check = None
    if entries and strategy == "patch":
        check = _pt_import_check(ctx, {os.path.realpath(e["target"]) for e in swapped}, import_check_timeout)
        _pt_journal(ctx, "patch.import_check", release=release_id, **check)
        if check["ran"] and not check["ok"]:
            roll_back("the patched sglang does not start: %s" % check["detail"])

    manifest["import_check"] = check
    manifest["state"] = "applied"
    manifest["applied"] = now_iso()
    try:
        write_json_atomic(os.path.join(release_dir, "manifest.json"), manifest)
        current = _pt_update_current(ctx)
    except OSError as err:
        roll_back("cannot record release %s: %s" % (release_id, err.strerror or err))
    ctx.changed = True
    _pt_journal(ctx, "patch.apply.done", release=release_id, files=len(entries), current=current)
    with contextlib.suppress(OSError):
        _pt_prune(ctx)
    return {"release": release_id, "release_dir": release_dir, "current": current, "manifest": manifest,
            "import_check": check, "pycache_dropped": dropped}


def revert_release(ctx, release=None):
    """Restore the originals of a release byte for byte (caller holds the host lock).

    release None: the one in force. Idempotent: an already reverted release is reported, not touched.
    Every file is checked before the first is touched, so a refusal changes nothing.
    """
    manifests = _pt_manifests(ctx)
    if release is None:
        release = _pt_current(ctx)
        pending = [m for m in manifests if m.get("state") == "applying"]
        if pending:
            release = pending[0]["id"]
        if release is None:
            raise AgentError("no release is in force: nothing to revert", "preflight")
    manifest = next((m for m in manifests if m["id"] == release), None)
    if manifest is None:
        raise AgentError("no release %s here (known: %s)" % (release,
                         ", ".join(m["id"] for m in manifests) or "none"), "usage")
    if manifest.get("state") == "reverted":
        return {"release": release, "reverted": False, "already": True, "current": _pt_current(ctx), "files": []}
    newer = [m["id"] for m in manifests
             if m.get("seq", 0) > manifest.get("seq", 0) and m.get("state") in ("applied", "applying")]
    if newer:
        raise AgentError("release %s is not the newest in force (%s is); revert that first"
                         % (release, newer[0]), "preflight")
    package_dir = manifest["package_dir"]
    release_dir = os.path.join(_pt_releases_dir(ctx), release)
    todo = []
    for entry in manifest["files"]:
        target = _pt_target(package_dir, entry["path"])
        now = _pt_sha(target)
        if now == entry["sha256_before"]:
            continue  # an interrupted apply never got this far
        if now != entry["sha256_after"]:
            raise AgentError("%s was modified after release %s was applied (sha256 %s); nothing was reverted"
                             % (target, release, now), "preflight")
        if entry["sha256_before"] is not None and not os.path.isfile(
                os.path.join(release_dir, "orig", *entry["path"].split("/"))):
            raise AgentError("release %s has no backup of %s; nothing was reverted" % (release, entry["path"]),
                             "failed")
        todo.append(entry)
    try:
        staged = _pt_stage_originals(release_dir, todo, package_dir)
    except OSError as err:
        folder = os.path.dirname(err.filename) if err.filename else package_dir
        raise AgentError("cannot write in %s: %s; nothing was reverted" % (folder, err.strerror or err), "preflight")
    _pt_journal(ctx, "patch.revert.begin", release=release, files=[e["path"] for e in todo])
    restored = []
    for i, (entry, tmp) in enumerate(staged):
        try:
            _pt_put_back(entry, tmp, package_dir)
        except OSError as err:
            _pt_discard_staged(staged[i:])
            raise AgentError("restoring %s failed: %s (restored so far: %s)"
                             % (entry["path"], err.strerror or err, ", ".join(restored) or "none"), "failed")
        restored.append(entry["path"])
        ctx.changed = True
        _pt_journal(ctx, "patch.revert.file", release=release, path=entry["path"], sha256=entry["sha256_before"])
    for entry in manifest["files"]:  # candidates an interrupted apply left behind
        target = _pt_target(package_dir, entry["path"])
        prefix = ".%s.dynctl-new." % os.path.basename(target)
        with contextlib.suppress(OSError):
            for name in os.listdir(os.path.dirname(target)):
                if name.startswith(prefix):
                    os.unlink(os.path.join(os.path.dirname(target), name))
    manifest["state"] = "reverted"
    manifest["reverted"] = now_iso()
    manifest["reverted_by"] = ctx.who
    write_json_atomic(os.path.join(release_dir, "manifest.json"), manifest)
    current = _pt_update_current(ctx)
    ctx.changed = True
    _pt_journal(ctx, "patch.revert.done", release=release, current=current)
    with contextlib.suppress(OSError):
        _pt_prune(ctx)
    return {"release": release, "reverted": True, "already": False, "current": current, "files": restored}


@verb("patch_apply")
def patch_apply(ctx, files, sglang_version, strategy="patch", threshold=None, launch_argv=None, artifacts=None,
                import_check_timeout=300.0, **_):
    with host_lock(ctx, "patch apply"), hangup_shield():
        return apply_release(ctx, files, sglang_version, strategy, threshold, launch_argv, artifacts,
                             float(import_check_timeout))


@verb("patch_revert")
def patch_revert(ctx, release=None, all=False, **_):
    """Revert the release in force (or `release`); all=True reverts every applied release, newest first."""
    with host_lock(ctx, "patch revert"), hangup_shield():
        if not all:
            return {"reverted": [revert_release(ctx, release)], "current": _pt_current(ctx)}
        done = []
        while True:
            pending = [m for m in _pt_manifests(ctx) if m.get("state") in ("applied", "applying")]
            if not pending:
                break
            done.append(revert_release(ctx, pending[0]["id"]))
        return {"reverted": done, "current": _pt_current(ctx)}


@verb("releases")
def list_releases(ctx, **_):
    """Release manifests, newest first, and the id in force."""
    return {"current": _pt_current(ctx), "releases": _pt_manifests(ctx)}


# ---- deploy (issue 5)
#
# deploy and rollback are operations (see "operations"): one detached worker on the host runs the whole
# critical sequence, so the host ends on the old or the new release whatever happens to the connection.
#
#   deploy:   recover an interrupted release → validate + back up + switch (apply_release: nothing is
#             touched unless every candidate compiles) → stop the old server → start the new argv →
#             health gate → read the threshold back from /server_info. Any failure after the switch:
#             revert the release, start the previous argv, health-gate it, report "rolled back to R".
#   rollback: revert every release newer than the target (default: the one before the release in
#             force; "baseline" = no release) → stop whatever runs → start the target's argv → gate.
#             A second rollback right after the first stays where it is (workdir/state.json says so).

STATE_FILE = "state.json"
BASELINE = "baseline"


def _dp_state(ctx):
    return _read_json(ctx.path(STATE_FILE)) or {}


def _dp_set_state(ctx, **fields):
    state = _dp_state(ctx)
    state.update(fields)
    state["updated"] = now_iso()
    write_json_atomic(ctx.path(STATE_FILE), state)


def server_info(ctx, timeout=5.0):
    """/server_info of the managed server on this host, as a dict (or None when it does not answer)."""
    try:
        info = _bench_server_info("127.0.0.1", ctx.port, timeout)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def threshold_in_force(info):
    """The runtime threshold (internal_states carry runtime updates; top-level keys are the launch copy)."""
    found = _bench_thresholds(info or {})
    return found[0] if found else None


def _dp_gate(ctx, oplog, argv, release, ready_timeout):
    """Start argv and wait until it serves; raise AgentError with the log tail when it does not."""
    with oplog.step("start", " ".join(argv)):
        started = start_server(ctx, argv, release=release)
        oplog.emit("info", text="server pid %s" % started.get("pid"))
    with oplog.step("health", "waiting for /health_generate and one /generate"):
        for item in wait_ready(ctx, ready_timeout=ready_timeout):
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


def _dp_verify(ctx, oplog, strategy, threshold):
    with oplog.step("verify", "reading the threshold back from /server_info"):
        info = server_info(ctx)
        if info is None:
            raise AgentError("/server_info did not answer after the server became ready", "failed")
        if strategy == "native":
            adaptive = bool(info.get("speculative_adaptive"))
            if threshold is not None and threshold < 0:  # never disable: speculation as configured, no config
                if adaptive:
                    raise AgentError("threshold -1 must run without --speculative-adaptive, but it is on", "failed")
                return {"threshold_in_force": threshold}
            if not adaptive:
                raise AgentError("the server runs without --speculative-adaptive", "failed")
            return {"threshold_in_force": threshold, "adaptive_config": info.get("speculative_adaptive_config")}
        value = threshold_in_force(info)
        if value != threshold:
            raise AgentError("the server reports threshold %r, expected %r" % (value, threshold), "failed")
        return {"threshold_in_force": value}


def _dp_recover(ctx, oplog):
    """An interrupted release (worker killed mid-switch) is reverted before anything else happens."""
    recovered = []
    for m in _pt_manifests(ctx):
        if m.get("state") == "applying":
            oplog.warn("release %s was interrupted; reverting it first" % m["id"])
            revert_release(ctx, m["id"])
            recovered.append(m["id"])
    return recovered


def _dp_rollback_target(ctx, to, manifests):
    """`rollback --to` as typed: a release id or a unique prefix (or sequence number) of one in force,
    "baseline", "latest" (the release in force) or "previous" (None: the one before it). Anything else is a
    usage error that names the candidates, raised before anything changes."""
    ids = [m["id"] for m in manifests if m.get("state") == "applied"]
    if to is None or to == "previous":
        return None
    if to == "latest":
        return ids[0] if ids else BASELINE
    text = str(to).strip()
    if text == BASELINE or text in ids:
        return text
    matches = [i for i in ids if i.startswith(text)]
    if not matches and text.isdigit():
        matches = [i for i in ids if int(i.split("-")[0]) == int(text)]
    if len(matches) == 1:
        return matches[0]
    in_force = ", ".join(ids + [BASELINE])
    if matches:
        raise AgentError("release %r is ambiguous on %s: it could be %s; give more of the id; nothing was changed"
                         % (text, ctx.name, ", ".join(matches)), "usage")
    other = [m for m in manifests if m["id"].startswith(text) or m["id"] == text]
    if other:
        raise AgentError("release %s on %s is %s, not in force: rollback returns to one in force (%s); nothing "
                         "was changed" % (other[0]["id"], ctx.name, other[0].get("state"), in_force), "usage")
    raise AgentError("no release %r in force on %s to roll back to (in force: %s; also latest, previous); "
                     "nothing was changed" % (text, ctx.name, in_force), "usage")


def _dp_launch_in_force(ctx):
    """{"release": id, "argv": its recorded launch argv or None} of the release in force, or None."""
    current = _pt_current(ctx)
    if current is None or not _PT_ID.match(current):
        return None
    manifest = _read_json(os.path.join(_pt_releases_dir(ctx), current, "manifest.json")) or {}
    return {"release": current, "argv": manifest.get("launch_argv")}


def _dp_previous_argv(ctx, baseline_argv):
    in_force = _dp_launch_in_force(ctx)
    if in_force is None:
        return None, baseline_argv
    return in_force["release"], in_force["argv"] or baseline_argv


DEFAULT_SOAK_S = 5.0


def _dp_soak(ctx, oplog, seconds, poll=0.05):
    """Keep watching a server that just became ready: dying within `seconds` fails the operation.

    A server that crashes a few seconds after its first good /generate (a scheduler that hits a bad
    kernel on its second batch, say) must not be reported as deployed.
    """
    seconds = float(seconds or 0)
    rec = _lc_pidfile(ctx) or {}
    if seconds <= 0 or not rec.get("pid"):
        return {"soak_s": 0.0}
    pid, start = int(rec["pid"]), rec.get("pid_start")
    log_path, since = rec.get("log") or ctx.path(SERVER_LOG), int(rec.get("log_offset") or 0)
    host = _lc_probe_host(rec.get("argv"))
    with oplog.step("soak", "watching pid %d for %gs after it became ready" % (pid, seconds)):
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            status = _lc_reap(pid)
            if status is not None or not _lc_same(pid, start):
                after = time.monotonic() - t0
                code = "" if status is None else " with code %d" % status
                journal(ctx, "soak.crash", pid=pid, after_s=round(after, 3), exit_code=status)
                raise AgentError("the server (pid %d) exited%s %.1fs after it became ready (soak of %gs)"
                                 % (pid, code, after, seconds), "failed", reason="crash",
                                 log_tail=_lc_log_tail(log_path, 40, since=since))
            time.sleep(poll)
        # alive is not enough: it must still answer (a few tries, so one slow answer under load is no failure)
        health = None
        for _ in range(4):
            health = _lc_health(host, ctx.port)
            if health == 200 or not _lc_same(pid, start):
                break
            time.sleep(0.5)
        if health != 200:
            journal(ctx, "soak.unhealthy", pid=pid, health=health)
            raise AgentError("the server (pid %d) %s at the end of the %gs soak"
                             % (pid, "exited" if not _lc_same(pid, start) else
                                "stopped answering /health (last answer: %s)" % health, seconds),
                             "failed", reason="soak", log_tail=_lc_log_tail(log_path, 40, since=since))
    journal(ctx, "soak.ok", pid=pid, seconds=seconds)
    return {"soak_s": seconds}


@operation("deploy")
def op_deploy(ctx, oplog, files, sglang_version, strategy, threshold, launch_argv, baseline_argv,
              artifacts=None, grace=60, ready_timeout=900, soak=DEFAULT_SOAK_S, **_):
    loc = locate_server(ctx)
    _lc_preflight(ctx, loc, "deploy")
    _dp_recover(ctx, oplog)
    previous, previous_argv = _dp_previous_argv(ctx, baseline_argv)
    running = loc["server"]
    with oplog.step("switch", "validate with %s, back up, swap %d file(s)" % (ctx.python, len(files))):
        applied = apply_release(ctx, files, sglang_version, strategy=strategy, threshold=threshold,
                                launch_argv=launch_argv, artifacts=artifacts)
    release = applied["release"]
    argv = applied["manifest"]["launch_argv"]
    oplog.emit("info", text="release %s in force (files changed: %d)" % (release, len(files)))
    try:
        with oplog.step("stop", "SIGTERM, drain up to %ss, then SIGKILL" % grace):
            stopped = stop_server(ctx, grace=grace)
            oplog.emit("info", text=_lc_stop_summary(stopped))
        ready = _dp_gate(ctx, oplog, argv, release, ready_timeout)
        verified = _dp_verify(ctx, oplog, strategy, threshold)
        verified.update(_dp_soak(ctx, oplog, soak))
    except AgentError as err:
        oplog.warn("deploy failed: %s" % err)
        target = previous or BASELINE
        rolled = _dp_roll_back_after_failure(ctx, oplog, release, previous_argv, running is not None,
                                             grace, ready_timeout, soak)
        raise AgentError("deploy of release %s failed: %s; %s" % (release, err, rolled), "failed",
                         rolled_back_to=target, failed_release=release,
                         log_tail=err.extra.get("log_tail") or [])
    _dp_set_state(ctx, last="deploy", release=release)
    result = {"release": release, "argv": argv, "previous": previous or BASELINE, "pid": ready.get("pid"),
              "ready_seconds": ready.get("elapsed")}
    result.update(verified)
    return result


def _dp_roll_back_after_failure(ctx, oplog, release, previous_argv, was_running, grace, ready_timeout, soak=0):
    with oplog.step("rollback", "restoring the previous release"):
        stopped = stop_server(ctx, grace=min(grace, 30))
        oplog.emit("info", text=_lc_stop_summary(stopped))
        revert_release(ctx, release)
    if not was_running:
        return "rolled back to the previous release (the server was not running before; left stopped)"
    try:
        _dp_gate(ctx, oplog, previous_argv, _pt_current(ctx), ready_timeout)
        _dp_soak(ctx, oplog, min(float(soak or 0), DEFAULT_SOAK_S))  # it served before: a short look will do
    except AgentError as err:
        return "rolled back the files, but the previous server did not come back: %s" % err
    return "rolled back to %s, which is serving again" % (_pt_current(ctx) or BASELINE)


@operation("rollback")
def op_rollback(ctx, oplog, baseline_argv, to=None, grace=60, ready_timeout=900, soak=DEFAULT_SOAK_S, **_):
    chosen = _dp_rollback_target(ctx, to, _pt_manifests(ctx))
    loc = locate_server(ctx)
    _lc_preflight(ctx, loc, "rollback")
    recovered = _dp_recover(ctx, oplog)
    applied = [m for m in _pt_manifests(ctx) if m.get("state") == "applied"]  # newest first
    current = applied[0]["id"] if applied else None
    state = _dp_state(ctx)
    if chosen is not None:
        target = chosen
    elif recovered:  # the interrupted release was the change to undo: back to what ran before it
        target = current or BASELINE
    elif state.get("last") == "rollback" and state.get("target") == (current or BASELINE):
        target = current or BASELINE  # rolling back twice stays on the first rollback's target
        oplog.emit("info", text="already rolled back to %s; making sure it serves" % target)
    else:
        target = applied[1]["id"] if len(applied) > 1 else BASELINE
    newer = [m for m in applied if target == BASELINE or m["seq"] > int(target.split("-")[0])]
    manifest = next((m for m in applied if m["id"] == target), None)
    argv = (manifest or {}).get("launch_argv") or baseline_argv
    healthy = loc["server"] is not None and _lc_health("127.0.0.1", ctx.port) == 200
    if not newer and healthy and _lc_argv_matches(loc["server"]["argv"], argv):
        _dp_set_state(ctx, last="rollback", target=target)
        return {"target": target, "changed": False, "message": "already on %s and serving" % target}
    done = []
    try:
        with oplog.step("stop", "SIGTERM, drain up to %ss, then SIGKILL" % grace):
            stopped = stop_server(ctx, grace=grace)
            oplog.emit("info", text=_lc_stop_summary(stopped))
            if stopped.get("stopped"):
                done.append("stopped the server")
        for m in newer:
            with oplog.step("revert", "release %s" % m["id"]):
                revert_release(ctx, m["id"])
            done.append("reverted %s" % m["id"])
        ready = _dp_gate(ctx, oplog, argv, None if target == BASELINE else target, ready_timeout)
        soaked = _dp_soak(ctx, oplog, soak)
    except AgentError as err:
        if not ctx.changed:
            raise
        # the host did change: say how far the rollback got, and never call it a pre-flight refusal
        raise AgentError("rollback to %s failed: %s%s" % (target, err, " (done before that: %s)" % ", ".join(done)
                                                           if done else ""),
                         "failed", target=target, log_tail=err.extra.get("log_tail") or [],
                         reason=err.extra.get("reason"))
    _dp_set_state(ctx, last="rollback", target=target)
    return {"target": target, "changed": True, "reverted": [m["id"] for m in newer], "argv": argv,
            "pid": ready.get("pid"), "soak_s": soaked.get("soak_s")}


@verb("deploy_context")
def deploy_context(ctx, files=(), **_):
    """Everything a deploy plan needs in one round trip: lock holder, patch files, server info (of our
    server only), and what is in the way that is not ours (the deploy itself will refuse it)."""
    loc = locate_server(ctx)
    not_ours = _lc_not_ours(ctx, loc)
    return {"holder": _lock_holder(ctx), "patch": patch_read(ctx, files=files),
            "info": server_info(ctx) if loc["server"] is not None else None,
            "not_ours": not_ours and not_ours["text"]}


@verb("server_info")
def verb_server_info(ctx, **_):
    return {"info": server_info(ctx), "state": _dp_state(ctx), "current": _pt_current(ctx)}


# ---- main


def _answer(obj):
    obj.setdefault("protocol", PROTOCOL)
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def main():
    try:
        request = json.loads(sys.stdin.read() or "{}")
    except ValueError as err:
        _answer({"ok": False, "kind": "usage", "error": "agent request is not JSON: %s" % err})
        return 2
    if request.get("protocol") != PROTOCOL:
        _answer({"ok": False, "kind": "protocol",
                 "error": "agent speaks protocol %s, client sent %s" % (PROTOCOL, request.get("protocol"))})
        return 2
    name = request.get("verb")
    fn = VERBS.get(name)
    if fn is None:
        _answer({"ok": False, "kind": "usage", "error": "unknown agent verb %r" % name})
        return 2
    host = request.get("host") or {}
    problem = workdir_problem(host.get("workdir") or "~/.dynctl")
    if problem:
        _answer({"ok": False, "kind": "usage", "error": problem, "done": True})
        return 2
    params = request.get("params") or {}
    ctx = None
    try:
        ctx = Context(host, request.get("client") or {})
        if name in STREAM_VERBS:
            for item in fn(ctx, **params):
                _answer(item)
            _answer({"done": True, "ok": True})
        else:
            result = fn(ctx, **params)
            _answer({"ok": True, "changed": ctx.changed, "result": result})
    except AgentError as err:
        kind, message = outcome(ctx, err) if ctx is not None else (err.kind, str(err))
        answer = {"ok": False, "kind": kind, "error": message, "changed": bool(ctx and ctx.changed)}
        answer.update(err.extra)
        if name in STREAM_VERBS:
            answer["done"] = True
        _answer(answer)
        return 1
    except BrokenPipeError:  # the client went away; nothing more to say
        with contextlib.suppress(OSError):  # and nothing for the interpreter's exit flush to fail on
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as err:  # a full disk, a vanished directory: the operator needs the reason, not "rc 1"
        where = " (%s)" % err.filename if err.filename else ""
        _answer({"ok": False, "kind": "failed", "done": True, "changed": bool(ctx and ctx.changed),
                 "error": "%s failed on %s: %s%s" % (name, socket.gethostname() if ctx is None else ctx.name,
                                                     err.strerror or err, where)})
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--op":
        sys.exit(run_operation(sys.argv[2]))
    sys.exit(main())
