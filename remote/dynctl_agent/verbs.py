"""Which module answers which verb, and the loop that reads a request and writes the answers.

Modules are imported when their verb is called, not before: a `ping` loads neither bench nor watch.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import sys
import time

from dynctl.base import hostspec
from dynctl_agent.protocol import PROTOCOL, AgentError, Context, outcome, workdir_problem

# verb: (module, function, streams); every function takes the Context and the request's params
VERBS = {
    "ping": ("verbs", "ping", False),
    "inspect": ("hostinfo", "inspect_host", False),
    "op_start": ("operations", "op_start", False),
    "op_run": ("operations", "op_run", True),
    "op_current": ("operations", "op_current", False),
    "op_follow": ("operations", "op_follow", True),
    "op_detach": ("operations", "op_detach", False),
    "op_list": ("operations", "op_list", False),
    "op_go": ("prepared", "op_go", False),
    "op_cancel": ("prepared", "op_cancel", False),
    "server_find": ("lifecycle", "server_find", False),
    "server_stop": ("lifecycle", "server_stop", False),
    "server_start": ("lifecycle", "server_start", False),
    "server_wait_ready": ("lifecycle", "server_wait_ready", True),
    "server_adopt": ("adoption", "server_adopt", False),
    "server_logs": ("lifecycle", "server_logs", False),
    "server_logs_follow": ("lifecycle", "server_logs_follow", True),
    "patch_read": ("patch", "patch_read", False),
    "patch_apply": ("patch", "patch_apply", False),
    "patch_revert": ("patch", "patch_revert", False),
    "releases": ("releases", "list_releases", False),
    "deploy_context": ("deploy", "deploy_context", False),
    "deploy_stage": ("patch", "stage_release", False),
    "server_info": ("serverinfo", "server_info_verb", False),
    "set_threshold": ("serverinfo", "set_threshold", False),
    "bench_probe": ("bench", "bench_probe", False),
    "bench_level": ("bench", "bench_level", True),
    "watch": ("watch", "watch", True),
}

# operation kind: (module, function); run by the detached worker (see operations)
OPS = {
    "deploy": ("deploy", "op_deploy"),
    "rollback": ("deploy", "op_rollback"),
    "restart": ("lifecycle", "op_restart"),
}


DAMAGED = 96  # the exit status that has the client install this copy of the agent again


def ping(ctx):
    return {"pong": True, "time": time.time()}


def load(entry):
    """The function a VERBS or OPS entry names, its module imported now."""
    return getattr(importlib.import_module("dynctl_agent." + entry[0]), entry[1])


def _parameters(fn):
    """(names, those without a default) of a plain function's parameters, in order, read from its code object
    (what inspect.signature says of a verb or operation, without importing inspect for every call)."""
    code = fn.__code__
    names = list(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
    positional = names[:code.co_argcount]
    with_default = set(positional[len(positional) - len(fn.__defaults__ or ()):]) | set(fn.__kwdefaults__ or {})
    return names, [n for n in names if n not in with_default]


def check_params(what, fn, params, leading=1):
    """Refuse (usage) a request whose parameters `fn` does not declare, or that lacks one it requires; the
    first `leading` parameters are the agent's own (the Context, an operation's log), never the client's."""
    if not isinstance(params, dict):
        raise AgentError("parameters for %s must be a JSON object, got %s" % (what, type(params).__name__), "usage")
    declared, required = _parameters(fn)
    declared, required = declared[leading:], required[leading:]
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise AgentError("unsupported parameters for %s: %s (it takes: %s); nothing was changed"
                         % (what, ", ".join(unknown), ", ".join(declared) or "none"), "usage")
    missing = [name for name in required if name not in params]
    if missing:
        raise AgentError("missing parameters for %s: %s; nothing was changed" % (what, ", ".join(missing)), "usage")


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
    if name not in VERBS:
        _answer({"ok": False, "kind": "usage", "error": "unknown agent verb %r" % name})
        return 2
    host = request.get("host") or {}
    problem = workdir_problem(host.get("workdir") or hostspec.DEFAULT_WORKDIR)
    if problem:
        _answer({"ok": False, "kind": problem[0], "error": problem[1], "changed": False, "done": True})
        return 2 if problem[0] == "usage" else 1
    params = request.get("params") or {}
    ctx = None
    streams = VERBS[name][2]
    try:
        ctx = Context(host, request.get("client") or {})
        untrusted = ctx.untrusted_record()
        if untrusted:
            raise AgentError(untrusted, "preflight")
        try:
            fn = load(VERBS[name])
        except Exception as err:  # a module of this copy that does not load: the client installs it again
            sys.stderr.write("the dynctl agent in %s does not load %s: %s: %s\n"
                             % (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), VERBS[name][0],
                                type(err).__name__, err))
            return DAMAGED
        check_params(name, fn, params)
        if streams:
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
        if streams:
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
