"""A deploy started prepared (as a rolling deploy starts it while the gateway drains the host), on a demo host
over the real sshd: it changes nothing until its go, ends by itself, not started, when no go comes, and runs
the whole deploy once it does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from demo_box import server_pid, session, start_baseline, tree_sha256
from polling import wait_for

from dynctl.agent.client import AgentError
from dynctl.base import events
from dynctl.base.errors import PreflightError
from dynctl.core import deploy as core

pytestmark = pytest.mark.slow


def journal(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "journal.jsonl").read_text().splitlines()]


def notes(seen: list) -> list[str]:
    return [e.text for e in seen if isinstance(e, events.Note)]


def test_a_prepared_deploy_without_its_go_changes_nothing_and_ends_by_its_deadline(demo_box):
    config = demo_box(via="ssh")
    pid = start_baseline(config)
    box = session(config)
    workdir = Path(box.host.workdir)
    tree = tree_sha256(config)
    seen: list = []
    handle = core.prepare(box.agent, core.plan_deploy(box.agent, box.host, 5), 1.0, seen.append)
    wait_for(handle.ended.is_set, 60, "the prepared deploy ending by its deadline")

    assert isinstance(handle.error, PreflightError), handle.error  # exit 3: nothing was changed
    assert "prepared but not started (its own deadline: no go within 1s); nothing was changed" in str(handle.error)
    assert any("deploy of threshold 5 prepared; waiting up to 1s for the go" in n for n in notes(seen))
    assert tree_sha256(config) == tree  # sglang's files as they were
    assert server_pid(config) == pid  # the server never stopped
    assert box.agent.call("releases")["releases"] == []
    assert box.agent.call("op_current")["holder"] is None  # the host lock is free again
    [op] = box.agent.call("op_list")["ops"]
    assert (op["id"], op["kind"], op["state"]) == (handle.op_id, "deploy", "cancelled")
    steps = [(r["event"], r.get("kind")) for r in journal(workdir) if r.get("op") == handle.op_id]
    assert ("deploy.prepared", None) in steps and steps[-1] == ("deploy.final", "cancelled")
    assert not any(event.startswith(("patch.", "stop.", "start.")) for event, _ in steps)
    with pytest.raises(AgentError, match="was not started .*nothing was changed") as late:
        box.agent.call("op_go", op_id=handle.op_id)  # a go after the deadline starts nothing
    assert late.value.exit_code == 3


def test_go_after_a_prepare_runs_the_deploy_and_a_cancel_ends_it_at_once(demo_box):
    config = demo_box(via="ssh")
    pid = start_baseline(config)
    box = session(config)
    tree = tree_sha256(config)
    plan = core.plan_deploy(box.agent, box.host, 5)

    taken_back: list = []
    first = core.prepare(box.agent, plan, 600.0, taken_back.append)
    wait_for(first.cue.is_set, 60, "the first deploy prepared")
    first.cancel()
    assert first.ended.is_set() and isinstance(first.error, PreflightError), first.error
    assert "cancelled by" in str(first.error) and "nothing was changed" in str(first.error)

    seen: list = []
    second = core.prepare(box.agent, plan, 600.0, seen.append)
    wait_for(second.cue.is_set, 60, "the second deploy prepared")
    assert not second.ended.is_set()  # waiting for its go, holding the host
    assert box.agent.call("op_current")["holder"]["op"] == second.op_id
    assert tree_sha256(config) == tree and server_pid(config) == pid  # prepared: nothing changed yet
    result = second.go()

    assert result["ok"] and result["threshold_in_force"] == 5
    assert server_pid(config) not in (None, pid)
    assert tree_sha256(config) != tree
    assert any(n.startswith("go from ") for n in notes(seen))
    done = [e for e in seen if isinstance(e, events.StepDone)]
    assert [e.step for e in done][:2] == ["prepare", "switch"]  # validated before the go, switched after it
    assert {"stop", "start", "ready", "verify", "soak"} <= {e.step for e in done}
    states = {op["id"]: op["state"] for op in box.agent.call("op_list")["ops"]}
    assert states == {first.op_id: "cancelled", second.op_id: "done"}
