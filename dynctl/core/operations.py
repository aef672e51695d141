"""Host-side operations (deploy, rollback, restart): start one, follow it, and turn its end into a result (UI-free).

The client chooses the operation's id and sends it with the request, which makes starting idempotent: when
the connection drops before the client has seen a word, it reconnects and sends the same request again,
and the host, which may already run it, follows the one it has instead of starting a second. Whatever the
connection does, the client reports what the host did.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from dynctl.base import events
from dynctl.agent.client import AgentClient
from dynctl.base.errors import (
    DynctlError,
    HostKeyError,
    Interrupted,
    OperationFailed,
    PreflightError,
    UnreachableError,
    UsageError,
)

Record = dict[str, Any]  # one of the agent's operation records; `dynctl.base.events.OperationEvents` reads them
Failure = Callable[[Record, str], DynctlError]
LATEST = "latest"
RECONNECT_FOR_S = 60.0
WORD_HEARD_S = 5.0  # a prepared worker ends within this once the word is said (it looks every 10 ms)


def recent(agent: AgentClient, limit: int = 20) -> list[Record]:
    """The newest operations on the host, newest first: id, kind, who, when received, and how each ended."""
    return list(agent.call("op_list", limit=limit)["ops"])


def new_op_id(kind: str) -> str:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{kind}-{uuid.uuid4().hex[:12]}"


def run(agent: AgentClient, kind: str, params: dict[str, Any], op_id: str | None = None,
        reconnect_for: float = RECONNECT_FOR_S, sleep: Callable[[float], None] = time.sleep) -> Iterator[Record]:
    """Start `kind` as `op_id` and yield its events until the final one, through dropped connections."""
    op_id = op_id or new_op_id(kind)
    return _events(agent, "op_run", {"kind": kind, "params": params, "op_id": op_id}, op_id, kind,
                   reconnect_for, sleep)


def follow(agent: AgentClient, op_id: str = LATEST, reconnect_for: float = RECONNECT_FOR_S,
           sleep: Callable[[float], None] = time.sleep) -> Iterator[Record]:
    """Yield the events of an operation that runs or ran (an id, or "latest") from its first to its final one."""
    return _events(agent, "op_follow", {"op_id": op_id}, op_id, "operation", reconnect_for, sleep)


def _events(agent: AgentClient, verb: str, params: dict[str, Any], op_id: str, kind: str, reconnect_for: float,
            sleep: Callable[[float], None]) -> Iterator[Record]:
    seen = 0
    deadline: float | None = None
    while True:
        try:
            for item in agent.stream(verb, from_line=seen, **params):
                event = item["op"]
                deadline = None
                seen = event.get("seq", seen + 1)
                if event.get("op_id") and params.get("op_id") == LATEST:
                    params["op_id"] = op_id = event["op_id"]  # after a reconnect: this one, not a newer one
                yield event
                if event.get("final"):
                    return
        except HostKeyError:
            raise
        except UnreachableError as err:
            if deadline is None:
                deadline = time.monotonic() + reconnect_for
            if time.monotonic() > deadline:
                raise UnreachableError(f"{err}; the {kind} {op_id} may still run there: "
                                       f"`dynctl ops follow {op_id}` shows it once the host answers") from None
            yield {"type": "warning", "text": f"connection lost; reconnecting to follow the {kind} ({op_id})"}
            sleep(1.0)
            continue
        raise OperationFailed(f"{agent.host.name}: the {kind} {op_id} ended without a final event")


def execute(agent: AgentClient, kind: str, params: dict[str, Any], on_event: events.EventSink = events.ignore,
            failure: Failure | None = None, op_id: str | None = None) -> dict[str, Any]:
    """Run `kind` on the host, relay its events, and turn its final word into a result or an error.

    Ctrl-C stops the following, not the operation: Interrupted (exit 130) says what became of it.
    """
    op_id = op_id or new_op_id(kind)
    try:
        return conclude(agent, kind, run(agent, kind, params, op_id), on_event, failure)
    except KeyboardInterrupt:
        raise interrupted(agent, kind, op_id) from None


class Prepared:
    """A host operation started prepared: its worker checks and validates, changes nothing, and waits up to
    `go_within` seconds for `go()`; `cancel()`, or no word in that time, ends it not started. Its events are
    relayed from a thread of its own meanwhile, so the caller can do something else (a gateway's drain)."""

    def __init__(self, agent: AgentClient, kind: str, params: dict[str, Any], go_within: float,
                 on_event: events.EventSink = events.ignore):
        self.agent, self.kind, self.on_event = agent, kind, on_event
        self.op_id = new_op_id(kind)
        self.params = dict(params, go_within=go_within)
        self.cue = threading.Event()  # the worker is prepared, or the operation has ended
        self.ended = threading.Event()
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.said_go = False
        self.thread = threading.Thread(target=self._follow, daemon=True, name=f"prepared-{agent.host.name}")
        self.thread.start()

    def _records(self) -> Iterator[Record]:
        for record in run(self.agent, self.kind, self.params, self.op_id):
            if record.get("type") == "prepared":
                self.cue.set()
            yield record

    def _follow(self) -> None:
        try:
            self.result = conclude(self.agent, self.kind, self._records(), self.on_event)
        except BaseException as err:  # noqa: BLE001 - handed to the caller of go()
            self.error = err
        finally:
            self.cue.set()
            self.ended.set()

    def go(self) -> dict[str, Any]:
        """Say go once the worker is prepared, then follow the operation to its end: its final record, or its
        error (a prepare that refused, or a go that came after the deadline: nothing was changed, exit 3)."""
        try:
            self.cue.wait()
            if not self.ended.is_set():
                try:
                    self.agent.call_through_drop("op_go", self.kind, op_id=self.op_id)
                    self.said_go = True
                except DynctlError:
                    if not self.ended.wait(WORD_HEARD_S):  # the worker's own final word says why
                        raise
            self.ended.wait()
        except KeyboardInterrupt:
            raise interrupted(self.agent, self.kind, self.op_id) from None
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def cancel(self, wait: float = 15.0) -> None:
        """Take the operation back before its go; it ends at once, having changed nothing. Best effort: a host
        that does not answer ends it by its deadline."""
        old = self.agent.timeout
        self.agent.timeout = min(old, wait)
        try:
            self.agent.call("op_cancel", op_id=self.op_id, kind=self.kind)
        except DynctlError:
            return
        finally:
            self.agent.timeout = old
        self.ended.wait(wait)


def error_for(final: Record, message: str) -> DynctlError:
    """The error for a final event that did not succeed; its exit code tells the outcome: 1 failed (rolled back
    where that applies), 2 a usage error, 3 refused or cancelled with nothing changed."""
    if final.get("kind") in ("preflight", "busy", "cancelled"):
        return PreflightError(message)
    if final.get("kind") == "usage":
        return UsageError(message)
    return OperationFailed(message)


def conclude(agent: AgentClient, kind: str, stream: Iterator[Record], on_event: events.EventSink = events.ignore,
             failure: Failure | None = None) -> dict[str, Any]:
    """Report `stream` as events up to its final record; return that record when it succeeded, else raise
    `failure`'s error. `kind` names the operation until its records say which it is (`ops follow`)."""
    reader = events.OperationEvents()
    final: Record = {}
    for record in stream:
        for event in reader.read(record):
            on_event(event)
        if record.get("final"):
            final = record
            break
    kind = final.get("op_kind") or kind
    if final.get("ok"):
        on_event(outcome(kind, agent.host.name, final))
        return final
    message = final.get("error") or f"{kind} failed"
    raise (failure or error_for)(final, f"{agent.host.name}: {message}")


def outcome(kind: str, host: str, final: Record) -> events.Finished | events.Unchanged:
    """What an operation that succeeded did, in one sentence, however it was followed."""
    elapsed = final.get("elapsed")
    soaked = f", still serving {final['soak_s']:g} s after ready" if final.get("soak_s") else ""
    if kind == "deploy":
        requested = final.get("threshold_requested")
        asked = (f", {requested} requested: sglang's CUDA-graph padding moves the cut"
                 if requested is not None and requested != final.get("threshold_in_force") else "")
        return events.Finished("deploy", "deployed",
                               f"release {final.get('release')} on {host}: threshold {final.get('threshold_in_force')} "
                               f"in force (read back from /server_info{asked}), pid {final.get('pid')}{soaked}",
                               elapsed)
    if kind == "rollback":
        if final.get("changed") is False:
            return events.Unchanged("rollback", final.get("message") or "nothing to do")
        reverted = ", ".join(final.get("reverted") or []) or "none"
        return events.Finished("rollback", "rolled back",
                               f"{host} to {final.get('target')} (reverted: {reverted}), pid {final.get('pid')}{soaked}",
                               elapsed)
    if kind == "restart":
        return events.Finished("restart", "restarted", f"the server on {host}: pid {final.get('pid')} ready", elapsed)
    return events.Finished(kind, "done", f"{kind} on {host}", elapsed)


def interrupted(agent: AgentClient, kind: str, op_id: str) -> Interrupted:
    """After Ctrl-C: ask the host what became of `op_id` (claiming it as cancelled if it never arrived)."""
    name = agent.host.name
    old = agent.timeout
    agent.timeout = min(old, 15.0)
    try:
        answer = agent.call("op_detach", op_id=op_id, kind=kind)
    except (DynctlError, KeyboardInterrupt) as err:
        return Interrupted(f"{name}: interrupted; could not ask the host what became of the {kind} "
                           f"({err or 'interrupted again'}): `dynctl ops follow {op_id}` shows it")
    finally:
        agent.timeout = old
    state = answer.get("state")
    if state == "cancelled":
        return Interrupted(f"{name}: interrupted before the {kind} started there; nothing was changed")
    if state == "finished":
        final = answer.get("final") or {}
        how = "succeeded" if final.get("ok") else f"failed: {final.get('error')}"
        return Interrupted(f"{name}: interrupted, but the {kind} had already ended there and {how} "
                           f"(`dynctl ops follow {op_id}` shows it)")
    undo = ", `dynctl rollback` to undo it" if kind == "deploy" else ""
    return Interrupted(f"{name}: interrupted; the {kind} continues on the host: `dynctl ops follow {op_id}` to "
                       f"watch it{undo}")
