"""What the agent keeps in workdir stays bounded: the journal rotates, an operation's event log is capped."""

from __future__ import annotations

import json

from dynctl_agent import oprecords, store
from dynctl_agent.protocol import Context


def make_ctx(tmp_path) -> Context:
    return Context({"workdir": str(tmp_path / "work")}, {"user": "tester"})


def test_the_journal_rotates_keeping_one_old_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "JOURNAL_ROTATE", 4096)
    ctx = make_ctx(tmp_path)
    for i in range(400):
        store.journal(ctx, "test.event", n=i, pad="x" * 40)
    journal = tmp_path / "work" / "journal.jsonl"
    old = tmp_path / "work" / "journal.jsonl.1"
    assert journal.stat().st_size <= 4096 + 200 and old.stat().st_size <= 4096 + 200
    assert sorted(p.name for p in journal.parent.iterdir()) == ["journal.jsonl", "journal.jsonl.1"]
    assert journal.stat().st_mode & 0o777 == 0o600
    last = [json.loads(line)["n"] for line in journal.read_text().splitlines()]
    assert last[-1] == 399 and last == list(range(last[0], 400))  # nothing lost at the cut in the newest


def test_an_operations_log_lines_stop_at_the_cap_but_its_steps_do_not(tmp_path, monkeypatch):
    monkeypatch.setattr(oprecords, "EVENTS_CAP", 2048)
    ctx = make_ctx(tmp_path)
    (tmp_path / "work" / "ops").mkdir(parents=True)
    oplog = oprecords.OpLog(ctx, "20261130T000000-deploy-abcdef", "deploy")
    for i in range(200):
        oplog.log("server log line %d %s" % (i, "y" * 30))
    with oplog.step("verify"):
        pass
    oplog.emit("final", final=True, ok=True)
    events = [json.loads(line) for line in open(oplog.path)]
    assert oplog.lost > 150
    assert sum(1 for e in events if e["type"] == "log") == 200 - oplog.lost
    assert [e["type"] for e in events[-3:]] == ["step_started", "step_done", "final"]
