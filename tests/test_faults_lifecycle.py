"""Faults around process ownership and truthful lifecycle answers (SPEC §2 exit codes, §5, §9).

Who runs on the port is decided once, on the host: ours (our pidfile, or an sglang launch listening on
the port), not ours (named, never signalled), or nobody. These tests put real processes in the way --
an sglang launcher that dynctl did not start and that does not listen, a foreign listener, a crashed
server's orphan -- and check that status, stop, start, restart, deploy and rollback all give the same
answer, never signal what is not ours, and exit with a code that tells what changed.

The first half runs the agent through a Local transport against tests/servers; the second half runs
the CLI through the real sshd and the `pct` stand-in against the demo host (simulated sglang server on
a real sglang tree), checking the sha256 of the whole sglang tree after each scenario.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import psutil
import pytest

from dynctl.core import deploy as core
from dynctl.base import events
from dynctl.core import lifecycle
from dynctl.agent.client import AgentError
from dynctl.base.errors import OperationFailed, PreflightError
from dynctl.live.server_status import sample_server
from dynctl_agent import servers
from lifecycle_harness import Box, alive, box, listening, make_box, wait_for  # noqa: F401 - box is a fixture
from sshd_harness import free_port
from demo_box import dynctl, server_info, server_pid, session, start_baseline, tree_sha256

pytestmark = pytest.mark.slow

# An sglang "launcher" that is loading (it never opens its port): what an operator started by hand, or
# another user's server on this machine. dynctl did not start it, so it must never signal it.
_LAUNCHER = "import time\nwhile True:\n    time.sleep(60)\n"


def fake_sglang(tmp: Path) -> Path:
    """A directory whose `sglang.launch_server` just loads forever (never listens)."""
    root = tmp / "stranger-site"
    (root / "sglang").mkdir(parents=True, exist_ok=True)
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "launch_server.py").write_text(_LAUNCHER)
    return root


def spawn_launcher(spawn, tmp: Path, argv_tail: list[str], module_flag: list[str] | None = None) -> subprocess.Popen:
    """`python3 -m sglang.launch_server <argv_tail>` in its own session, as if started with nohup."""
    flag = module_flag or ["-m", "sglang.launch_server"]
    env = dict(os.environ, PYTHONPATH=str(fake_sglang(tmp)))
    proc = spawn([sys.executable, *flag, *argv_tail], env=env, start_new_session=True)
    wait_for(lambda: "sglang.launch_server" in " ".join(psutil.Process(proc.pid).cmdline()), what="the launcher")
    return proc


def signals_sent(journal: list[dict]) -> list[int]:
    return [r["pid"] for r in journal if r["event"] == "stop.signal"]


# ---------------------------------------------------------------- a launcher found only by command line


@pytest.mark.parametrize("spelling", ["--port P", "--port=P", "-mmodule --port P", "no --port (30000)"])
def test_stop_refuses_a_launcher_found_only_by_its_command_line(tmp_path: Path, spelling: str):
    port = 30000 if spelling.startswith("no --port") else free_port()
    b = make_box(tmp_path / "b", port=port)
    try:
        tail = {"--port P": ["--port", str(port)], "--port=P": [f"--port={port}"],
                "-mmodule --port P": ["--port", str(port)], "no --port (30000)": []}[spelling]
        flag = ["-msglang.launch_server"] if spelling.startswith("-mmodule") else None
        stranger = spawn_launcher(b.spawn, tmp_path, ["--model-path", "/models/x", *tail], flag)

        state = lifecycle.find_server(b.agent)
        assert state.state == "down" and state.pid is None  # status: not ours, so no server
        assert stranger.pid in [p["pid"] for p in state.unmanaged]
        assert state.not_ours and state.not_ours["kind"] == "unmanaged"

        with pytest.raises(PreflightError, match=f"dynctl stop --pid") as err:
            lifecycle.stop_server(b.agent, grace=5, on_event=b.events.append)
        assert err.value.exit_code == 3
        assert alive(stranger.pid)
        assert stranger.pid not in signals_sent(b.journal())

        # start must not run a second server next to it (it will bind the port once loaded)
        with pytest.raises(AgentError, match="start refused: pid .* looks like an sglang server") as err:
            b.start()
        assert err.value.exit_code == 3 and b.pidfile() is None and alive(stranger.pid)
    finally:
        b.cleanup()


def test_only_an_explicit_pid_stops_a_launcher_that_dynctl_did_not_start(box: Box, tmp_path: Path):
    stranger = spawn_launcher(box.spawn, tmp_path, ["--port", str(box.port)])
    other = spawn_launcher(box.spawn, tmp_path / "o", ["--port", str(free_port())])  # another port: never
    state = lifecycle.find_server(box.agent)
    named = next(p for p in state.unmanaged if p["pid"] == stranger.pid)

    with pytest.raises(AgentError, match=f"pid {other.pid} .* is not an sglang server for port {box.port}") as err:
        lifecycle.stop_server(box.agent, grace=5, pid=other.pid)
    assert err.value.exit_code == 3 and alive(other.pid)
    with pytest.raises(AgentError, match="no longer the process that was confirmed"):
        lifecycle.stop_server(box.agent, grace=5, pid=stranger.pid, pid_start=named["start"] + 1)
    assert alive(stranger.pid)

    result = lifecycle.stop_server(box.agent, grace=5, pid=stranger.pid, pid_start=named["start"])
    assert result["stopped"] and result["pid"] == stranger.pid and result["source"] == "operator"
    assert stranger.wait(10) == -signal.SIGTERM
    assert alive(other.pid)


def test_stop_with_our_server_running_leaves_the_stranger_alone(box: Box, tmp_path: Path):
    pid = box.start_ready()["pid"]
    stranger = spawn_launcher(box.spawn, tmp_path, ["--port", str(box.port)])
    state = lifecycle.find_server(box.agent)
    assert (state.pid, state.source) == (pid, "pidfile") and state.not_ours["pid"] == stranger.pid
    result = lifecycle.stop_server(box.agent, grace=10)
    assert result["pid"] == pid and not alive(pid)
    assert alive(stranger.pid) and stranger.pid not in signals_sent(box.journal())
    # and restarting is refused up front: the stranger would take the port while ours loads
    # (restart runs as a host operation, whose refusal reaches the caller as the operation's error)
    with pytest.raises(PreflightError, match="restart refused") as err:
        lifecycle.restart_server(box.agent, box.argv(), grace=5, ready_timeout=30)
    assert err.value.exit_code == 3 and alive(stranger.pid) and box.pidfile()["stopped"]


# ---------------------------------------------------------------- status agrees with stop and deploy


def test_status_calls_a_foreign_listener_not_ours_and_down(box: Box):
    box.start_ready()
    lifecycle.stop_server(box.agent, grace=10)
    foreign = box.spawn([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(box.port)])
    wait_for(lambda: listening(box.port), what="the foreign listener")

    state = lifecycle.find_server(box.agent)
    snap = sample_server(box.agent)
    assert (state.state, state.pid) == ("down", None)
    assert (snap.state, snap.pid) == ("down", None)  # the TUI's watch stream says the same
    assert snap.not_ours and f"pid {foreign.pid}" in snap.not_ours and "http.server" in snap.not_ours
    assert snap.threshold is None and snap.running_reqs is None  # its HTTP is not our server's
    assert lifecycle.stop_server(box.agent, grace=5)["stopped"] is False and alive(foreign.pid)


def test_status_calls_a_crashed_servers_orphan_a_leftover_not_starting(box: Box):
    pid = box.start_ready("--orphan-port")["pid"]
    holder = box.children()["port-holder"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), what="the killed server to go")
    assert listening(box.port)

    state = lifecycle.find_server(box.agent)
    snap = sample_server(box.agent)
    assert (snap.state, snap.pid) == ("down", None)  # the watch stream used to call the orphan "starting"
    assert (state.state, state.pid) == ("down", None) and [p["pid"] for p in state.leftovers] == [holder]
    assert snap.leftovers == (holder,)
    assert snap.not_ours is None  # ours, to be swept: not a stranger

    result = lifecycle.stop_server(box.agent, grace=5, on_event=box.events.append)
    assert result["pid"] is None and [p["pid"] for p in result["swept"]] == [holder]
    done = [e for e in box.events if isinstance(e, events.StepDone) and e.step == "stop"][-1]
    assert "no server was running; swept 1 leftover" in done.detail and "None" not in done.detail


def test_status_of_an_unmanaged_launcher_is_down_and_names_it(box: Box, tmp_path: Path):
    stranger = spawn_launcher(box.spawn, tmp_path, ["--port", str(box.port)])
    snap = sample_server(box.agent)
    assert (snap.state, snap.pid) == ("down", None)
    assert snap.not_ours and f"pid {stranger.pid}" in snap.not_ours and "dynctl did not start it" in snap.not_ours


# ---------------------------------------------------------------- a start cut short between spawn and record


def cut_short(box: Box, rec: dict) -> None:
    """Leave the pidfile as an agent killed during its start leaves it: the record written ahead of the spawn."""
    (box.workdir / "server.json").write_text(json.dumps(servers.spawn_record(rec)))


def test_a_server_whose_start_was_cut_short_after_the_spawn_is_still_ours(box: Box):
    started = box.start_ready("--children")
    kids = box.children()
    rec = box.pidfile()
    cut_short(box, rec)

    state = lifecycle.find_server(box.agent)
    assert (state.state, state.pid, state.source) == ("ready", started["pid"], "pidfile")
    assert state.unmanaged == () and state.not_ours is None and state.leftovers == ()
    assert "spawning" in box.pidfile()  # status only reads

    again = box.start("--children")  # what the client sends again once its connection is back
    assert again["already_running"] and again["pid"] == started["pid"]
    done = box.pidfile()
    assert "spawning" not in done and done["found_by_marker"]
    assert {k: done[k] for k in ("pid", "pid_start", "pgid", "sid", "marker", "argv", "log_offset")} == \
        {k: rec[k] for k in ("pid", "pid_start", "pgid", "sid", "marker", "argv", "log_offset")}
    assert [r["pid"] for r in box.journal() if r["event"] == "start.found"] == [started["pid"]]

    result = lifecycle.stop_server(box.agent, grace=10, on_event=box.events.append)
    assert result["pid"] == started["pid"] and not alive(started["pid"])
    wait_for(lambda: not any(alive(p) for p in kids.values()), what="the server's children to be swept")


def test_a_start_cut_short_before_the_spawn_leaves_nothing_in_the_way(box: Box):
    box.start_ready()
    lifecycle.stop_server(box.agent, grace=10)
    rec = {k: v for k, v in box.pidfile().items() if k != "stopped"}
    cut_short(box, dict(rec, marker="0" * 32))  # a marker no process carries: the spawn never happened

    state = lifecycle.find_server(box.agent)
    assert (state.state, state.pid, state.not_ours, state.leftovers) == ("down", None, None, ())
    assert state.pidfile.startswith("spawning: no process of the start recorded at")
    ready = box.start_ready()
    assert ready["pid"] != rec["pid"] and alive(ready["pid"]) and "spawning" not in box.pidfile()


def test_the_children_of_a_cut_short_start_whose_launcher_died_are_swept_not_claimed(box: Box):
    started = box.start_ready("--children")
    kids = box.children()
    cut_short(box, box.pidfile())
    os.kill(started["pid"], signal.SIGKILL)
    wait_for(lambda: not alive(started["pid"]), what="the launcher to go")

    state = lifecycle.find_server(box.agent)  # the child that left for its own session is not the launcher
    assert (state.state, state.pid) == ("down", None)
    assert sorted(p["pid"] for p in state.leftovers) == sorted(kids.values()) and state.not_ours is None
    with pytest.raises(AgentError, match="processes of the previous server are still alive") as err:
        box.start("--children")
    assert err.value.exit_code == 3
    result = lifecycle.stop_server(box.agent, grace=5)
    assert sorted(p["pid"] for p in result["swept"]) == sorted(kids.values())
    assert not any(alive(p) for p in kids.values())


# ---------------------------------------------------------------- start / restart keep the release's argv


def test_start_and_restart_take_the_argv_of_the_release_in_force(box: Box):
    box.workdir.mkdir(parents=True, exist_ok=True)
    rel = "0001-20260101T000000Z"
    argv = box.argv("--tokens", "3")  # what "deploy" started: the release's recorded launch
    (box.workdir / "releases" / rel).mkdir(parents=True)
    (box.workdir / "releases" / rel / "manifest.json").write_text(json.dumps(
        {"id": rel, "seq": 1, "state": "applied", "launch_argv": argv, "files": []}))
    (box.workdir / "current").write_text(rel + "\n")

    state = lifecycle.find_server(box.agent)
    assert lifecycle.launch_in_force(state, box.host) == (argv, f"the launch argv of release {rel}")
    started = lifecycle.start_server(box.agent, None, on_event=box.events.append, baseline_argv=box.argv())
    box.remember_server()
    assert started["argv"] == argv and started["launch"] == f"the launch argv of release {rel}"
    assert box.pidfile()["release"] == rel
    assert lifecycle.wait_ready(box.agent, 60)["generate"]["tokens"] == 3

    # a server started by hand with the config's argv comes back, on restart, as the release says
    lifecycle.stop_server(box.agent, grace=10)
    lifecycle.start_server(box.agent, box.argv())
    box.remember_server()
    ready = lifecycle.restart_server(box.agent, grace=10, ready_timeout=60, baseline_argv=box.argv(),
                                     on_event=box.events.append)
    box.remember_server()
    assert ready["generate"]["tokens"] == 3 and box.pidfile()["argv"] == argv
    start_done = [e for e in box.events if isinstance(e, events.StepDone) and e.step == "start"][-1]
    assert f"release {rel}" in start_done.detail


# ---------------------------------------------------------------- end to end: CLI → sshd → pct → demo host


@pytest.fixture
def strangers(tmp_path: Path):
    """Processes the test starts outside dynctl (killed by pid afterwards, whatever dynctl did)."""
    procs: list[subprocess.Popen] = []

    def spawn(argv: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.DEVNULL)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, **kw)
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def port_of(config: Path) -> int:
    return session(config).host.port


def releases_in_force(config: Path) -> list[str]:
    return [r["id"] for r in core.list_releases(session(config).agent) if r.get("state") == "applied"]


def threshold_now(config: Path) -> int | None:
    info = server_info(config) or {}
    return (info.get("internal_states") or [{}])[0].get("speculative_disable_batch_threshold")


def test_deploy_refuses_a_stranger_launcher_and_never_signals_it(demo_box, strangers, tmp_path):
    config = demo_box()
    pid = start_baseline(config)
    pristine = tree_sha256(config)
    stranger = spawn_launcher(strangers, tmp_path, ["--model-path", "/m", "--port", str(port_of(config))])

    dry = dynctl("deploy", "--threshold", "5", "--dry-run", config=config)
    assert dry.returncode == 0 and f"pid {stranger.pid}" in dry.stdout and "will be refused" in dry.stdout
    out = dynctl("deploy", "--threshold", "5", "--yes", config=config)
    assert out.returncode == 3, out.stdout + out.stderr
    assert f"pid {stranger.pid}" in out.stderr and f"dynctl stop --pid {stranger.pid}" in out.stderr
    assert "nothing was changed and nothing was killed" in out.stderr
    assert stranger.poll() is None  # never signalled, by the deploy or by a rollback
    assert server_pid(config) == pid and tree_sha256(config) == pristine and releases_in_force(config) == []

    for verb in (["rollback", "--to", "baseline"], ["restart"]):
        res = dynctl(*verb, "--yes", config=config)
        assert res.returncode == 3, (verb, res.stdout + res.stderr)
        assert f"pid {stranger.pid}" in res.stderr and stranger.poll() is None
        assert server_pid(config) == pid  # refused before our own server was touched
    assert tree_sha256(config) == pristine


def test_stop_names_the_stranger_and_only_stop_pid_ends_it(demo_box, strangers, tmp_path):
    config = demo_box()
    pristine = tree_sha256(config)
    stranger = spawn_launcher(strangers, tmp_path, ["--model-path", "/m", "--port", str(port_of(config))])

    stop = dynctl("stop", "--yes", config=config)
    assert stranger.poll() is None
    assert stop.returncode == 3, stop.stdout + stop.stderr
    assert f"pid {stranger.pid}" in stop.stderr and f"dynctl stop --pid {stranger.pid}" in stop.stderr

    status = dynctl("status", "--json", config=config)  # agrees with stop: down, and names it
    assert status.returncode == 0, status.stderr
    server = json.loads(status.stdout)["server"]
    assert server["state"] == "down" and server["pid"] is None
    assert f"pid {stranger.pid}" in server["not_ours"]

    start = dynctl("start", "--yes", config=config)
    assert start.returncode == 3 and f"pid {stranger.pid}" in start.stderr
    assert server_pid(config) is None and stranger.poll() is None

    named = dynctl("stop", "--pid", str(stranger.pid), config=config)
    assert named.returncode == 2 and "refusing without --yes" in named.stderr  # it asks first
    assert stranger.poll() is None
    named = dynctl("stop", "--pid", str(stranger.pid), "--yes", config=config)
    assert named.returncode == 0, named.stdout + named.stderr
    assert stranger.wait(30) == -signal.SIGTERM
    assert tree_sha256(config) == pristine


def test_stop_pid_refuses_a_process_that_is_not_an_sglang_server(demo_box, strangers):
    config = demo_box()
    bystander = strangers([sys.executable, "-c", _LAUNCHER], start_new_session=True)
    out = dynctl("stop", "--pid", str(bystander.pid), "--yes", config=config)
    assert out.returncode == 3 and f"pid {bystander.pid} is not an sglang server" in out.stderr
    assert bystander.poll() is None


def _listen(family: int, addr: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((addr, port))
    sock.listen()
    return sock


@pytest.mark.parametrize("verb", [["rollback"], ["restart"], ["start"]])
def test_a_foreign_listener_refuses_rollback_restart_start_before_anything_changes(demo_box, verb):
    config = demo_box()
    start_baseline(config)
    assert dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config).returncode == 0
    assert dynctl("stop", "--yes", config=config).returncode == 0
    patched, rel = tree_sha256(config), releases_in_force(config)
    with _listen(socket.AF_INET, "127.0.0.1", port_of(config)):
        out = dynctl(*verb, "--yes", config=config)
    assert tree_sha256(config) == patched and releases_in_force(config) == rel  # 3 means: nothing changed
    assert out.returncode == 3, out.stdout + out.stderr
    assert f"port {port_of(config)} is held by pid {os.getpid()}" in out.stderr
    assert "nothing was changed" in out.stderr
    assert server_pid(config) is None


def test_a_foreign_listener_on_another_address_is_refused_before_our_server_is_stopped(demo_box):
    config = demo_box()
    pid = start_baseline(config)
    pristine = tree_sha256(config)
    with _listen(socket.AF_INET6, "::1", port_of(config)):  # ours serves 127.0.0.1:P; this holds [::1]:P
        out = dynctl("deploy", "--threshold", "5", "--yes", config=config)
        assert out.returncode == 3, out.stdout + out.stderr
        assert f"is held by pid {os.getpid()}" in out.stderr
        assert server_pid(config) == pid and tree_sha256(config) == pristine


_GRAB = """
import socket, sys, time
port = int(sys.argv[1])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
while True:
    try:
        s.bind(("127.0.0.1", port))
        break
    except OSError:
        time.sleep(0.001)
s.listen()
print("grabbed", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("verb", ["rollback", "restart"])
def test_a_port_taken_after_the_stop_is_a_failure_not_a_refusal(demo_box, strangers, verb):
    """Exit 3 promises that nothing changed: once the old server was stopped (and files reverted), a start
    that cannot run is exit 1, and the message says what was already done."""
    config = demo_box()
    start_baseline(config)
    assert dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config).returncode == 0
    grabber = strangers([sys.executable, "-c", _GRAB, str(port_of(config))], stdout=subprocess.PIPE, text=True)
    out = dynctl(verb, "--yes", config=config)
    assert grabber.stdout.readline().strip() == "grabbed"  # it took the port as soon as ours let it go
    assert out.returncode == 1, out.stdout + out.stderr
    assert grabber.poll() is None and server_pid(config) is None
    if f"is held by pid {grabber.pid}" not in out.stderr:
        # the grabber was slower than the start's pre-flight (a loaded machine): the new server then
        # failed to bind, which is exit 1 as well
        assert "error while attempting to bind" in out.stdout + out.stderr
        return
    if verb == "rollback":
        assert "done before that: stopped the server, reverted" in out.stderr
    else:
        assert "stopped pid" in out.stderr and "but the new server was not started" in out.stderr


def test_the_stop_step_says_when_it_only_swept_leftovers(demo_box):
    config = demo_box(DYNCTL_SIM_ORPHAN_CHILD="1")
    pid = start_baseline(config)
    orphan = wait_for(lambda: [p.pid for p in psutil.process_iter(["cmdline"])
                               if "sglang::orphan" in " ".join(p.info["cmdline"] or [])
                               and p.pid != pid and _has_marker_of(config, p)], what="the orphan")[0]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), what="the killed server")
    out = dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no server was running; swept 1 leftover process(es) of the previous server" in out.stdout
    assert "stopped pid None" not in out.stdout + out.stderr
    assert not alive(orphan)


def _has_marker_of(config: Path, proc: psutil.Process) -> bool:
    record = json.loads((Path(session(config).host.workdir) / "server.json").read_text())
    try:
        return proc.environ().get("DYNCTL_SERVER_ID") == record["marker"]
    except psutil.Error:
        return False


# ---------------------------------------------------------------- stop → start keeps the deployed threshold


def test_stop_then_start_keeps_the_deployed_threshold(demo_box):
    config = demo_box()
    start_baseline(config)
    deployed = dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    rel = releases_in_force(config)[0]
    assert threshold_now(config) == 5

    assert dynctl("stop", "--yes", config=config).returncode == 0
    started = dynctl("start", "--yes", config=config)
    assert started.returncode == 0, started.stdout + started.stderr
    assert f"the launch argv of release {rel}" in started.stdout
    assert threshold_now(config) == 5

    restarted = dynctl("restart", "--yes", config=config)
    assert restarted.returncode == 0 and f"release {rel}" in restarted.stdout
    assert threshold_now(config) == 5

    from dynctl.base.config import load_config
    from dynctl.actions.host import CoreActions

    cfg = load_config(str(config))
    keys = CoreActions(cfg, cfg.host("box"), grace=10, ready_timeout=60)  # the TUI's s / S keys
    keys.stop(events.ignore)
    keys.start(events.ignore)
    assert threshold_now(config) == 5

    back = dynctl("rollback", "--yes", "--soak", "0", config=config)  # no release in force: the config's argv
    assert back.returncode == 0, back.stdout + back.stderr
    assert dynctl("stop", "--yes", config=config).returncode == 0
    plain = dynctl("start", "--yes", config=config)
    assert plain.returncode == 0 and "the configured launch argv (no release in force)" in plain.stdout
    assert threshold_now(config) is None


# ---------------------------------------------------------------- soak: a crash soon after ready


def test_a_server_that_dies_soon_after_ready_is_rolled_back(demo_box):
    config = demo_box()
    old = start_baseline(config)
    pristine = tree_sha256(config)
    s = session(config)
    dplan = core.plan_deploy(s.agent, s.host, 5)
    dplan.launch_argv += ["--sim-crash-after", "8"]  # a scheduler that dies a few seconds into serving
    seen: list[events.Event] = []
    with pytest.raises(OperationFailed) as info:
        core.deploy(s.agent, dplan, seen.append, ready_timeout=60, soak=30)
    message = str(info.value)
    assert "after it became ready" in message and "soak of 30s" in message, message
    assert "rolled back to baseline, which is serving again" in message
    assert [e.step for e in seen if isinstance(e, events.StepDone)][:5] == ["switch", "stop", "start", "ready",
                                                                            "verify"]
    assert any(isinstance(e, events.Failed) and any("CUDA error" in ln for ln in e.log_tail) for e in seen)
    assert tree_sha256(config) == pristine and releases_in_force(config) == []
    new = server_pid(config)
    assert new and new != old
    r = httpx.post(f"http://127.0.0.1:{s.host.port}/generate",
                   json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    assert r.status_code == 200


def test_a_rollback_whose_server_dies_in_the_soak_says_so(demo_box, sshd, tmp_path):
    config = demo_box()
    start_baseline(config)
    assert dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config).returncode == 0
    rel = releases_in_force(config)[0]
    # the baseline (the configured argv) now crashes a few seconds into serving
    entry = tomllib.loads(config.read_text())["hosts"]["box"]
    entry["args"] = [*entry["args"], "--sim-crash-after", "8"]
    sshd.write_config(config, {"box": entry}, default_host="box")

    out = dynctl("rollback", "--yes", "--soak", "30", config=config)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "rollback to baseline failed" in out.stderr and "after it became ready" in out.stderr
    assert f"done before that: stopped the server, reverted {rel}" in out.stderr


def test_a_live_threshold_change_is_never_sent_to_a_foreign_listener(box: Box, tmp_path: Path):
    box.start_ready()
    lifecycle.stop_server(box.agent, grace=10)
    seen = tmp_path / "requests"
    code = ("import http.server, sys\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_POST(self):\n"
            "        open(sys.argv[2], 'a').write(self.path + '\\n'); self.send_response(200); self.end_headers()\n"
            "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    foreign = box.spawn([sys.executable, "-c", code, str(box.port), str(seen)])
    wait_for(lambda: listening(box.port), what="the foreign listener")
    with pytest.raises(AgentError, match=f"(?s)held by pid {foreign.pid} .*the threshold was not sent") as err:
        box.agent.call("set_threshold", threshold=5)
    assert err.value.exit_code == 3 and not seen.exists() and alive(foreign.pid)
