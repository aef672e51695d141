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

import contextlib
import datetime as _dt
import getpass
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

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
def host_lock(ctx, operation):
    """One operation per host: workdir/lock names the holder; a dead holder's lock is taken over."""
    ctx.ensure_workdir()
    path = ctx.path("lock")
    me = {
        "operation": operation,
        "who": ctx.who,
        "client_host": ctx.client.get("hostname"),
        "pid": os.getpid(),
        "pid_start": process_start_time(os.getpid()),
        "started": now_iso(),
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
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        break
    else:
        raise AgentError("could not take the host lock %s" % path, "busy")
    try:
        yield me
    finally:
        with contextlib.suppress(FileNotFoundError):
            if (_read_json(path) or {}).get("pid") == os.getpid():
                os.unlink(path)


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
    ctx = Context(request.get("host") or {}, request.get("client") or {})
    params = request.get("params") or {}
    try:
        if name in STREAM_VERBS:
            for item in fn(ctx, **params):
                _answer(item)
            _answer({"done": True, "ok": True})
        else:
            result = fn(ctx, **params)
            _answer({"ok": True, "changed": ctx.changed, "result": result})
    except AgentError as err:
        answer = {"ok": False, "kind": err.kind, "error": str(err), "changed": ctx.changed}
        answer.update(err.extra)
        if name in STREAM_VERBS:
            answer["done"] = True
        _answer(answer)
        return 1
    except BrokenPipeError:  # the client went away; nothing more to say
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
