"""Faults around what dynctl reports as read back: the native threshold after the CUDA-graph padding, a status
for a server that reports no threshold, a live threshold change while another operation holds the host, an
unreadable release record, the patch's own module left behind by a reinstall, and servers that require an API
key. The demo host (the simulated sglang server on real sglang trees from PyPI), the real agent, real processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from demo_box import dynctl, server_info, session, start_baseline, tree_sha256
from dynctl import deploy as core
from polling import wait_for

pytestmark = pytest.mark.slow


def workdir(config: Path) -> Path:
    return Path(session(config).host.workdir)


def in_force(config: Path):
    states = (server_info(config) or {}).get("internal_states") or [{}]
    return states[0].get("speculative_disable_batch_threshold")


# --------------------------------------------------------------------------- the live threshold and the host lock


def test_a_live_threshold_change_during_a_deploy_is_refused_naming_the_deploy(demo_box):
    config = demo_box(via="local")
    start_baseline(config)
    host = session(config)
    deployed: dict = {}

    def deploy() -> None:
        agent = session(config).agent
        deployed.update(core.deploy(agent, core.plan_deploy(agent, host.host, 5), ready_timeout=60, soak=6))

    worker = threading.Thread(target=deploy)
    worker.start()
    try:
        wait_for(lambda: (host.agent.call("op_current")["holder"] or {}).get("operation") == "deploy"
                 and in_force(config) == 5, timeout=60, what="the deploy's soak")
        live = dynctl("threshold", "2", "--yes", config=config)
    finally:
        worker.join(120)
    assert live.returncode == 3, live.stdout + live.stderr
    said = " ".join(live.stderr.split())
    assert "host is busy: deploy" in said
    assert deployed["threshold_in_force"] == 5 and in_force(config) == 5
    after = dynctl("threshold", "2", "--yes", config=config)  # the host is free again
    assert after.returncode == 0 and "threshold 2 in force" in after.stdout
    assert in_force(config) == 2


# --------------------------------------------------------------------------- rollback of an interrupted release


def test_rollback_json_says_changed_after_reverting_an_interrupted_release(demo_box):
    config = demo_box(via="local")
    pristine = tree_sha256(config)
    start_baseline(config)
    applied = dynctl("patch", "apply", "--threshold", "5", "--yes", config=config)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert tree_sha256(config) != pristine
    release = session(config).agent.call("releases")["current"]
    manifest = workdir(config) / "releases" / release / "manifest.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), state="applying")))

    back = dynctl("rollback", "--yes", "--json", config=config)
    assert back.returncode == 0, back.stdout + back.stderr
    result = json.loads(back.stdout)
    assert result["changed"] is True and result["reverted"] == [release]
    assert tree_sha256(config) == pristine
    again = dynctl("rollback", "--yes", "--json", config=config)
    assert again.returncode == 0 and json.loads(again.stdout)["changed"] is False
