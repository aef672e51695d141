"""What the agent keeps in workdir: the journal (JSON lines, 0600, rotated) and files written atomically."""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os

from dynctl.base import sglang
from dynctl_agent.protocol import AgentError

JOURNAL = "journal.jsonl"
JOURNAL_ROTATE = 16 << 20  # beyond this the journal moves to journal.jsonl.1 (one old copy is kept)
PIDFILE = "server.json"  # the server dynctl started: its pid, argv and release (servers writes it)


def read_pidfile(ctx):
    return read_json(ctx.path(PIDFILE)) if os.path.isdir(ctx.workdir) else None


def now_iso():
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def journal(ctx, event, **fields):
    """Append one JSON line to workdir/journal.jsonl (0600). Best effort: the journal is the audit trail, not the
    transaction, so a full disk costs the record (False) and never a stop or a rollback half way."""
    record = {"t": now_iso(), "event": event, "who": ctx.who}
    record.update(sglang.redact(fields))  # a journal is read by people: no API key in it
    path = ctx.path(JOURNAL)
    try:
        ctx.ensure_workdir()
        rotate(path, JOURNAL_ROTATE)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.fchmod(fd, 0o600)
            append_whole(fd, (json.dumps(record, sort_keys=True, default=str) + "\n").encode())
        finally:
            os.close(fd)
    except (OSError, AgentError):
        return False
    return True


def append_whole(fd, data):
    """Append `data` to the O_APPEND file `fd` whole or not at all: a short write (a disk that fills half way
    through a line) is completed, and a write that fails cuts the file back to where it was, so a reader never
    finds a torn line. Returns the file's size after it."""
    before = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, before)
        raise
    return os.fstat(fd).st_size


def rotate(path, limit):
    """Move path to path.1 (replacing an older one) once it has grown past limit bytes."""
    with contextlib.suppress(OSError):
        if os.path.getsize(path) > limit:
            os.replace(path, path + ".1")


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


def read_json(path):
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


def write_bytes(path, data, mode=0o644, exclusive=True):
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
