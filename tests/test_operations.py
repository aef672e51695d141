"""Host operations on a local demo host: a dead holder's lock and the journal (a worker killed mid-deploy: test_faults.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from demo_box import session

from dynctl.core import deploy as core
from dynctl.base import events

pytestmark = pytest.mark.slow


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_holders_lock_is_taken_over_with_a_warning(demo_box):
    local_demo = session(demo_box(via="local"))
    workdir = Path(local_demo.host.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "lock").write_text(json.dumps({"operation": "deploy", "who": "alice", "pid": dead_pid(),
                                              "pid_start": 1, "started": "2026-11-29T00:00:00Z"}))
    seen: list[events.Event] = []
    plan = core.plan_deploy(local_demo.agent, local_demo.host, 5)
    result = core.deploy(local_demo.agent, plan, seen.append, ready_timeout=60, soak=0)
    assert result["threshold_in_force"] == 5
    warnings = [e.text for e in seen if isinstance(e, events.Warning)]
    assert any("took over the host lock of a deploy by alice" in w for w in warnings)
    assert not (workdir / "lock").exists()

    journal = workdir / "journal.jsonl"
    assert journal.stat().st_mode & 0o777 == 0o600
    kinds = [json.loads(line)["event"] for line in journal.read_text().splitlines()]
    assert "lock.takeover" in kinds
    for step in ("deploy.step_started", "deploy.step_done", "deploy.final"):
        assert step in kinds
