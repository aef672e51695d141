"""Deploy and rollback end to end: real sshd → pct stand-in → demo host running the simulated sglang server.

Every test gets its own demo host (a pristine sglang 0.5.9 tree from PyPI) inside container 129.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from dynctl import deploy as core
from dynctl import events
from dynctl.cli.common import open_host
from dynctl.errors import OperationFailed, PreflightError
from dynctl.sim.hostsetup import prepare_demo_host
from dynctl.transport import close_all
from sglang_trees import sglang_wheel

CTID = 129
POLICY = "srt/speculative/spec_batch_threshold.py"
SERVER_ARGS = "srt/server_args.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def demo_template(tmp_path_factory) -> dict[str, Path]:
    """A prepared demo host per sglang version, copied for each test (pip runs once per session)."""
    made: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in made:
            root = tmp_path_factory.mktemp(f"demo-template-{version}")
            prepare_demo_host(root / "demo", sglang_version=version, cache_dir=sglang_wheel(version).parent)
            made[version] = root / "demo"
        return made[version]

    return get  # type: ignore[return-value]


@pytest.fixture
def box(sshd, demo_template, tmp_path):
    """A config whose host `box` is a demo host inside pct container 129 on the test sshd."""
    ct_root = sshd.make_ct(CTID)

    def make(version: str = "0.5.9", **env: str) -> Path:
        root = ct_root / f"demo-{tmp_path.name}"
        shutil.copytree(demo_template(version), root, symlinks=True)
        entry = prepare_demo_host(root, sglang_version=version, port=free_port(),
                                  cache_dir=sglang_wheel(version).parent, time_scale=20)
        entry["env"].update(env)
        entry.update(ssh=sshd.target, pct=CTID)
        return sshd.write_config(tmp_path / "dynctl.toml", {"box": entry}, default_host="box")

    yield make
    close_all()
    stop_config = tmp_path / "dynctl.toml"
    if stop_config.exists():
        dynctl("stop", "--yes", "--grace", "5", config=stop_config)


def dynctl(*args: str, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynctl", *args, "--config", str(config)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)


def session(config: Path):
    return open_host(None, str(config))


def server_info(config: Path) -> dict:
    s = session(config)
    return s.agent.call("server_info")["info"]


def server_pid(config: Path) -> int | None:
    return session(config).agent.call("server_find").get("pid")


def tree_hashes(config: Path) -> dict[str, str]:
    s = session(config)
    site = Path(s.host.env["PYTHONPATH"]) / "sglang"
    return {str(p.relative_to(site)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(site.joinpath("srt").rglob("*.py"))}


def start_baseline(config: Path) -> int:
    proc = dynctl("start", "--yes", config=config)
    assert proc.returncode == 0, proc.stderr
    pid = server_pid(config)
    assert pid
    return pid


def with_text(dplan: core.DeployPlan, path: str, text: str) -> None:
    for f in dplan.files:
        if f["path"] == path:
            f["text"] = text
            f["sha256_after"] = hashlib.sha256(text.encode()).hexdigest()
            return
    raise AssertionError(f"{path} is not in the plan")


def test_deploy_and_rollback_happy_path(box):
    config = box()
    pristine = tree_hashes(config)
    start_baseline(config)

    dry = dynctl("deploy", "--threshold", "5", "--dry-run", config=config)
    assert dry.returncode == 0, dry.stderr
    assert "+++ b/sglang/srt/server_args.py" in dry.stdout
    assert "--speculative-disable-batch-threshold 5" in dry.stdout
    assert tree_hashes(config) == pristine  # the dry run changed nothing

    out = dynctl("deploy", "--threshold", "5", "--yes", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "threshold 5 in force" in out.stdout
    info = server_info(config)
    assert info["internal_states"][0]["speculative_disable_batch_threshold"] == 5
    assert tree_hashes(config) != pristine

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
    assert tree_hashes(config) == pristine
    assert "speculative_disable_batch_threshold" not in (server_info(config)["internal_states"][0])

    twice = dynctl("rollback", "--yes", config=config)
    assert twice.returncode == 0 and "already on baseline" in twice.stdout
    assert tree_hashes(config) == pristine


def test_missing_comma_is_refused_before_the_server_is_touched(box):
    """The seed's failure: exit 3 before the old server is stopped; a client sees no failed request."""
    config = box()
    pid = start_baseline(config)
    pristine = tree_hashes(config)
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
        with pytest.raises(PreflightError) as info:
            core.deploy(s.agent, dplan, ready_timeout=60)
    finally:
        done.set()
        t.join()
    message = str(info.value)
    assert "server_args.py" in message and "does not compile" in message and "line" in message
    assert info.value.exit_code == 3
    assert failures == [] and served > 0
    assert server_pid(config) == pid
    assert tree_hashes(config) == pristine
    assert core.list_releases(s.agent) == []


def test_crash_on_start_rolls_back_to_the_serving_release(box):
    config = box()
    old = start_baseline(config)
    pristine = tree_hashes(config)
    s = session(config)
    dplan = core.plan_deploy(s.agent, s.host, 5)
    policy = next(f["text"] for f in dplan.files if f["path"] == POLICY)
    with_text(dplan, POLICY, policy + "\nraise RuntimeError('patched module fails at import')\n")
    seen: list[events.Event] = []
    with pytest.raises(OperationFailed) as info:
        core.deploy(s.agent, dplan, seen.append, ready_timeout=60)
    assert "rolled back to baseline, which is serving again" in str(info.value)
    assert any(isinstance(e, events.Failed) and any("patched module fails" in ln for ln in e.log_tail)
               for e in seen)
    assert tree_hashes(config) == pristine
    new = server_pid(config)
    assert new and new != old
    r = httpx.post(f"http://127.0.0.1:{s.host.port}/generate",
                   json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    assert r.status_code == 200


def test_hang_on_start_times_out_and_rolls_back(box):
    config = box()
    start_baseline(config)
    pristine = tree_hashes(config)
    s = session(config)
    dplan = core.plan_deploy(s.agent, s.host, 5)
    policy = next(f["text"] for f in dplan.files if f["path"] == POLICY)
    with_text(dplan, POLICY, policy + "\nimport time\ntime.sleep(3600)\n")
    with pytest.raises(OperationFailed) as info:
        core.deploy(s.agent, dplan, ready_timeout=4, grace=5)
    assert "not ready within 4s" in str(info.value) and "rolled back" in str(info.value)
    assert tree_hashes(config) == pristine
    assert server_info(config) is not None


def test_second_operation_is_refused_naming_the_first(box):
    config = box()
    start_baseline(config)
    s = session(config)
    dplan = core.plan_deploy(s.agent, s.host, 5)
    policy = next(f["text"] for f in dplan.files if f["path"] == POLICY)
    with_text(dplan, POLICY, policy + "\nimport time\ntime.sleep(3600)\n")
    first: list[events.Event] = []
    started = threading.Event()

    def record(e: events.Event) -> None:
        first.append(e)
        if isinstance(e, events.StepStarted) and e.step == "health":
            started.set()

    errors: list[Exception] = []

    def run() -> None:
        try:
            core.deploy(s.agent, dplan, record, ready_timeout=20, grace=5)
        except Exception as err:  # noqa: BLE001 - the first deploy is expected to fail and roll back
            errors.append(err)

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(120)
    second = dynctl("deploy", "--threshold", "7", "--yes", config=config)
    t.join()
    assert second.returncode == 3
    assert "host is busy: deploy by" in second.stderr
    assert errors and "rolled back" in str(errors[0])


@pytest.mark.parametrize("step", ["switch", "stop", "health"])
def test_connection_cut_mid_deploy_converges(box, sshd, step):
    """The worker runs on the host: cutting SSH at any step leaves it to finish, and the client catches up."""
    config = box()
    start_baseline(config)
    s = session(config)
    dplan = core.plan_deploy(s.agent, s.host, 5)
    cut = threading.Event()

    def on_event(e: events.Event) -> None:
        if isinstance(e, events.StepStarted) and e.step == step and not cut.is_set():
            cut.set()
            sshd.server.drop_connections()

    result = core.deploy(s.agent, dplan, on_event, ready_timeout=60)
    assert cut.is_set()
    assert result["threshold_in_force"] == 5
    assert server_info(config)["internal_states"][0]["speculative_disable_batch_threshold"] == 5
    again = dynctl("deploy", "--threshold", "5", "--yes", config=config)
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_decoy_and_second_server_are_untouched(box, tmp_path):
    config = box()
    start_baseline(config)
    decoy = subprocess.Popen([sys.executable, "-c", "import sys,time; time.sleep(600)", "-m", "sglang.launch_server"],
                             start_new_session=True)
    other_port = free_port()
    s = session(config)
    other = subprocess.Popen([sys.executable, "-m", "dynctl.sim", "--time-scale", "20", "--model-path", "/m",
                              "--port", str(other_port)], env=dict(os.environ, PYTHONPATH=s.host.env["PYTHONPATH"]),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        out = dynctl("deploy", "--threshold", "5", "--yes", config=config)
        assert out.returncode == 0, out.stderr
        back = dynctl("rollback", "--yes", config=config)
        assert back.returncode == 0, back.stderr
        for proc in (decoy, other):
            assert proc.poll() is None
            assert psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE
    finally:
        for proc in (decoy, other):
            proc.kill()
            proc.wait()


def test_foreign_process_on_the_port_is_refused_and_left_alone(box):
    config = box()
    s = session(config)
    with socket.socket() as foreign:
        foreign.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        foreign.bind(("127.0.0.1", s.host.port))
        foreign.listen()
        out = dynctl("deploy", "--threshold", "5", "--yes", config=config)
        assert out.returncode == 3, out.stdout + out.stderr
        assert f"port {s.host.port} is held by pid {os.getpid()}" in out.stderr
        assert core.list_releases(s.agent) == []


def test_native_strategy_deploy_touches_no_file(box):
    config = box("0.5.14")
    pristine = tree_hashes(config)
    start_baseline(config)
    out = dynctl("deploy", "--threshold", "8", "--yes", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert tree_hashes(config) == pristine
    info = server_info(config)
    assert info["speculative_adaptive"] is True
    assert info["speculative_adaptive_config"].endswith("adaptive.json")
    live = dynctl("threshold", "4", "--yes", config=config)
    assert live.returncode == 3 and "restart is needed" in live.stderr
    back = dynctl("rollback", "--yes", config=config)
    assert back.returncode == 0, back.stderr
    assert not server_info(config).get("speculative_adaptive")
