"""Deploy and rollback end to end: real sshd → pct stand-in → demo host running the simulated sglang server.

Every test gets its own demo host (a pristine sglang 0.5.9 tree from PyPI) inside container 129. The
failure scenarios of SPEC §9 (crash or hang on start, concurrent operators, decoys) are in test_faults.py.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from polling import wait_for
from demo_box import dynctl, server_info, server_pid, session, start_baseline, tree_sha256, with_text

from dynctl.core import deploy as core
from dynctl.base import events
from dynctl.base.errors import PreflightError

pytestmark = pytest.mark.slow

SERVER_ARGS = "srt/server_args.py"


def test_deploy_and_rollback_happy_path(demo_box):
    config = demo_box()
    pristine = tree_sha256(config)
    start_baseline(config)

    dry = dynctl("deploy", "--threshold", "5", "--dry-run", config=config)
    assert dry.returncode == 0, dry.stderr
    assert "+++ b/sglang/srt/server_args.py" in dry.stdout
    assert "--speculative-disable-batch-threshold 5" in dry.stdout
    assert tree_sha256(config) == pristine  # the dry run changed nothing

    out = dynctl("deploy", "--threshold", "5", "--yes", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "threshold 5 in force" in out.stdout
    info = server_info(config)
    assert info["internal_states"][0]["speculative_disable_batch_threshold"] == 5
    assert tree_sha256(config) != pristine

    again = dynctl("deploy", "--threshold", "5", "--yes", config=config)
    assert again.returncode == 0 and "nothing to do" in again.stdout

    live = dynctl("threshold", "9", "--yes", config=config)
    assert live.returncode == 0 and "threshold 9 in force" in live.stdout
    assert server_info(config)["internal_states"][0]["speculative_disable_batch_threshold"] == 9

    releases = dynctl("releases", "--json", config=config)
    assert releases.returncode == 0 and '"threshold": 5' in releases.stdout

    back = dynctl("rollback", "--yes", config=config)
    assert back.returncode == 0, back.stdout + back.stderr
    assert "rolled back" in back.stdout and "baseline" in back.stdout
    assert tree_sha256(config) == pristine
    assert "speculative_disable_batch_threshold" not in (server_info(config)["internal_states"][0])

    twice = dynctl("rollback", "--yes", config=config)
    assert twice.returncode == 0 and "already on baseline" in twice.stdout
    assert tree_sha256(config) == pristine


def test_missing_comma_is_refused_before_the_server_is_touched(demo_box):
    """The seed's failure: exit 3 before the old server is stopped; a client sees no failed request."""
    config = demo_box()
    pid = start_baseline(config)
    pristine = tree_sha256(config)
    s = session(config)
    dplan = core.plan_deploy(s.agent, s.host, 5)
    text = next(f["text"] for f in dplan.files if f["path"] == SERVER_ARGS)
    anchor = '"--speculative-disable-batch-threshold",'
    assert anchor in text
    with_text(dplan, SERVER_ARGS, text.replace(anchor, anchor[:-1], 1))

    port = s.host.port
    failures: list[str] = []
    done = threading.Event()
    served = 0

    def client() -> None:
        nonlocal served
        with httpx.Client(timeout=30) as http:
            while not done.is_set():
                r = http.post(f"http://127.0.0.1:{port}/generate",
                              json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:100]}")
                served += 1

    t = threading.Thread(target=client)
    t.start()
    try:
        wait_for(lambda: served > 0, 30, "the first request served")
        with pytest.raises(PreflightError) as info:
            core.deploy(s.agent, dplan, ready_timeout=60)
        before = served
        wait_for(lambda: served > before, 30, "a request served after the refusal")
    finally:
        done.set()
        t.join()
    message = str(info.value)
    assert "server_args.py" in message and "does not compile" in message and "line" in message
    assert info.value.exit_code == 3
    assert failures == [] and served > 0
    assert server_pid(config) == pid
    assert tree_sha256(config) == pristine
    assert core.list_releases(s.agent) == []


@pytest.mark.parametrize("step", ["switch", "stop", "ready"])
def test_connection_cut_mid_deploy_converges(demo_box, sshd, step):
    """The worker runs on the host: cutting SSH at any step leaves it to finish, and the client catches up."""
    config = demo_box()
    start_baseline(config)
    s = session(config)
    dplan = core.plan_deploy(s.agent, s.host, 5)
    cut = threading.Event()

    def on_event(e: events.Event) -> None:
        if isinstance(e, events.StepStarted) and e.step == step and not cut.is_set():
            cut.set()
            sshd.server.drop_connections()

    result = core.deploy(s.agent, dplan, on_event, ready_timeout=60, soak=0)
    assert cut.is_set()
    assert result["threshold_in_force"] == 5
    assert server_info(config)["internal_states"][0]["speculative_disable_batch_threshold"] == 5
    again = dynctl("deploy", "--threshold", "5", "--yes", config=config)
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_native_strategy_deploy_touches_no_file(demo_box):
    config = demo_box("0.5.14", strategy="native")
    pristine = tree_sha256(config)
    start_baseline(config)
    out = dynctl("deploy", "--threshold", "8", "--yes", "--soak", "0", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert tree_sha256(config) == pristine
    info = server_info(config)
    assert info["speculative_adaptive"] is True
    assert info["speculative_adaptive_config"].endswith("adaptive.json")
    live = dynctl("threshold", "4", "--yes", config=config)
    assert live.returncode == 3 and "restart is needed" in live.stderr
    back = dynctl("rollback", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0, back.stderr
    assert not server_info(config).get("speculative_adaptive")


def test_auto_strategy_patches_0_5_14(demo_box):
    """0.5.14 has a patch variant, so `strategy = "auto"` (the default) patches it like 0.5.6-0.5.12."""
    config = demo_box("0.5.14", via="local")
    pristine = tree_sha256(config)
    start_baseline(config)
    dry = dynctl("deploy", "--threshold", "5", "--dry-run", config=config)
    assert dry.returncode == 0, dry.stderr
    assert "+++ b/sglang/srt/speculative/eagle_worker_v2.py" in dry.stdout
    assert "--speculative-disable-batch-threshold 5" in dry.stdout
    assert "adaptive.json" not in dry.stdout
    out = dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert tree_sha256(config) != pristine
    assert server_info(config)["internal_states"][0]["speculative_disable_batch_threshold"] == 5
    status = json.loads(dynctl("status", "--json", config=config).stdout)
    assert status["patch"]["strategy"] == "patch" and status["patch"]["status"] == "applied"
    back = dynctl("rollback", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0, back.stdout + back.stderr
    assert tree_sha256(config) == pristine


def test_a_native_deploy_moves_to_the_patch_when_the_release_takes_it_and_rolls_back_to_native(demo_box):
    """A 0.5.16 host deployed on the native route (as `strategy = "auto"` did before the variant was
    measured), then deployed again under "auto": the patch goes in and the adaptive flags come out; a
    rollback puts the native release back as it ran, and `--to baseline` the pristine server."""
    config = demo_box("0.5.16", via="local", strategy="native")
    pristine = tree_sha256(config)
    start_baseline(config)
    native = dynctl("deploy", "--threshold", "4", "--yes", "--soak", "0", config=config)
    assert native.returncode == 0, native.stdout + native.stderr
    assert tree_sha256(config) == pristine and server_info(config)["speculative_adaptive"] is True

    text = config.read_text()
    assert 'strategy = "native"\n' in text
    config.write_text(text.replace('strategy = "native"\n', ""))
    patched = dynctl("deploy", "--threshold", "4", "--yes", "--soak", "0", config=config)
    assert patched.returncode == 0, patched.stdout + patched.stderr
    info = server_info(config)
    assert tree_sha256(config) != pristine
    assert not info.get("speculative_adaptive") and not info.get("speculative_adaptive_config")
    assert info["internal_states"][0]["speculative_disable_batch_threshold"] == 4
    status = json.loads(dynctl("status", "--json", config=config).stdout)
    assert (status["patch"]["strategy"], status["patch"]["status"]) == ("patch", "applied")

    back = dynctl("rollback", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0, back.stdout + back.stderr
    info = server_info(config)
    assert tree_sha256(config) == pristine
    assert info["speculative_adaptive"] is True and info["speculative_adaptive_config"].endswith("adaptive.json")
    again = dynctl("rollback", "--to", "baseline", "--yes", "--soak", "0", config=config)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not server_info(config).get("speculative_adaptive") and tree_sha256(config) == pristine


def test_a_strategy_the_release_cannot_take_is_refused_before_the_host_changes(demo_box):
    config = demo_box("0.5.12", via="local", strategy="native")
    pristine = tree_sha256(config)
    out = dynctl("deploy", "--threshold", "5", "--yes", config=config)
    assert out.returncode == 3
    assert 'strategy = "native" cannot serve sglang 0.5.12' in " ".join(out.stderr.split())
    assert tree_sha256(config) == pristine
