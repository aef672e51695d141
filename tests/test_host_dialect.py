"""One dialect on the host: every record has a "type", every operation writes its own steps, and the
client renders an operation from its records alone."""

from __future__ import annotations

import json

from dynctl.base import events
from dynctl.core import lifecycle
from lifecycle_harness import Box, box  # noqa: F401 - box is a fixture

RECORD_TYPES = {"started", "step_started", "step_done", "log", "info", "warning", "waiting", "final"}


def op_records(box: Box) -> list[dict]:
    [path] = (box.workdir / "ops").glob("*-restart-*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_restart_writes_its_own_steps_and_the_client_invents_none(box: Box):
    box.start_ready("--tokens", "2")
    seen: list[events.Event] = []
    lifecycle.restart_server(box.agent, None, grace=10, ready_timeout=60, on_event=seen.append)
    box.remember_server()
    records = op_records(box)
    assert {r["type"] for r in records} <= RECORD_TYPES
    started = [r["step"] for r in records if r["type"] == "step_started"]
    done = {r["step"]: r for r in records if r["type"] == "step_done"}
    assert started == ["stop", "start", "ready"] == list(done)
    assert done["start"]["result"]["pid"] == done["ready"]["result"]["pid"] == records[-1]["pid"]
    assert [r["detail"] for r in records if r["type"] == "step_started"][1] == "the launch argv of the last start"

    replayed = events.OperationEvents()
    from_records = [e for r in records for e in replayed.read(r)]
    steps = [(type(e).__name__, e.step) for e in from_records if isinstance(e, (events.StepStarted, events.StepDone))]
    assert steps == [("StepStarted", "stop"), ("StepDone", "stop"), ("StepStarted", "start"), ("StepDone", "start"),
                     ("StepStarted", "ready"), ("StepDone", "ready")]
    ready = [e for e in from_records if isinstance(e, events.StepDone) and e.step == "ready"][0]
    assert "/generate returned 2 tokens" in ready.detail
    assert [e for e in seen if isinstance(e, events.StepStarted)] == [
        e for e in from_records if isinstance(e, events.StepStarted)]


def test_the_readiness_stream_speaks_the_same_record_shape(box: Box):
    box.start("--tokens", "2")
    items = list(box.agent.stream("server_wait_ready", ready_timeout=60))
    box.remember_server()
    assert items and all("event" not in item for item in items)
    assert items[-1]["type"] == "ready" and {i["type"] for i in items} <= {"log", "warning", "waiting", "ready"}
