"""The agent's protocol: one JSON request on stdin, JSON answers on stdout; the host context and its errors.

Request: {"protocol": 1, "verb": "inspect", "params": {...}, "host": {...}, "client": {...}}
Answer:  {"protocol": 1, "ok": true, "changed": false, "result": {...}}
         {"protocol": 1, "ok": false, "kind": "preflight"|"failed"|"usage"|"busy"|..., "error": "..."}
A streaming verb answers one JSON object per line and ends with a line carrying "done": true.
"""

from __future__ import annotations

import getpass
import math
import os
import socket
import sys

PROTOCOL = 1


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
        self.keep = keep_history(host.get("keep_history"))
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


# The waits a request may ask for, in seconds (the client's --grace, --ready-timeout and --soak have the same
# bounds): a value beyond them, inf or NaN would hold the host lock without end.
LIMITS = {"grace": (0.0, 3600.0), "ready_timeout": (1.0, 7200.0), "soak": (0.0, 3600.0),
          "port_timeout": (0.0, 3600.0), "gpu_timeout": (0.0, 3600.0)}


def seconds(name, value):
    """`value` as seconds for the parameter `name`, refused (usage) unless it is a finite number in LIMITS."""
    low, high = LIMITS[name]
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if isinstance(value, bool) or number is None or not math.isfinite(number) or not low <= number <= high:
        raise AgentError("%s must be a finite number of seconds from %g to %g, got %r; nothing was changed"
                         % (name, low, high, value), "usage")
    return number


KEEP_HISTORY = 20  # finished releases and operation records kept in workdir (the config's keep_history)


def keep_history(value):
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
