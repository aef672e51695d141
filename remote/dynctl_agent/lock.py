"""One operation at a time per host: the host lock in workdir, and the signal shields around transactions."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

from dynctl_agent import procfs, store
from dynctl_agent.protocol import AgentError

@contextlib.contextmanager
def host_lock(ctx, operation, op=None, best_effort=False):
    """One operation per host: workdir/lock names the holder; a dead holder's lock is taken over.

    Re-entrant for the process that holds it: an operation worker runs verbs that take the lock themselves.
    best_effort: where the lock cannot be written (a full disk) go on without it, and say so in the holder's
    "unrecorded"; a live holder is still refused. For a stop, which must work on a full disk: nothing else can
    take the lock there either (every writer needs room), and a stop is safe to repeat.
    """
    ctx.ensure_workdir()
    path = ctx.path("lock")
    held = store.read_json(path) or {}
    if _mine(held):
        yield held
        return
    me = {
        "operation": operation,
        "who": ctx.who,
        "client_host": ctx.client.get("hostname"),
        "pid": os.getpid(),
        "pid_start": procfs.start_time(os.getpid()),
        "started": store.now_iso(),
        "op": op,
    }
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            holder = store.read_json(path)
            if holder is None:  # being written right now, or garbage: look again
                time.sleep(0.05)
                holder = store.read_json(path) or {}
            if procfs.holder_alive(holder):
                raise AgentError(
                    "host is busy: %s by %s (pid %s on %s) since %s"
                    % (holder.get("operation"), holder.get("who"), holder.get("pid"), ctx.name, holder.get("started")),
                    "busy",
                    holder=holder,
                )
            store.journal(ctx, "lock.takeover", previous=holder)
            me["took_over"] = holder  # the caller warns: an operation died holding the host
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            continue
        except OSError as err:  # no room even for the name (a full directory, no inodes left)
            fd, failure = None, err
        else:
            failure = None
        if fd is not None:
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
            except OSError as err:  # a full disk: an empty lock would read as "being written" to the next one
                with contextlib.suppress(OSError):
                    os.unlink(path)
                failure = err
        if failure is not None:
            err = failure
            if best_effort:
                me["unrecorded"] = "the host lock %s could not be written (%s)" % (path, err.strerror or err)
                store.journal(ctx, "lock.unrecorded", operation=operation, error=str(err))
                yield me
                return
            raise AgentError("cannot write the host lock %s: %s; nothing was changed" % (path, err.strerror or err),
                             "preflight")
        break
    else:
        raise AgentError("could not take the host lock %s" % path, "busy")
    try:
        yield me
    finally:
        with contextlib.suppress(FileNotFoundError):
            if (store.read_json(path) or {}).get("pid") == os.getpid():
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
def hangup_shield(*also):
    """A dropped SSH channel must not interrupt a transaction half way: SIGHUP (and `also`) ignored meanwhile."""
    sigs = (signal.SIGHUP,) + also
    old = [signal.signal(sig, signal.SIG_IGN) for sig in sigs]
    try:
        yield
    finally:
        for sig, handler in zip(sigs, old):
            signal.signal(sig, handler)


def _mine(holder):
    return holder.get("pid") == os.getpid() and holder.get("pid_start") == procfs.start_time(os.getpid())


def held_here(ctx):
    """This process holds the host lock."""
    return _mine(store.read_json(ctx.path("lock")) or {})


def live_holder(ctx):
    """The lock's holder while its process runs, else None."""
    holder = store.read_json(ctx.path("lock"))
    return holder if holder and procfs.holder_alive(holder) else None
