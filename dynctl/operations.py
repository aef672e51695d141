"""Start a host-side operation and follow its events, surviving a dropped connection (UI-free)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from dynctl.agent import AgentClient
from dynctl.errors import OperationFailed, UnreachableError

Event = dict[str, Any]


def run(agent: AgentClient, kind: str, params: dict[str, Any]) -> Iterator[Event]:
    """Start an operation and follow it in one round trip; if the connection drops, follow it again."""
    op_id = None
    try:
        for item in agent.stream("op_run", kind=kind, params=params):
            event = item["op"]
            op_id = event.get("op_id", op_id)
            yield event
            if event.get("final"):
                return
    except UnreachableError:
        if op_id is None:  # lost before the worker started: nothing happened on the host
            raise
        yield {"type": "warning", "text": "connection lost; reconnecting to follow the operation"}
        yield from follow(agent, op_id)
        return
    raise OperationFailed(f"{agent.host.name}: the {kind} operation ended without a final event")


def follow(agent: AgentClient, op_id: str | None = None, reconnect_for: float = 60.0,
           sleep: Callable[[float], None] = time.sleep) -> Iterator[Event]:
    """Yield an operation's events until its final one; on a dropped connection, reconnect and resume.

    The operation itself runs detached on the host, so losing the connection loses only the view.
    """
    seen = 0
    deadline: float | None = None
    while True:
        try:
            for item in agent.stream("op_follow", op_id=op_id, from_line=seen):
                event = item["op"]
                deadline = None
                seen = event.get("seq", seen + 1)
                op_id = event.get("op_id", op_id)
                yield event
                if event.get("final"):
                    return
        except UnreachableError:
            if deadline is None:
                deadline = time.monotonic() + reconnect_for
            if time.monotonic() > deadline:
                raise
            yield {"type": "warning", "text": "connection lost; reconnecting to follow the operation"}
            sleep(1.0)
            continue
        return  # the stream ended without a final event: agent.stream has already raised for that
