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
import stat
import sys

from dynctl.base import hostspec

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
        self.workdir = os.path.abspath(os.path.expanduser(host.get("workdir") or hostspec.DEFAULT_WORKDIR))
        self.python = host.get("python") or sys.executable
        self.port = _checked("port", host.get("port"), hostspec.DEFAULT_PORT, hostspec.port_problem)
        self.env = dict(host.get("env") or {})
        self.launch = list(host.get("launch") or [])
        self.args = list(host.get("args") or [])
        self.name = host.get("name") or socket.gethostname()
        self.keep = _checked("keep_history", host.get("keep_history"), hostspec.DEFAULT_KEEP_HISTORY,
                             hostspec.keep_history_problem)
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

    def untrusted_record(self):
        """Why a record in workdir could hold another user's words, or None. server.json names what `stop`
        signals, the lock who holds the host, releases/ what a rollback writes back into sglang: each must
        be a file or directory of the effective user alone, as the boot program requires of the workdir."""
        uid = os.geteuid()
        todo = [self.path(name) for name in RECORDS]
        while todo:
            path = todo.pop()
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                why = "%s is a symlink (to %s), which dynctl never writes" % (path, os.readlink(path))
            elif st.st_uid != uid:
                why = "%s is owned by %s, not by %s (mode %04o)" % (path, _who(st.st_uid), _who(uid),
                                                                   stat.S_IMODE(st.st_mode))
            elif st.st_mode & 0o022:
                why = "%s is %s-writable (mode %04o, owner %s)" % (
                    path, "world" if st.st_mode & 0o002 else "group", stat.S_IMODE(st.st_mode), _who(st.st_uid))
            elif stat.S_ISDIR(st.st_mode):
                todo += [os.path.join(path, name) for name in os.listdir(path)]
                continue
            else:
                continue
            return ("refusing workdir %s: %s; another user could change what dynctl trusts there. Check what is "
                    "in it, then make it yours alone (chown -R %s %s && chmod -R go-w %s), or point the host's "
                    "workdir at a directory of your own; nothing was changed"
                    % (self.workdir, why, _name(uid), self.workdir, self.workdir))
        return None


# What the agent keeps in workdir and reads back as its own (agent/ is the boot program's to check).
RECORDS = ("lock", "server.json", "state.json", "current", "journal.jsonl", "journal.jsonl.1", "server.log",
           "server.log.1", "releases", "ops")


def _name(uid):
    from dynctl_agent.procfs import user_name  # the one lookup of a login name (procfs imports nothing of ours)

    return user_name(uid)


def _who(uid):
    name = _name(uid)
    return "uid %d" % uid if name == str(uid) else "%s (uid %d)" % (name, uid)


# The waits a request may ask for, in seconds (the client's --grace, --ready-timeout and --soak have the same
# bounds): a value beyond them, inf or NaN would hold the host lock without end.
LIMITS = {"grace": (0.0, 3600.0), "ready_timeout": (1.0, 7200.0), "soak": (0.0, 3600.0),
          "port_timeout": (0.0, 3600.0), "gpu_timeout": (0.0, 3600.0), "go_within": (0.1, 3600.0)}


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


def _checked(name, value, default, problem_of):
    """A host setting of the request, its default when absent, refused (usage) by the rule the config uses."""
    if value is None:
        return default
    problem = problem_of(value)
    if problem:
        raise AgentError("host %s: %s; nothing was changed" % (name, problem), "usage")
    return value


def workdir_problem(workdir):
    """(kind, why) when `workdir` cannot be used, or None: a relative one would follow whatever directory the
    agent was started in (the login or container home over SSH and pct, the client's cwd locally); ~user/...
    needs that user on this host."""
    if workdir and workdir.startswith("~") and not os.path.isabs(os.path.expanduser(workdir)):
        user = workdir[1:].split("/")[0]
        if user:
            return "preflight", "workdir %r: there is no user %r on this host; nothing was changed" % (workdir, user)
        return "preflight", "workdir %r: the home directory of %s is unknown here; nothing was changed" % (
            workdir, _who(os.geteuid()))
    problem = hostspec.workdir_problem(workdir)
    if problem:
        return "usage", "workdir %s; nothing was changed" % problem
    return None
