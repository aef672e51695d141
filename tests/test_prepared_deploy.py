"""A deploy started prepared (as a rolling deploy starts it while the gateway drains the host), on a demo host
over the real sshd: it changes nothing until its go, ends by itself, not started, when no go comes, and runs
the whole deploy once it does."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from demo_box import server_pid, session, start_baseline, tree_sha256
from polling import wait_for
from sglang_trees import install_sglang
from sshd_harness import free_port

from dynctl.agent.client import AgentClient, AgentError
from dynctl.base import events
from dynctl.base.config import HostConfig
from dynctl.base.errors import PreflightError
from dynctl.core import deploy as core
from dynctl.core import operations
from dynctl.patching.host import plan_for_apply, read_patch_state
from dynctl.patching.recipe import NEW_MODULE
from dynctl.transport.local import Local

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
    first = core.prepare(box.agent, plan, 120.0, taken_back.append)
    wait_for(first.cue.is_set, 60, "the first deploy prepared")
    first.cancel()
    assert first.ended.is_set() and isinstance(first.error, PreflightError), first.error
    assert "cancelled by" in str(first.error) and "nothing was changed" in str(first.error)

    seen: list = []
    second = core.prepare(box.agent, plan, 120.0, seen.append)
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


# --------------------------------------------------------------------------- the import check, ahead of the switch

# sglang's own launch_server needs torch, which this machine lacks: a stand-in that imports the module the
# patch adds (it exists only as a candidate until the switch) and lists the flag it defines
LAUNCH_STAND_IN = ("from sglang.srt.speculative import spec_batch_threshold as m\n"
                   "print('--' + m.ARG_NAME.replace('_', '-'))\n")


def tree_files(site: Path) -> dict[str, str]:
    """Every file under the site (bytecode caches included), with its sha256."""
    return {str(p.relative_to(site)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(site.rglob("*")) if p.is_file()}


def bare_box(tmp_path: Path) -> tuple[AgentClient, Path, list[dict]]:
    """An sglang 0.5.9 tree with the stand-in launch_server, no server: the agent on this machine, the site, and
    the patch's files for it."""
    site = tmp_path / "site"
    package = install_sglang("0.5.9", site, only=("sglang/srt/server_args.py", "sglang/srt/managers/",
                                                   "sglang/srt/speculative/"))
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(LAUNCH_STAND_IN)
    host = HostConfig(name="box", python=sys.executable, workdir=str(tmp_path / "wd"), port=free_port(),
                      env={"PYTHONPATH": str(site)})
    agent = AgentClient(Local(), host)
    return agent, site, plan_for_apply(read_patch_state(agent)).files_for_agent()


def deploy_params(files: list[dict], go_within: float) -> dict:
    return {"files": files, "sglang_version": "0.5.9", "strategy": "patch", "threshold": 5,
            "launch_argv": [sys.executable, "-c", "pass"], "baseline_argv": [sys.executable, "-c", "pass"],
            "go_within": go_within}


def test_the_import_check_runs_on_the_candidates_before_the_go_and_leaves_the_tree_untouched(tmp_path):
    agent, site, files = bare_box(tmp_path)
    before = tree_files(site)
    handle = operations.Prepared(agent, "deploy", deploy_params(files, 60.0), 60.0)
    try:
        wait_for(handle.cue.is_set, 60, "the deploy prepared")
        assert not handle.ended.is_set(), handle.error
        assert tree_files(site) == before  # no candidate, no bytecode: the check imported the texts from the workdir
    finally:
        handle.cancel()
    checks = [r for r in journal(tmp_path / "wd") if r["event"] == "patch.import_check.ahead"]
    assert [(c["ran"], c["ok"], c["detail"]) for c in checks] == [
        (True, True, "launch_server --help lists --speculative-disable-batch-threshold")]
    assert tree_files(site) == before


def test_a_candidate_that_breaks_sglangs_start_is_refused_before_the_go(tmp_path):
    agent, site, files = bare_box(tmp_path)
    [new] = [f for f in files if f["path"] == NEW_MODULE]
    new["text"] += "\nraise RuntimeError('this candidate breaks at import')\n"
    new["sha256_after"] = hashlib.sha256(new["text"].encode()).hexdigest()
    before = tree_files(site)
    with pytest.raises(PreflightError, match=r"the patched sglang would not start: .*spec_batch_threshold.py line "
                                             r"\d+: RuntimeError: this candidate breaks at import; nothing was "
                                             r"changed"):
        operations.execute(agent, "deploy", deploy_params(files, 1.0))  # a go it never gets
    assert tree_files(site) == before
    assert agent.call("op_current")["holder"] is None
