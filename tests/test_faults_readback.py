"""Faults around what dynctl reports as read back: the native threshold after the CUDA-graph padding, a status
for a server that reports no threshold, a live threshold change while another operation holds the host, an
unreadable release record, the patch's own module left behind by a reinstall, and servers that require an API
key. The demo host (the simulated sglang server on real sglang trees from PyPI), the real agent, real processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from demo_box import dynctl, server_info, session, start_baseline, tree_sha256
from dynctl.core import deploy as core
from polling import wait_for

pytestmark = pytest.mark.slow


def workdir(config: Path) -> Path:
    return Path(session(config).host.workdir)


def in_force(config: Path):
    states = (server_info(config) or {}).get("internal_states") or [{}]
    return states[0].get("speculative_disable_batch_threshold")


# --------------------------------------------------------------------------- the live threshold and the host lock


def test_status_reads_the_live_threshold_back_from_a_server_slow_to_answer(demo_box):
    """sglang's /server_info asks the scheduler, which answers between two steps; a long step holds the answer
    longer than a live view's sample lasts. A one-shot status waits for it: after a live change on an idle
    server the gauge still shows the threshold of the last decode step, so only /server_info has the new one."""
    config = demo_box(via="local", DYNCTL_SIM_SLOW_SERVER_INFO="0.8")
    start_baseline(config)
    out = dynctl("deploy", "--threshold", "5", "--yes", "--ready-timeout", "30", "--soak", "0", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    live = dynctl("threshold", "3", "--yes", config=config)
    assert live.returncode == 0 and "threshold 3 in force" in live.stdout, live.stdout + live.stderr
    status = dynctl("status", "--json", config=config)
    assert status.returncode == 0, status.stdout + status.stderr
    server = json.loads(status.stdout)["server"]
    assert server["threshold"] == 3 and server["sources"]["threshold"]["source"] == "/server_info"
    shown = dynctl("status", config=config)
    assert any(line.split()[:2] == ["threshold", "3"] and "(from /server_info" in line
               for line in shown.stdout.splitlines()), shown.stdout



def test_a_live_threshold_change_during_a_deploy_is_refused_naming_the_deploy(demo_box):
    config = demo_box(via="local")
    start_baseline(config)
    host = session(config)
    deployed: dict = {}

    def deploy() -> None:
        agent = session(config).agent
        deployed.update(core.deploy(agent, core.plan_deploy(agent, host.host, 5), ready_timeout=60, soak=20))

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

    back = dynctl("rollback", "--yes", "--json", "--soak", "0", config=config)
    assert back.returncode == 0, back.stdout + back.stderr
    result = json.loads(back.stdout)
    assert result["changed"] is True and result["reverted"] == [release]
    assert tree_sha256(config) == pristine
    again = dynctl("rollback", "--yes", "--json", config=config)
    assert again.returncode == 0 and json.loads(again.stdout)["changed"] is False


# --------------------------------------------------------------------------- the native threshold after padding


def test_a_native_threshold_that_padding_moves_is_reported_as_the_server_enforces_it(demo_box):
    """9 is no CUDA-graph batch size: sglang pads a batch of 9 to 10, so the config's cut is at 8."""
    config = demo_box("0.5.14", via="local", strategy="native")
    start_baseline(config)
    dry = dynctl("deploy", "--threshold", "9", "--dry-run", "--json", config=config)
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert planned["threshold"] == 9 and planned["effective_threshold"] == 8

    out = dynctl("deploy", "--threshold", "9", "--yes", "--soak", "0", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    said = " ".join(out.stdout.split())
    assert "threshold 8 in force (read back from /server_info, 9 requested" in said
    assert "threshold 9 in force" not in said
    info = server_info(config)
    assert info["cuda_graph_config"]["decode"]["bs"][:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]
    config_file = json.loads(Path(info["speculative_adaptive_config"]).read_text())
    assert config_file == {"1": {"candidate_steps": [3]}, "9": {"candidate_steps": [0]}}

    release = json.loads(dynctl("releases", "--json", config=config).stdout)[0]
    assert release["threshold"] == 9 and release["effective_threshold"] == 8
    status = json.loads(dynctl("status", "--json", config=config).stdout)
    assert status["server"]["threshold"] == 8 and status["server"]["release_threshold"] == 8


def test_a_native_server_whose_config_file_says_otherwise_is_read_as_it_is(demo_box):
    """The live view derives the cut from the config file the server names, not from the release record."""
    config = demo_box("0.5.14", via="local", strategy="native")
    start_baseline(config)
    assert dynctl("deploy", "--threshold", "16", "--yes", "--soak", "0", config=config).returncode == 0
    path = Path(server_info(config)["speculative_adaptive_config"])
    path.write_text(json.dumps({"1": {"candidate_steps": [3]}, "5": {"candidate_steps": [0]}}))
    status = json.loads(dynctl("status", "--json", config=config).stdout)
    assert status["server"]["threshold"] == 4 and status["server"]["release_threshold"] == 16


# --------------------------------------------------------------------------- status: live values only


def test_status_shows_no_threshold_for_a_server_that_reports_none(demo_box):
    """A release recorded threshold 7, but the server runs code loaded before it (not restarted)."""
    config = demo_box(via="local")
    start_baseline(config)
    applied = dynctl("patch", "apply", "--threshold", "7", "--yes", config=config)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert in_force(config) is None
    status = json.loads(dynctl("status", "--json", config=config).stdout)
    assert status["server"]["state"] == "ready"
    assert status["server"]["threshold"] is None and status["server"]["release_threshold"] == 7
    shown = subprocess.run([sys.executable, "-m", "dynctl", "status", "--config", str(config)], capture_output=True,
                           text=True, env=dict(os.environ, COLUMNS="200"), timeout=120)
    line = next(l for l in shown.stdout.splitlines() if l.startswith("threshold"))
    assert "none reported by /server_info" in line and "recorded 7" in line


def test_status_says_the_threshold_is_unknown_when_server_info_does_not_answer(demo_box):
    """Not "none reported": a server that never answered /server_info in the status's wait reported nothing."""
    config = demo_box(via="local", DYNCTL_SIM_SLOW_SERVER_INFO="6")
    start_baseline(config)
    status = json.loads(dynctl("status", "--json", config=config).stdout)
    assert status["server"]["state"] == "ready" and status["server"]["threshold"] is None
    shown = subprocess.run([sys.executable, "-m", "dynctl", "status", "--config", str(config)], capture_output=True,
                           text=True, env=dict(os.environ, COLUMNS="200"), timeout=120)
    line = next(l for l in shown.stdout.splitlines() if l.startswith("threshold"))
    assert "unknown: /server_info did not answer" in line and "none reported" not in line


def test_a_deploy_whose_new_server_never_answers_server_info_is_rolled_back(demo_box):
    """Ready (/health_generate and a /generate answered) but silent on /server_info: the threshold cannot be
    read back, so it is not reported in force; the previous release serves again and the exit says failed."""
    config = demo_box(via="local", DYNCTL_SIM_SLOW_SERVER_INFO="8")
    start_baseline(config)
    out = dynctl("deploy", "--threshold", "5", "--yes", "--ready-timeout", "60", "--soak", "0", config=config)
    said = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 1, said
    assert "/server_info did not answer within 5 s after the server became ready" in said
    assert "rolled back to baseline, which is serving again" in said and "threshold 5 in force" not in said
    status = json.loads(dynctl("status", "--json", config=config).stdout)
    assert status["server"]["state"] == "ready" and status["server"]["release"] is None


# --------------------------------------------------------------------------- an unreadable release record


@pytest.mark.parametrize("damage", ["garbage", "removed", "other release"])
def test_an_unreadable_record_of_the_release_in_force_is_a_preflight_refusal(demo_box, damage):
    config = demo_box(via="local")
    start_baseline(config)
    deployed = dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    patched = tree_sha256(config)
    release = session(config).agent.call("releases")["current"]
    manifest = workdir(config) / "releases" / release / "manifest.json"
    if damage == "garbage":
        manifest.write_text('{"id": "' + release + '", "files": [')
    elif damage == "removed":
        manifest.unlink()
    else:
        manifest.write_text(json.dumps({"id": "0007-20260101T000000Z", "files": []}))

    for argv in (["rollback", "--yes"], ["deploy", "--threshold", "7", "--yes"], ["patch", "revert", "--yes"],
                 ["restart", "--yes"]):
        refused = dynctl(*argv, config=config)
        said = " ".join(refused.stderr.split())
        assert refused.returncode == 3, (argv, refused.stdout + refused.stderr)
        assert f"the record of release {release}" in said and str(manifest) in said, said
        assert str(manifest.parent / "orig") in said and "nothing was changed" in said
        assert tree_sha256(config) == patched
    assert in_force(config) == 5  # the server was not touched either


def test_a_release_directory_without_a_record_below_a_later_release_is_refused(demo_box):
    config = demo_box(via="local")
    start_baseline(config)
    assert dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config).returncode == 0
    assert dynctl("deploy", "--threshold", "7", "--yes", "--soak", "0", config=config).returncode == 0
    first = json.loads(dynctl("releases", "--json", config=config).stdout)[-1]["id"]
    (workdir(config) / "releases" / first / "manifest.json").unlink()
    refused = dynctl("rollback", "--yes", config=config)
    assert refused.returncode == 3 and f"the record of release {first}" in " ".join(refused.stderr.split())
    assert in_force(config) == 7


# --------------------------------------------------------------------------- the patch's module after a reinstall

MODULE = "srt/speculative/spec_batch_threshold.py"


def pip_install(wheel: Path, prefix: Path, *extra: str) -> Path:
    """Install the sglang wheel as pip does into a site-packages (pip sees it there, so a reinstall uninstalls
    the files its RECORD lists first and leaves any other file in the package alone)."""
    site = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-compile",
                    "--disable-pip-version-check", "--prefix", str(prefix), *extra, str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300,
                   env=dict(os.environ, PYTHONPATH=str(site)))
    return site


@pytest.fixture
def reinstalled_box(tmp_path):
    """A real sglang 0.5.9 install, patched by dynctl, then `pip install --force-reinstall`ed over."""
    from sglang_trees import sglang_wheel

    from dynctl.agent.client import AgentClient
    from dynctl.base.config import HostConfig
    from dynctl.transport.local import Local

    wheel = sglang_wheel("0.5.9")
    site = pip_install(wheel, tmp_path / "prefix")
    host = HostConfig(name="box", python=sys.executable, workdir=str(tmp_path / "wd"), env={"PYTHONPATH": str(site)})
    agent = AgentClient(Local(), host)
    return agent, site, lambda: pip_install(wheel, tmp_path / "prefix", "--force-reinstall")


def test_a_reinstall_over_a_patched_tree_leaves_dynctls_module_which_the_next_apply_takes_in(reinstalled_box):
    from dynctl.patching.host import apply_plan, plan_for_apply, read_patch_state, revert

    agent, site, reinstall = reinstalled_box
    pristine = tree_sha256(site)
    apply_plan(agent, plan_for_apply(read_patch_state(agent)), threshold=5)
    patched = tree_sha256(site)
    module = site / "sglang" / MODULE
    shipped = module.read_bytes()
    reinstall()
    assert module.read_bytes() == shipped  # pip kept the file its RECORD does not list
    after_reinstall = tree_sha256(site)
    assert after_reinstall not in (pristine, patched)

    state = read_patch_state(agent)
    assert state.status == "not applied", state.detail
    plan = plan_for_apply(state)
    assert plan.leftover == MODULE and MODULE in plan.message
    result = apply_plan(agent, plan, threshold=5)
    assert tree_sha256(site) == patched
    release_dir = Path(result["release_dir"])
    assert (release_dir / "orig" / MODULE).read_bytes() == shipped  # backed up like every file it replaces

    revert(agent)
    assert tree_sha256(site) == after_reinstall  # the tree as before this apply, the leftover included


def test_an_earlier_dynctls_module_is_replaced_and_restored_byte_for_byte(reinstalled_box):
    from dynctl.patching.host import apply_plan, plan_for_apply, read_patch_state, revert

    agent, site, _ = reinstalled_box
    module = site / "sglang" / MODULE
    older = module
    from dynctl.patching.recipe import new_module_text

    header = new_module_text().split("\n", 1)[0]
    old_text = header + "\n\n`--speculative-disable-batch-threshold N` (an earlier dynctl's module)\n\"\"\"\nX = 1\n"
    older.write_text(old_text)
    before = tree_sha256(site)
    applied = apply_plan(agent, plan_for_apply(read_patch_state(agent)), threshold=5)
    assert module.read_text() == new_module_text()
    assert (Path(applied["release_dir"]) / "orig" / MODULE).read_text() == old_text
    revert(agent)
    assert tree_sha256(site) == before and module.read_text() == old_text


def test_a_module_at_that_path_that_is_not_dynctls_is_refused_naming_it(reinstalled_box):
    from dynctl.base.errors import PreflightError
    from dynctl.patching.host import plan_for_apply, read_patch_state

    agent, site, _ = reinstalled_box
    (site / "sglang" / MODULE).write_text("# someone else's module\n")
    before = tree_sha256(site)
    with pytest.raises(PreflightError, match=f"{MODULE} is in the sglang package.*not the module dynctl adds"):
        plan_for_apply(read_patch_state(agent))
    assert tree_sha256(site) == before


# --------------------------------------------------------------------------- servers that require an API key

KEY, ADMIN_KEY = "sk-test-9f2c41", "sk-admin-77ab03"


def with_server_args(config: Path, *extra: str) -> None:
    """Add launch flags to the demo host's configured `args` (a TOML array of strings)."""
    lines = config.read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("args = "))
    args = json.loads(lines[i][len("args = "):]) + list(extra)
    lines[i] = "args = " + json.dumps(args)
    config.write_text("\n".join(lines) + "\n")


def secrets_in(folder: Path) -> list[str]:
    """Files under `folder` that hold a key in the clear, other than the records a restart needs (the
    operation requests, the release manifests and the pidfile carry the argv to run; all 0600) and the
    server's own log (sglang logs its server_args, key included)."""
    needed = {"server.json", "manifest.json", "server.log"}
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and path.name not in needed and not (path.parent.name == "ops" and path.suffix == ".json"):
            data = path.read_bytes()
            if KEY.encode() in data or ADMIN_KEY.encode() in data:
                found.append(str(path.relative_to(folder)))
    return found


@pytest.mark.parametrize("spelling", ["separate", "equals"])
def test_a_server_that_requires_an_api_key_is_deployed_checked_and_changed_live(demo_box, spelling):
    config = demo_box(via="local")
    if spelling == "separate":
        with_server_args(config, "--api-key", KEY, "--admin-api-key", ADMIN_KEY)
    else:
        with_server_args(config, f"--api-key={KEY}", f"--admin-api-key={ADMIN_KEY}")
    start_baseline(config)
    info = session(config).host
    port = info.port
    import httpx

    # the simulator refuses what sglang refuses: no key, the wrong key, the API key for an admin endpoint
    assert httpx.get(f"http://127.0.0.1:{port}/server_info").status_code == 401
    assert httpx.post(f"http://127.0.0.1:{port}/generate", json={"text": "hi"}).status_code == 401
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    assert httpx.post(f"http://127.0.0.1:{port}/set_internal_state", json={"server_args": {}},
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 401

    dry = dynctl("deploy", "--threshold", "5", "--dry-run", config=config)
    assert dry.returncode == 0 and KEY not in dry.stdout and ADMIN_KEY not in dry.stdout
    assert "--api-key" in dry.stdout and "***" in dry.stdout
    out = dynctl("deploy", "--threshold", "5", "--yes", "--ready-timeout", "30", "--soak", "0", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "threshold 5 in force" in out.stdout
    assert KEY not in out.stdout + out.stderr and ADMIN_KEY not in out.stdout + out.stderr
    assert in_force(config) == 5

    live = dynctl("threshold", "3", "--yes", config=config)  # /set_internal_state takes the admin key
    assert live.returncode == 0 and "threshold 3 in force" in live.stdout, live.stdout + live.stderr
    status = dynctl("status", "--json", config=config)
    assert status.returncode == 0 and json.loads(status.stdout)["server"]["threshold"] == 3
    assert KEY not in status.stdout
    back = dynctl("rollback", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0 and "rolled back" in back.stdout, back.stdout + back.stderr
    follow = dynctl("ops", "follow", config=config)
    assert KEY not in follow.stdout + follow.stderr
    assert secrets_in(workdir(config)) == []


def test_the_api_key_alone_also_opens_the_admin_endpoints(demo_box):
    config = demo_box(via="local")
    with_server_args(config, "--api-key", KEY)
    start_baseline(config)
    deployed = dynctl("deploy", "--threshold", "5", "--yes", "--ready-timeout", "30", "--soak", "0", config=config)
    assert deployed.returncode == 0
    live = dynctl("threshold", "2", "--yes", config=config)
    assert live.returncode == 0 and "threshold 2 in force" in live.stdout, live.stdout + live.stderr
    assert secrets_in(workdir(config)) == []
