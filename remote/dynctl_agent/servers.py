"""Who is the server: the one decision (locate) about what runs on our port, ours or not, and its state.

The server is started in its own session with a marker in its environment, so everything it spawns
can be found again -- children that setsid() away, orphans that outlive it -- without ever matching
a process by name. Every kill is of a (pid, start time) pair collected from that server, so a
recycled pid is never signalled. Zombies count as gone.
"""

from __future__ import annotations

import getpass
import os

from dynctl.base import hostspec, sglang
from dynctl_agent import httpclient, launchconfig, lock, procfs, releases, store
from dynctl_agent.protocol import AgentError

PIDFILE = store.PIDFILE
LOG = "server.log"
MARKER_ENV = "DYNCTL_SERVER_ID"


def has_marker(pid, marker):
    """pid carries the marker our start put in the server's environment (so do its children)."""
    return procfs.has_env(pid, MARKER_ENV, marker)


def argv_port(argv):
    return launchconfig.flag_value(argv, "--port")


def argv_matches(cmd, argv):
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


def _runs_module(cmd, module):
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


def _launches(cmd, launch):
    """cmd runs the configured `launch` (its words in order, the program by path or name), directly or behind
    the interpreter of a shebang: `.../sglang serve` matches `python3 .../sglang serve`, never `vllm serve`."""
    n = len(launch)
    for at in (0, 1):
        head = cmd[at:at + n]
        if len(head) == n and head[1:] == list(launch[1:]) and _same_program(head[0], launch[0]):
            return at == 0 or _is_interpreter(cmd[0])
    return False


def _same_program(word, program):
    return word == program or ("/" not in program and os.path.basename(word) == program) or (
        "/" not in word and os.path.basename(program) == word)


def _is_interpreter(word):
    name = os.path.basename(word)
    return name.startswith(("python", "pypy")) or name in ("sh", "bash", "dash", "env")


def _console_script(ctx):
    """The `sglang` console script of the configured interpreter's environment (its bin/ folder)."""
    python = getattr(ctx, "python", None) or "python3"
    if "/" not in python:
        import shutil

        python = shutil.which(python) or python
    return os.path.join(os.path.dirname(python), "sglang") if "/" in python else None


def runs_sglang_serve(ctx, cmd):
    """cmd is `sglang serve ...` by the console script of the configured interpreter's environment."""
    script = _console_script(ctx)
    return script is not None and _launches(cmd, [script, "serve"])


def looks_like_server(ctx, cmd, pid=None):
    """cmd runs sglang's launcher (`python -m sglang.launch_server` or `sglang serve`), or the configured launch
    command, on ctx.port (from its argv, else the `--config` YAML it names, else sglang's default)."""
    if not cmd:
        return False
    launch = list(ctx.launch or [])
    runs = _runs_module(cmd, sglang.LAUNCH_MODULE) or runs_sglang_serve(ctx, cmd)
    if not runs and len(launch) >= 3 and launch[-2] == "-m":
        runs = _runs_module(cmd, launch[-1])
    elif not runs and launch:
        runs = _launches(cmd, launch)
    if not runs:
        return False
    return str(ctx.port) == str(launchconfig.server_port(cmd, _cwd(pid)))


def _serve_hint(cmd):
    """For an `sglang serve` of another environment than the configured interpreter's: how to name it."""
    for at in (0, 1):
        if len(cmd) > at + 1 and os.path.basename(cmd[at]) == "sglang" and cmd[at + 1] == "serve" and "/" in cmd[at]:
            bindir = os.path.dirname(cmd[at])
            return ("it runs `sglang serve` of %s: if it is your server, set python = \"%s/python3\" for this "
                    "host (or launch = [\"%s/sglang\", \"serve\"]), so dynctl knows it as an sglang server"
                    % (bindir, bindir, bindir))
    return None


def _cwd(pid):
    if pid is None:
        return None
    try:
        return procfs.cwd(pid)
    except OSError:
        return None


def tree_of(table, pid, start, leads_session, marker):
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
        if ((leads_session and st["sid"] == pid) or (marker and has_marker(p, marker))) and procfs.owned_by_us(p):
            tree[p] = st["start"]
    return tree


read_pidfile = store.read_pidfile


def api_keys(ctx):
    """The API keys our server was started with (its recorded argv), for the requests that need them."""
    return sglang.api_keys((read_pidfile(ctx) or {}).get("argv"))


def write_pidfile(ctx, record):
    ctx.ensure_workdir()
    store.write_json_atomic(ctx.path(PIDFILE), record)


# What only the live process can tell: absent from the record a start writes before it spawns.
_SPAWNED_FIELDS = ("pid", "pid_start", "pgid", "sid")


def spawn_record(record):
    """The pidfile a start writes before it spawns `record`'s server: everything but the pid (and what comes with
    it), marked "spawning". An agent that dies between the spawn and the full record leaves this behind, and
    the marker in it finds the server again (locate), so the server stays ours."""
    ahead = {k: v for k, v in record.items() if k not in _SPAWNED_FIELDS}
    ahead["spawning"] = record.get("started") or store.now_iso()
    return ahead


def _complete_spawn(ctx, table, rec):
    """A "spawning" record: the server its start spawned, found by the record's marker, as the full record.

    The launcher is the first-started live process of ours that carries the marker, leads its own session (the
    start spawns it so) and runs the recorded argv; a child that left for a session of its own does not run
    that argv. Returns (record, leftovers): the completed record (written back while this process holds the
    host lock, so the verbs that read the pidfile see it; status only reads), or the record as it was and
    the marker's processes when the launcher is gone or never ran."""
    marker = rec.get("marker")
    carriers = {p: st for p, st in table.items() if marker and st["state"] not in ("Z", "X")
                and p != os.getpid() and has_marker(p, marker) and procfs.owned_by_us(p)}
    lead = next((p for p in sorted(carriers, key=lambda p: carriers[p]["start"]) if carriers[p]["sid"] == p
                 and argv_matches(procfs.cmdline(p), rec.get("argv") or [])), None)
    if lead is None:
        return rec, {p: st["start"] for p, st in carriers.items()}
    st = carriers[lead]
    full = {k: v for k, v in rec.items() if k != "spawning"}
    full.update(pid=lead, pid_start=st["start"], pgid=st["pgid"], sid=st["sid"], found_by_marker=store.now_iso())
    if lock.held_here(ctx):
        try:
            write_pidfile(ctx, full)
        except OSError:
            pass  # the record in memory is the same; the next verb under the lock writes it again
        else:
            store.journal(ctx, "start.found", pid=lead, marker=marker, spawning=rec.get("spawning"))
    return full, {}


def mark_pidfile(ctx, server, **fields):
    rec = read_pidfile(ctx)
    if rec and server and rec.get("pid") == server["pid"]:
        rec.update(fields)
        write_pidfile(ctx, rec)


def describe(pid, start=None):
    out = {"pid": pid, "cmdline": procfs.cmdline(pid)}
    if start is not None:
        out["start"] = start
    return out


def _is_recorded(pid, rec):
    """The live pid runs the recorded command line, or (retitled by setproctitle) carries our marker."""
    return argv_matches(procfs.cmdline(pid), rec.get("argv") or []) or bool(
        rec.get("marker") and has_marker(pid, rec["marker"]))


def _leftovers(table, rec):
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
        lead["state"] in ("Z", "X") or _is_recorded(old, rec)))
    found = {}
    for p, st in table.items():
        if st["state"] in ("Z", "X") or st["start"] < start or (p == old and not session_ours):
            continue
        if ((session_ours and st["sid"] == old) or (marker and has_marker(p, marker))) and procfs.owned_by_us(p):
            found[p] = st["start"]
    return found


def locate(ctx):
    """The one decision about who runs on our port: ours, the operator's, not ours (named), or nobody.

    Ours: the pidfile's process (checked against its start time, command line and owner), the only server
    dynctl signals on its own. The operator's: an sglang (or configured) launcher listening on the port that
    dynctl did not start; it is named and left alone unless the operator asks for it to be taken over
    (preflight's `adopt`). Everything else that matters is named, never claimed: "foreign" listeners on the
    port, and "unmanaged" launchers found only by their command line (not listening, not in our pidfile,
    without our marker) -- those are refused, never signalled. A process of another uid is never ours.
    Status, the watch stream, stop, start, deploy and rollback all read this same answer.

    Returns {"server": {...} or None, "record": pidfile, "pidfile": note, "tree": {pid: start},
    "leftovers": {pid: start} of a previous server, "operator": {...} or None, "foreign": [pids],
    "unmanaged": {pid: start}}.
    """
    rec = read_pidfile(ctx) or None
    table = procfs.table()
    server, note, orphans = None, "absent", {}
    if rec and rec.get("spawning") and not rec.get("pid") and not rec.get("stopped"):
        rec, orphans = _complete_spawn(ctx, table, rec)
        if not rec.get("pid"):
            note = "spawning: no process of the start recorded at %s runs%s" % (
                rec["spawning"], " but its children (pids %s)" % ", ".join(map(str, sorted(orphans))) if orphans else "")
    if rec and rec.get("pid"):
        pid = int(rec["pid"])
        st = table.get(pid)
        if rec.get("stopped"):
            note = "stopped"
        elif st is None or st["state"] in ("Z", "X"):
            note = "stale: pid %d is gone" % pid
        elif st["start"] != rec.get("pid_start") or not _is_recorded(pid, rec):
            note = "stale: pid %d now belongs to another process (%s)" % (
                pid, " ".join(sglang.redact_argv(procfs.cmdline(pid)))[:120])
        elif not procfs.owned_by_us(pid):
            note = "stale: pid %d runs as %s, not as %s" % (pid, _owner(pid), getpass.getuser())
        else:
            note = "ok"
            server = dict(pid=pid, start=st["start"], sid=st["sid"], source="pidfile",
                          marker=rec.get("marker"), argv=procfs.cmdline(pid))
    leftovers = _leftovers(table, rec) if rec and rec.get("pid") and server is None else orphans
    if server is None:
        server = adopted_in_place(ctx, table)
    live = {p: st for p, st in table.items() if st["state"] not in ("Z", "X") and p not in leftovers}
    listeners = procfs.listening_pids(ctx.port)
    operator, op_tree = None, {}
    if server is None:
        for pid in listeners:
            if pid in live and looks_like_server(ctx, procfs.cmdline(pid), pid):
                operator = dict(pid=pid, start=live[pid]["start"], sid=live[pid]["sid"], source="operator",
                                marker=None, argv=procfs.cmdline(pid), uid=(procfs.uids(pid) or (None,))[0])
                op_tree = tree_of(table, pid, operator["start"], operator["sid"] == pid, None)
                break
    tree = {}
    if server is not None:
        tree = tree_of(table, server["pid"], server["start"], server["sid"] == server["pid"], server["marker"])
        leftovers = {p: s for p, s in leftovers.items() if p not in tree}
    found = [p for p in live if p != os.getpid() and p not in tree and p not in op_tree
             and looks_like_server(ctx, procfs.cmdline(p), p)]
    found = [p for p in found if live[p]["ppid"] not in found]  # the launcher, not its children
    unmanaged = {p: live[p]["start"] for p in sorted(found, key=lambda p: live[p]["start"])}
    foreign = [p for p in listeners if p not in tree and p not in leftovers and p not in op_tree]
    if operator is not None:
        operator["tree"] = op_tree
    return {"server": server, "record": rec, "pidfile": note, "tree": tree, "leftovers": leftovers,
            "operator": operator, "foreign": foreign, "unmanaged": unmanaged}


def adopted_in_place(ctx, table):
    """The server `dynctl adopt` took over without a restart, while it is the very process recorded (pid, start
    time, command line, our uid): ours from then on, so stop, restart and status need no second word for it."""
    rec = releases.adopted(ctx)
    if not rec or rec.get("pid") is None:
        return None
    pid = int(rec["pid"])
    st = table.get(pid)
    if st is None or st["state"] in ("Z", "X") or st["start"] != rec.get("pid_start"):
        return None
    if procfs.cmdline(pid) != rec["argv"] or not procfs.owned_by_us(pid):
        return None
    return dict(pid=pid, start=st["start"], sid=st["sid"], source="adopted", marker=None, argv=rec["argv"],
                log=rec.get("log"))


def own_log(pid):
    """The regular file pid writes its stdout (else stderr) to: a hand-started server's own log, or None."""
    for fd in (1, 2):
        try:
            path = os.readlink("/proc/%d/fd/%d" % (pid, fd))
        except OSError:
            continue
        if path.startswith("/") and not path.endswith(" (deleted)") and os.path.isfile(path):
            return path
    return None


def log_path(ctx, loc=None):
    """The log of the server in question: an adopted server's own file (None: it writes none that dynctl can
    read, a terminal say), else the one dynctl's starts write in workdir."""
    server = (loc or locate(ctx))["server"]
    if server is not None and server["source"] == "adopted":
        return server.get("log")
    return ctx.path(LOG)


def _owner(pid):
    found = procfs.uids(pid)
    return "uid ?" if found is None else "%s (uid %d)" % (procfs.user_name(found[0]), found[0])


ADOPT_HINT = ("to take it over (its argv, environment and cwd become the baseline release), answer the takeover "
              "prompt on a terminal or add --adopt; --yes alone never takes over a server")


def would_run(ctx):
    """The argv a start would run with no argv given: the release in force's, else the configured one."""
    configured = hostspec.configured_argv(ctx.launch or [ctx.python, "-m", sglang.LAUNCH_MODULE], ctx.args, ctx.port)
    return hostspec.plain_start(releases.launch_in_force(ctx), None, configured)[0]


def argv_diff(running, wanted):
    """What differs between two argv, in words: "-`--tp 8` +`--tp 4`" (- only in running, + only in wanted)."""
    import difflib

    parts = []
    running, wanted = sglang.redact_argv(running), sglang.redact_argv(wanted)
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, running, wanted, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            parts.append("-`%s`" % " ".join(running[i1:i2]))
        if tag in ("replace", "insert"):
            parts.append("+`%s`" % " ".join(wanted[j1:j2]))
    return " ".join(parts) if parts else "none"


def operator_text(ctx, op):
    return ("port %d is served by pid %d (%s), which was not started by dynctl (the operator's server; argv "
            "against what dynctl would run: %s)"
            % (ctx.port, op["pid"], " ".join(sglang.redact_argv(op["argv"]))[:300],
               argv_diff(op["argv"], would_run(ctx))[:300]))


def operator_hint(op):
    if op.get("uid") != os.geteuid():
        return ("it runs as %s, not as %s: dynctl never takes over another user's server, not even with --adopt; "
                "stop it yourself, or name it with `dynctl stop --pid %d`" % (_owner(op["pid"]), getpass.getuser(),
                                                                             op["pid"]))
    return ADOPT_HINT


def not_ours(ctx, loc, taking=None):
    """What stands in our server's way that dynctl will not touch, named for the operator; None if nothing.

    taking: the operator's server that the operator asked to take over (it no longer counts as in the way).
    {"kind": "operator" | "unmanaged" | "foreign" | "hidden", "pid", "start", "cmdline", "text", "hint"}
    """
    op = loc.get("operator")
    if op is not None and taking is None:
        return {"kind": "operator", "pid": op["pid"], "start": op["start"], "cmdline": op["argv"],
                "would_run": would_run(ctx), "argv_diff": argv_diff(op["argv"], would_run(ctx)),
                "uid": op.get("uid"), "owner": _owner(op["pid"]), "adoptable": op.get("uid") == os.geteuid(),
                "text": operator_text(ctx, op), "hint": operator_hint(op)}
    for pid, start in loc["unmanaged"].items():
        cmd = procfs.cmdline(pid)
        return {"kind": "unmanaged", "pid": pid, "start": start, "cmdline": cmd,
                "text": "pid %d (%s) looks like an sglang server for port %d, but dynctl did not start it and it "
                        "is not listening on the port" % (pid, " ".join(sglang.redact_argv(cmd))[:200], ctx.port),
                "hint": "stop it yourself, or run `dynctl stop --pid %d` to have dynctl stop it" % pid}
    if loc["foreign"]:  # even next to our running server (another address): the next start would fail
        pid = loc["foreign"][0]
        cmd = procfs.cmdline(pid)
        return {"kind": "foreign", "pid": pid, "start": procfs.start_time(pid), "cmdline": cmd,
                "text": "port %d is held by pid %d (%s), which dynctl does not manage"
                        % (ctx.port, pid, " ".join(sglang.redact_argv(cmd))[:200]),
                "hint": _serve_hint(cmd) or "stop it yourself or change the port in the config"}
    if loc["server"] is None and op is None and not loc["leftovers"] and procfs.port_in_use(ctx.port):
        return {"kind": "hidden", "pid": None, "start": None, "cmdline": [],
                "text": "port %d is in use by a process %s cannot see" % (ctx.port, getpass.getuser()),
                "hint": "find it with `ss -ltnp` as root"}
    return None


def _refuse(ctx, action, found, text=None):
    store.journal(ctx, "%s.refused" % action, reason=found["kind"], pid=found["pid"], cmdline=found["cmdline"][:8])
    # only a refusal before any change may promise that nothing changed
    promise = "" if ctx.changed else "; nothing was changed and nothing was killed"
    raise AgentError("%s refused: %s%s -- %s" % (action, text or found["text"], promise, found["hint"]), "preflight",
                     not_ours={k: found[k] for k in ("kind", "pid", "start", "cmdline")})


def takeover(ctx, loc, action, adopt):
    """The operator's server that the operator asked to take over (`adopt`: {"pid", "start"} as they saw
    it), when it is that very process and runs as our uid; None when there is none or no word for it.
    Anything else is refused, naming the server and, for another uid, its owner."""
    op = loc.get("operator")
    if op is None or not adopt:
        return None
    found = not_ours(ctx, loc)
    if op.get("uid") != os.geteuid():
        _refuse(ctx, action, found)
    try:
        pinned = int(adopt.get("pid") or 0), int(adopt["start"])
    except (KeyError, TypeError, ValueError):
        pinned = None
    if pinned != (op["pid"], op["start"]):
        found = dict(found, hint="look again (`dynctl status`) and confirm the server that runs now")
        _refuse(ctx, action, found, "%s, which is not the process that was confirmed for takeover (pid %s, start "
                "time %s)" % (found["text"], adopt.get("pid"), adopt.get("start")))
    return op


def preflight(ctx, loc, action, adopt=None):
    """Refuse `action` before it changes anything when something that is not ours is in the way.

    adopt: the operator's word for taking over their server (see takeover). Returns that server (to be
    adopted and stopped by the caller) when nothing else is in the way; None when there is none.
    """
    taking = takeover(ctx, loc, action, adopt)
    found = not_ours(ctx, loc, taking)
    if found is not None:
        if found["kind"] == "operator" and action == "start":
            found = dict(found, hint=found["hint"].replace("add --adopt", "run `dynctl restart --adopt`"))
        _refuse(ctx, action, found)
    return taking


def adoption(ctx, op):
    """Read the launch of the operator's server `op`: argv, environment and cwd, while it is the same process."""
    pid = op["pid"]
    try:
        env, cwd = procfs.environ(pid), procfs.cwd(pid)
    except OSError as err:
        raise AgentError("cannot read the environment or cwd of pid %d to adopt it: %s; nothing was changed"
                         % (pid, err.strerror or err), "preflight")
    argv = procfs.cmdline(pid)
    if not procfs.same(pid, op["start"]) or not argv:
        raise AgentError("pid %d exited while dynctl read its launch to adopt it; nothing was changed" % pid,
                         "preflight")
    return {"pid": pid, "pid_start": op["start"], "argv": argv, "env": env, "cwd": cwd, "log": own_log(pid),
            "python": _interpreter(pid, argv), "adopted": store.now_iso(), "who": ctx.who}


def _interpreter(pid, argv):
    """The interpreter as it was invoked (a venv's bin/python, not the binary it links to), else /proc's exe."""
    if argv and argv[0].startswith("/") and os.path.basename(argv[0]).startswith(("python", "pypy")):
        return argv[0]
    try:
        return os.readlink("/proc/%d/exe" % pid)
    except OSError:
        return None


def probe_host(argv):
    host = None
    for i, arg in enumerate(argv or []):
        if arg == "--host" and i + 1 < len(argv):
            host = argv[i + 1]
        elif arg.startswith("--host="):
            host = arg.split("=", 1)[1]
    return "127.0.0.1" if host in (None, "", "0.0.0.0", "::", "[::]", "localhost") else host


def health(host, port, timeout=3.0):
    """The status /health answers with, or None when nothing answers."""
    try:
        return httpclient.request(host, port, "GET", "/health", timeout=timeout)[0]
    except httpclient.FAILURES:
        return None


def find(ctx):
    """State of the managed server: down / starting / ready / draining, with pid, uptime and port owner."""
    loc = locate(ctx)
    server, rec = loc["server"], loc["record"] or {}
    blocker = not_ours(ctx, loc)
    out = {"state": "down", "pid": None, "source": None, "argv": None, "uptime_s": None, "started": None,
           "release": None, "health": None, "port": ctx.port, "pidfile": loc["pidfile"],
           "log": log_path(ctx, loc), "port_owner": None,
           "leftovers": [describe(p) for p in sorted(loc["leftovers"])],
           "unmanaged": [describe(p, s) for p, s in loc["unmanaged"].items()],
           "not_ours": blocker, "in_force": releases.launch_in_force(ctx), "adopted": releases.adopted_summary(ctx)}
    if loc["foreign"]:
        out["port_owner"] = describe(loc["foreign"][0])
    if server is None:
        return out
    from_pidfile = server["source"] == "pidfile"
    out.update(pid=server["pid"], source=server["source"], argv=server["argv"], uptime_s=procfs.uptime(server["start"]),
               started=rec.get("started") if from_pidfile else None,
               release=rec.get("release") if from_pidfile else None)
    out["health"] = health(probe_host(server["argv"]), ctx.port)
    if from_pidfile and rec.get("stopping"):
        out["state"] = "draining"
    elif out["health"] == 200:
        out["state"] = "ready"
    else:
        out["state"] = "starting"
    return out
