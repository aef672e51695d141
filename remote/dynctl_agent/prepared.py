"""A prepared operation: its worker does everything that changes nothing (checks, validation), then waits for
the client's word before its first change.

A rolling deploy prepares a host's deploy while the gateway drains that host, and says "go" once the drain is
over: the round trip that starts an operation and its worker's start are then off the host's time out of the
gateway. The word is one file, workdir/ops/<id>.go, created once (oprecords): the client's go, its cancel and
the worker's own deadline race for it, and whoever comes first decides. A prepared operation that hears no go
(the drain failed, the client was interrupted or lost its link) ends by itself at its deadline, having changed
nothing, with a final word that says it was not started.
"""

from __future__ import annotations

import os
import time

from dynctl_agent import oprecords, store
from dynctl_agent.protocol import AgentError

POLL_S = 0.01  # a stat of one file: the go is heard within this


def decide(ctx, op_id, go, by):
    """Say the word for op_id unless it was said: the decision that stands ({"go", "by", "t"})."""
    path = oprecords.op_file(ctx, op_id, ".go")
    word = {"go": bool(go), "by": by, "t": store.now_iso()}
    if store.write_json_atomic(path, word, exclusive=True):
        return word
    found = decision(ctx, op_id)  # the other side's word, linked in whole
    if found is None:
        raise AgentError("the word for operation %s in %s cannot be read" % (op_id, path), "failed")
    return found


def decision(ctx, op_id):
    """The word said for op_id, or None while nobody has said it."""
    found = store.read_json(oprecords.op_file(ctx, op_id, ".go"))
    return found if isinstance(found, dict) and "go" in found else None


def await_go(ctx, oplog, within, what):
    """Tell the client the operation is prepared, then wait up to `within` seconds for its go. Returns when
    it came; otherwise the operation ends here, refused ("cancelled": nothing was changed)."""
    oplog.emit("prepared", text="%s prepared; waiting up to %gs for the go" % (what, within), within=within)
    path = oprecords.op_file(ctx, oplog.op_id, ".go")
    deadline = time.monotonic() + within
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            decide(ctx, oplog.op_id, False, "its own deadline: no go within %gs" % within)
            break
        time.sleep(POLL_S)
    word = decision(ctx, oplog.op_id) or {"go": False, "by": "an unreadable word"}
    if not word["go"]:
        raise AgentError("the %s was prepared but not started (%s); nothing was changed" % (what, word["by"]),
                         "cancelled", not_started=True)
    oplog.emit("info", text="go from %s" % word["by"])


def _requested(ctx, op_id):
    oprecords.check_id(op_id)
    if store.read_json(oprecords.op_file(ctx, op_id, ".json")) is None:
        known = ", ".join(oprecords.op_ids(ctx)[:5]) or "none"
        raise AgentError("no operation %s on %s (newest: %s)" % (op_id, ctx.name, known), "usage")


def op_go(ctx, op_id):
    """The client's go for a prepared operation; refused (nothing was changed) once it ended without one."""
    _requested(ctx, op_id)
    ended = oprecords.last_final(ctx, op_id)
    if ended is not None and decision(ctx, op_id) is None:  # it ended before anyone said a word
        raise AgentError("operation %s had already ended: %s" % (op_id, ended.get("error") or "done"),
                         ended.get("kind") or ("usage" if ended.get("ok") else "failed"))
    word = decide(ctx, op_id, True, "%s from %s" % (ctx.who, ctx.client.get("hostname") or "?"))
    if not word["go"]:
        raise AgentError("operation %s was not started (%s); nothing was changed" % (op_id, word["by"]),
                         "cancelled")
    return {"go": True, "op_id": op_id}


def op_cancel(ctx, op_id, kind=None):
    """The client takes back a prepared operation before its go: it ends at once, having changed nothing; an
    id the host has not received yet is claimed as cancelled (its request, still on its way, starts nothing).
    Answers {"go": True} when the go had been given already, or the operation never waits for one (it runs
    on)."""
    oprecords.check_id(op_id)
    request = store.read_json(oprecords.op_file(ctx, op_id, ".json"))
    if request is None:
        from dynctl_agent import operations

        answer = operations.op_detach(ctx, op_id, kind)
        if answer.get("state") == "cancelled":
            return {"go": False, "op_id": op_id, "by": "cancelled before it arrived"}
    elif (request.get("params") or {}).get("go_within") is None:  # not a prepared one: it never waits for a word
        return {"go": True, "op_id": op_id, "by": "not prepared: it runs without a go"}
    word = decide(ctx, op_id, False, "cancelled by %s" % ctx.who)
    return {"go": word["go"], "op_id": op_id, "by": word["by"]}
