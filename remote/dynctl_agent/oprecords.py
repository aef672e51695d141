"""The records of operations in workdir/ops: ids, event logs, final words, room checks and pruning.

A host-changing operation (deploy, rollback, restart) runs as ONE detached agent process on the host, in
its own session, holding the host lock under its own pid. The client only starts it and follows its event
file, so a dropped SSH connection never interrupts a critical sequence: the worker finishes, and the next
client sees either the lock held by a live worker (and can follow it) or the final state.

The client chooses the operation's id and sends it with the request, so starting is idempotent: the
request file is claimed exclusively, and the same id sent again (by a client whose connection dropped
before it saw a word) starts nothing and follows what the first request started. Every claimed id ends
with a final event: the worker's, the refusal's (host busy), or a cancellation (op_detach: the client gave
up before the host had the request). A follower that finds no worker and no final says what the host did.

  workdir/ops/<id>.json      the request (kind, params, client, received)
  workdir/ops/<id>.jsonl     events, one JSON object per line; the last one has "final": true
  workdir/ops/<id>.log       the worker's own stdout/stderr (tracebacks land here)

The newest keep_history records are kept (op_start prunes older ones; never the running one).
Each event log is bounded: past EVENTS_CAP bytes its log lines are counted, not written.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import shutil
import time

from dynctl import sglang
from dynctl_agent import procfs, store
from dynctl_agent.protocol import AgentError

ID = re.compile(r"^\d{8}T\d{6}-[a-z]+-[0-9a-f]{6,32}$")
GONE_S = 2.0  # how long a follower waits for a worker it cannot see before it calls it gone
ROOM = 1 << 20  # free bytes an operation wants in workdir on top of its request (events, journal, state)
TMP_NAME = re.compile(r"\.tmp\.(\d+)$")
EVENTS_CAP = 8 << 20  # a start that logs for 15 minutes must not fill the disk with its echo


def append(path, record):
    """Append one JSON line (API keys in it redacted); returns the size of the file after it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(sglang.redact(record), default=str) + "\n").encode())
        return os.fstat(fd).st_size
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
        self.lost = 0
        self.size = 0

    def emit(self, type_, required=False, **fields):
        record = {"t": store.now_iso(), "elapsed": round(time.monotonic() - self.t0, 3), "type": type_}
        record.update(fields)
        if type_ == "log" and self.size > EVENTS_CAP:
            self.lost += 1
            return
        try:
            self.size = append(self.path, record)
        except OSError:
            if required:
                raise
            self.lost += 1
            return
        if type_ != "log":
            with contextlib.suppress(OSError, AgentError):
                store.journal(self.ctx, "%s.%s" % (self.kind, type_), op=self.op_id,
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


def new_id(kind):
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return "%s-%s-%s" % (stamp, kind, os.urandom(6).hex())


def check_id(op_id):
    if not isinstance(op_id, str) or not ID.match(op_id):
        raise AgentError("bad operation id %r (expected YYYYMMDDTHHMMSS-KIND-HEX, as `dynctl ops list` shows)"
                         % (op_id,), "usage")


def op_file(ctx, op_id, ext):
    return ctx.path("ops", op_id + ext)


def final(ctx, op_id, **fields):
    """The final word for an id whose worker never ran (refused, or cancelled before it started)."""
    record = {"t": store.now_iso(), "elapsed": 0.0, "type": "final", "final": True}
    record.update(fields)
    with contextlib.suppress(OSError):
        append(op_file(ctx, op_id, ".jsonl"), record)


def last_final(ctx, op_id):
    try:
        with open(op_file(ctx, op_id, ".jsonl"), "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        with contextlib.suppress(ValueError):
            event = json.loads(raw)
            if event.get("final"):
                return event
    return None


def op_ids(ctx):
    """Claimed operation ids, newest first (by when this host received them)."""
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir(ctx.path("ops")):
            if name.endswith(".json") and ID.match(name[:-5]):
                with contextlib.suppress(OSError):
                    found.append((os.stat(ctx.path("ops", name)).st_mtime_ns, name[:-5]))
    return [op_id for _, op_id in sorted(found, reverse=True)]


def already(existing, kind, op_id):
    if existing.get("kind") not in (None, kind):
        raise AgentError("operation id %s is already used by a %s, not a %s" % (op_id, existing.get("kind"), kind),
                         "usage")
    return {"op_id": op_id, "worker_pid": None, "already": True}


def size_text(n):
    return "%.1f MiB" % (n / (1 << 20)) if n >= 1 << 20 else "%d KiB" % (n // 1024)


def room_check(ctx, kind, request):
    """Refuse, before anything is written, where workdir cannot hold the backups and records of the operation."""
    need = ROOM + 2 * len(json.dumps(request, default=str))  # the request, and backups about as large
    try:
        free = shutil.disk_usage(ctx.workdir).free
    except OSError:
        return
    if free < need:
        raise AgentError("no space left in workdir %s on %s: %s free, a %s needs about %s (its request, backups "
                         "and records); free some space there; nothing was changed"
                         % (ctx.workdir, ctx.name, size_text(free), kind, size_text(need)), "preflight")


def prune(ctx, keep_id=None):
    """Keep the newest ctx.keep operation records, never the running one; drop temp files of dead writers."""
    removed = []
    for folder in (ctx.workdir, ctx.path("ops")):  # temp files of writers killed half way (state, pidfile, ...)
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                m = TMP_NAME.search(name)
                if m and not procfs.alive(int(m.group(1))):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, name))
    running = (store.read_json(ctx.path("lock")) or {}).get("op")
    for op_id in op_ids(ctx)[ctx.keep:]:
        if op_id in (keep_id, running):
            continue
        for ext in (".json", ".jsonl", ".log"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(op_file(ctx, op_id, ext))
        removed.append(op_id)
    if removed:
        with contextlib.suppress(OSError, AgentError):
            store.journal(ctx, "ops.pruned", ops=removed, keep=ctx.keep)
    return removed
