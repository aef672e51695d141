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
  workdir/ops/<id>.final     FINAL_ROOM bytes the worker reserves when it starts: where its final word goes
                             when the event log cannot take it (a full disk); removed once the log took it
  workdir/ops/<id>.reserve   ROLLBACK_ROOM bytes held while the worker runs and given back to the disk when
                             a transaction has to be undone, so the rollback's records fit on a full disk
  workdir/ops/<id>.go        the word a prepared operation waits for (go or not, and who said it), created
                             once: the client's go, its cancel and the worker's own deadline race for it

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

from dynctl.base import sglang
from dynctl_agent import procfs, store
from dynctl_agent.protocol import AgentError

ID = re.compile(r"^\d{8}T\d{6}-[a-z]+-[0-9a-f]{6,32}$")
GONE_S = 2.0  # how long a follower waits for a worker it cannot see before it calls it gone
ROOM = 1 << 20  # free bytes an operation wants in workdir on top of its request (events, journal, state)
# the temp files store.write_json_atomic and releases.update_current leave when killed: these names only, never
# a file of the operator's that merely ends in .tmp.<pid>
TMP_NAMES = {"": re.compile(r"^(?:server\.json|state\.json|lock|current)\.tmp\.(\d+)\Z"),
             "ops": re.compile(r"^\d{8}T\d{6}-[a-z]+-[0-9a-f]{6,32}\.(?:json|go)\.tmp\.(\d+)\Z")}
EVENTS_CAP = 8 << 20  # a start that logs for 15 minutes must not fill the disk with its echo
FINAL_ROOM = 64 << 10  # the final word with its log tail fits in this
ROLLBACK_ROOM = 256 << 10  # a release's manifest and `current`, a pidfile and the start of a server log
RECORD_EXTS = (".json", ".jsonl", ".log", ".final", ".reserve", ".go")


def append(path, record):
    """Append one JSON line (API keys in it redacted), whole or not at all (never a torn line); returns the size
    of the file after it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return store.append_whole(fd, (json.dumps(sglang.redact(record), default=str) + "\n").encode())
    finally:
        os.close(fd)


def _fill(path, size):
    """A file of `size` blanks, on the disk (fsync'd): its blocks are taken now, so overwriting them later needs
    no free space."""
    try:
        store.write_bytes(path, b" " * size, 0o600)
        return True
    except OSError:  # write_bytes removed what it started
        return False


def _fitting(record, room):
    """`record` as one JSON line of at most `room` bytes: the log tail shortened, then the error cut, if need be."""
    record = dict(record)
    while True:
        data = (json.dumps(record, default=str) + "\n").encode()
        if len(data) <= room:
            return data
        if record.get("log_tail"):
            record["log_tail"] = record["log_tail"][len(record["log_tail"]) // 2 + 1:]
        elif len(str(record.get("error") or "")) > 200:
            text = str(record["error"])
            record["error"] = text[:len(text) // 2] + " [...]"
        else:
            record = {k: record[k] for k in ("type", "final", "ok", "kind", "error", "t") if k in record}
            record["error"] = str(record.get("error") or "")[:200]


def parse_event(raw):
    """One line of an event log as a record, or None. A line torn by a writer that died half way has the next
    record appended to it: that one is read from where it starts (every record starts with its "t")."""
    for start in (0, raw.rfind(b'{"t": ')):
        if start < 0 or (start == 0 and raw[:1] != b"{"):
            continue
        try:
            event = json.loads(raw[start:])
        except ValueError:
            continue
        if isinstance(event, dict):
            return event
    return None


def read_final_spot(ctx, op_id):
    """The final word the worker left in its reserved spot (ops/<id>.final), or None (blanks, or absent)."""
    try:
        with open(op_file(ctx, op_id, ".final"), "rb") as f:
            if f.read(1) != b"{":  # still the blanks reserved at the start
                return None
            f.seek(0)
            event = parse_event(f.read(FINAL_ROOM).strip())
    except OSError:
        return None
    return event if event is not None and event.get("final") else None


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
        self.spot = ctx.path("ops", op_id + ".final")
        self.reserve = ctx.path("ops", op_id + ".reserve")
        self.t0 = time.monotonic()
        self.lost = 0
        self.size = 0
        self.spotted = False

    def make_room(self):
        """Reserve, while there is room, the spot for the final word and the room a rollback needs."""
        self.spotted = _fill(self.spot, FINAL_ROOM)
        _fill(self.reserve, ROLLBACK_ROOM)

    def release_room(self):
        """Give the rollback's reserve back to the disk: from here the rollback writes into it."""
        with contextlib.suppress(OSError):
            os.unlink(self.reserve)

    def finish(self, **fields):
        """The final event: into the event log, else (a full disk) over the reserved spot's blanks, in place.
        Returns where it went, or None when neither could take it."""
        self.release_room()
        record = {"t": store.now_iso(), "elapsed": round(time.monotonic() - self.t0, 3), "type": "final"}
        record.update(fields)
        try:
            append(self.path, record)
        except OSError:
            pass
        else:
            with contextlib.suppress(OSError, AgentError):
                store.journal(self.ctx, "%s.final" % self.kind, op=self.op_id,
                              **{k: v for k, v in fields.items() if k != "log_tail"})
            with contextlib.suppress(OSError):
                os.unlink(self.spot)
            return self.path
        if not self.spotted:
            return None
        try:
            fd = os.open(self.spot, os.O_WRONLY)
            try:
                data = _fitting(record, FINAL_ROOM - 1)
                os.pwrite(fd, data + b" " * (FINAL_ROOM - len(data)), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            return None
        return self.spot

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
                              **{k: v for k, v in fields.items() if k not in ("lines", "result")})

    @contextlib.contextmanager
    def step(self, name, detail=None):
        """step_started, then step_done once the block ends well, with what the block put in the dict it is
        given (a verb's answer as "result", for the client to describe the step by)."""
        self.emit("step_started", step=name, detail=detail)
        t0 = time.monotonic()
        done = {}
        yield done
        self.emit("step_done", step=name, seconds=round(time.monotonic() - t0, 3), **done)

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
        lines = []
    for raw in reversed(lines):
        event = parse_event(raw)
        if event is not None and event.get("final"):
            return event
    return read_final_spot(ctx, op_id)


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
    for sub, tmp_name in TMP_NAMES.items():  # temp files of writers killed half way (state, pidfile, ...)
        folder = ctx.path(sub) if sub else ctx.workdir
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                m = tmp_name.match(name)
                if m and not procfs.alive(int(m.group(1))):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, name))
    running = (store.read_json(ctx.path("lock")) or {}).get("op")
    for op_id in op_ids(ctx)[ctx.keep:]:
        if op_id in (keep_id, running):
            continue
        for ext in RECORD_EXTS:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(op_file(ctx, op_id, ext))
        removed.append(op_id)
    if removed:
        with contextlib.suppress(OSError, AgentError):
            store.journal(ctx, "ops.pruned", ops=removed, keep=ctx.keep)
    return removed
