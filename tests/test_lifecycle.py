"""Server lifecycle (SPEC §5) through the real agent: real processes, signals, ports and HTTP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys

import psutil
import pytest

from dynctl.base import events
from dynctl.core import lifecycle
from dynctl.agent.client import AgentError
from dynctl.base.errors import PreflightError
from lifecycle_harness import SLEEPER, Box, alive, box, listening, wait_for  # noqa: F401 - box is a fixture
from sshd_harness import free_port

pytestmark = pytest.mark.slow


def start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def steps(evs: list[events.Event], kind: type) -> list:
    return [e for e in evs if isinstance(e, kind)]


def test_start_ready_then_graceful_stop_sweeps_the_tree(box: Box):
    started = box.start_ready("--children")
    pid = started["pid"]
    kids = box.children()
    assert set(kids) == {"plain", "setsid"} and all(alive(p) for p in kids.values())
    assert any("fired up and ready" in e.text for e in steps(box.events, events.LogLine))
    ready = steps(box.events, events.StepDone)[-1]
    assert ready.step == "ready" and "4 tokens" in ready.detail

    rec = box.pidfile()
    assert rec["pid"] == pid and rec["sid"] == pid and rec["port"] == box.port and rec["argv"] == box.argv("--children")
    assert rec["pid_start"] == start_ticks(pid)
    assert stat.S_IMODE((box.workdir / "server.json").stat().st_mode) == 0o600

    state = lifecycle.find_server(box.agent)
    assert (state.state, state.pid, state.source, state.health) == ("ready", pid, "pidfile", 200)

    result = lifecycle.stop_server(box.agent, grace=30, on_event=box.events.append)
    assert result["stopped"] and not result["escalated"]
    assert {p["pid"] for p in result["swept"]} == set(kids.values())
    assert not alive(pid) and not any(alive(p) for p in kids.values())
    assert not listening(box.port)
    assert {"sigterm_to_exit_s", "exit_to_port_free_s"} <= set(result["timings"])
    if shutil.which("nvidia-smi"):  # a GPU machine: checked, and this server held nothing there
        assert result["gpu"]["checked"] is True and result["gpu"]["held_before"] == []
    else:
        assert result["gpu"] == {"checked": False, "why": "nvidia-smi not found in the server's PATH"}
    assert lifecycle.find_server(box.agent).state == "down"

    journal = box.journal()
    names = [r["event"] for r in journal]
    for step in ("start.spawned", "ready.ok", "stop.begin", "stop.signal", "stop.exited", "stop.port_free", "stop.done"):
        assert step in names, step
    signals = [(r["pid"], r["signal"]) for r in journal if r["event"] == "stop.signal"]
    assert signals[0] == (pid, "SIGTERM")
    assert stat.S_IMODE((box.workdir / "journal.jsonl").stat().st_mode) == 0o600

    again = lifecycle.stop_server(box.agent, grace=30)
    assert again["stopped"] is False and again["message"] == "server already stopped"


def test_sigterm_ignored_is_killed_after_grace(box: Box):
    pid = box.start_ready("--ignore-sigterm")["pid"]
    result = lifecycle.stop_server(box.agent, grace=1.0, on_event=box.events.append)
    assert result["escalated"] is True
    assert result["timings"]["sigterm_to_exit_s"] >= 1.0  # the grace was honoured before SIGKILL
    assert not alive(pid) and not listening(box.port)
    sent = [(r["pid"], r["signal"]) for r in box.journal() if r["event"] == "stop.signal"]
    assert sent[:2] == [(pid, "SIGTERM"), (pid, "SIGKILL")]
    assert any("sent SIGKILL" in w.text for w in steps(box.events, events.Warning))


def test_orphan_holding_the_port_is_swept(box: Box):
    pid = box.start_ready("--orphan-port")["pid"]
    holder = box.children()["port-holder"]
    assert psutil.Process(holder).ppid() == pid and psutil.Process(holder).status() != psutil.STATUS_ZOMBIE
    result = lifecycle.stop_server(box.agent, grace=10)
    assert holder in {p["pid"] for p in result["swept"]}
    assert not alive(holder) and not listening(box.port)


def test_crashed_server_whose_orphan_holds_the_port(box: Box):
    pid = box.start_ready("--orphan-port")["pid"]
    holder = box.children()["port-holder"]
    os.kill(pid, signal.SIGKILL)  # the server dies hard; its port-holding child lives on
    wait_for(lambda: not alive(pid), what="the killed server to go")
    assert listening(box.port)

    state = lifecycle.find_server(box.agent)
    assert state.state == "down" and state.pid is None
    assert [p["pid"] for p in state.leftovers] == [holder]
    assert state.port_owner is None  # ours, not foreign

    with pytest.raises(AgentError, match=f"previous server are still alive.*{holder}") as err:
        box.start()
    assert err.value.exit_code == 3 and alive(holder)

    result = lifecycle.stop_server(box.agent, grace=10)
    assert result["pid"] is None and [p["pid"] for p in result["swept"]] == [holder]
    assert not alive(holder) and not listening(box.port)
    box.start_ready()  # and the host is usable again
    assert lifecycle.find_server(box.agent).state == "ready"


def test_decoy_and_second_server_are_untouched(box: Box):
    other_port = free_port()
    decoy = box.spawn([sys.executable, "-c", SLEEPER, "python3", "-m", "sglang.launch_server", "--port", str(box.port)])
    second = box.spawn_server(other_port, "--children")
    wait_for(lambda: listening(other_port), what="the second server")
    second_tree = [second.pid, *(c.pid for c in psutil.Process(second.pid).children(recursive=True))]
    assert "python3 -m sglang.launch_server --port %d" % box.port in " ".join(psutil.Process(decoy.pid).cmdline())

    # with our server down, neither is mistaken for it
    state = lifecycle.find_server(box.agent)
    assert state.pid is None and state.state == "down"
    assert lifecycle.stop_server(box.agent, grace=5)["stopped"] is False

    pid = box.start_ready("--children")["pid"]
    assert lifecycle.find_server(box.agent).pid == pid
    lifecycle.stop_server(box.agent, grace=10)
    assert not alive(pid)
    assert alive(decoy.pid) and all(alive(p) for p in second_tree)
    assert listening(other_port)


def _write_pidfile(box: Box, **rec) -> None:
    box.workdir.mkdir(parents=True, exist_ok=True)
    (box.workdir / "server.json").write_text(json.dumps(rec))


@pytest.mark.parametrize("lie", ["start_time", "argv"])
def test_stale_pidfile_with_a_reused_pid_kills_nothing(box: Box, lie: str):
    victim = box.spawn([sys.executable, "-c", SLEEPER], start_new_session=True)  # leads its own session
    child = box.spawn([sys.executable, "-c", SLEEPER])
    start = start_ticks(victim.pid)
    argv = box.argv()
    if lie == "start_time":  # the pid was recycled: same number, another process
        _write_pidfile(box, pid=victim.pid, pid_start=start - 1, sid=victim.pid, argv=argv, marker="x")
    else:  # same start tick (cannot really happen) but another command line: still not ours
        _write_pidfile(box, pid=victim.pid, pid_start=start, sid=victim.pid, argv=argv, marker="x")

    state = lifecycle.find_server(box.agent)
    assert state.state == "down" and state.pid is None and state.leftovers == ()
    assert state.pidfile.startswith(f"stale: pid {victim.pid} now belongs to another process")
    result = lifecycle.stop_server(box.agent, grace=5)
    assert result["stopped"] is False
    assert alive(victim.pid) and alive(child.pid)


def test_foreign_process_on_the_port_refuses_start_and_is_never_killed(box: Box):
    foreign = box.spawn([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(box.port)])
    wait_for(lambda: listening(box.port), what="the foreign listener")

    with pytest.raises(AgentError) as err:
        box.start()
    assert err.value.exit_code == 3
    assert f"port {box.port} is held by pid {foreign.pid}" in str(err.value) and "http.server" in str(err.value)
    assert "nothing was killed" in str(err.value)
    assert steps(box.events, events.Failed)[-1].step == "start"
    assert box.pidfile() is None and alive(foreign.pid)

    state = lifecycle.find_server(box.agent)
    assert state.state == "down" and state.port_owner["pid"] == foreign.pid
    result = lifecycle.stop_server(box.agent, grace=5)
    assert result["stopped"] is False and f"pid {foreign.pid}" in result["message"]
    assert alive(foreign.pid)


def test_crash_during_start_is_reported_with_the_traceback(box: Box):
    box.start("--crash-after", "0.3")
    with pytest.raises(lifecycle.ServerStartFailed) as err:
        lifecycle.wait_ready(box.agent, ready_timeout=120, on_event=box.events.append)
    failure = err.value
    assert failure.reason in ("crash", "traceback") and failure.exit_code == 1
    tail = "\n".join(failure.log_tail)
    assert "Traceback (most recent call last)" in tail
    assert "RuntimeError: simulated crash while loading weights" in tail
    failed = steps(box.events, events.Failed)[-1]
    assert failed.step == "ready" and failed.log_tail == failure.log_tail
    wait_for(lambda: lifecycle.find_server(box.agent).state == "down", what="the crashed server to be seen down")
    assert [r for r in box.journal() if r["event"] == "ready.failed"]


def test_hang_during_start_times_out(box: Box):
    pid = box.start("--hang")["pid"]
    with pytest.raises(lifecycle.ServerStartFailed, match="not ready within 1.5s") as err:
        lifecycle.wait_ready(box.agent, ready_timeout=1.5)
    assert err.value.reason == "timeout" and err.value.pid == pid
    state = lifecycle.find_server(box.agent)
    assert (state.state, state.pid, state.health) == ("starting", pid, 503)
    lifecycle.stop_server(box.agent, grace=5)
    assert not alive(pid)


def test_start_is_idempotent_and_refuses_other_arguments(box: Box):
    pid = box.start_ready()["pid"]
    again = box.start()
    assert again["already_running"] is True and again["pid"] == pid
    with pytest.raises(AgentError, match=f"already running on port {box.port} \\(pid {pid}") as err:
        lifecycle.start_server(box.agent, box.argv("--tokens", "2"))
    assert err.value.exit_code == 3
    with pytest.raises(AgentError, match="this host's port is"):
        lifecycle.start_server(box.agent, [sys.executable, "-m", "sglang.launch_server", "--port", "1"])


def test_restart_reuses_the_recorded_arguments_in_one_host_process(box: Box):
    old = box.start_ready("--tokens", "3")["pid"]
    ready = lifecycle.restart_server(box.agent, None, grace=10, ready_timeout=60, on_event=box.events.append)
    box.remember_server()
    rec = box.pidfile()
    assert ready["pid"] == rec["pid"] != old and not alive(old)
    assert rec["argv"] == box.argv("--tokens", "3")
    assert ready["generate"]["tokens"] == 3
    assert [e.step for e in steps(box.events, events.StepDone)][-3:] == ["stop", "start", "ready"]


def test_server_started_by_hand_is_the_operators_and_stopped_with_its_session_only_on_their_word(box: Box):
    server = box.spawn_server(box.port, "--children")
    wait_for(lambda: listening(box.port) and len(psutil.Process(server.pid).children()) >= 2,
             what="the hand-started server and its children")
    state = lifecycle.find_server(box.agent)
    assert state.pid is None and (state.not_ours["kind"], state.not_ours["pid"]) == ("operator", server.pid)
    with pytest.raises(PreflightError, match=f"pid {server.pid}, not started by dynctl"):
        lifecycle.stop(box.agent, grace=10)  # no word from the operator: refused, nothing signalled
    assert alive(server.pid)
    kids = [c.pid for c in psutil.Process(server.pid).children()]
    result = lifecycle.stop(box.agent, grace=10, adopt=lambda question: True)
    assert result["source"] == "adopted"  # its launch was recorded first: the baseline release
    assert server.wait(10) == 0  # it drained and exited on SIGTERM
    assert not any(alive(p) for p in kids)  # the plain child by the tree, the setsid one by the tree too


def test_logs_tail_and_follow(box: Box):
    box.start_ready()
    lines = lifecycle.read_log(box.agent, 200)
    assert lines[0].startswith("==== dynctl start") and any("fired up" in ln for ln in lines)
    assert lifecycle.read_log(box.agent, 2) == lines[-2:]

    follow = lifecycle.follow_log(box.agent, lines=1, max_seconds=60)
    assert next(follow) == lines[-1]
    subprocess.run([sys.executable, "-c", "import urllib.request,sys; urllib.request.urlopen("
                    f"urllib.request.Request('http://127.0.0.1:{box.port}/generate', data=b'{{}}'))"], check=True)
    assert "POST /generate" in next(follow)
    follow.close()


def test_without_psutil_on_the_host(box: Box, tmp_path):
    """sglang's interpreter has psutil, others may not: the /proc code paths must do the same job."""
    blocker = tmp_path / "nopsutil"
    blocker.mkdir()
    (blocker / "psutil.py").write_text("raise ImportError('psutil blocked for this test')\n")
    from lifecycle_harness import make_box

    # an interpreter that cannot import psutil: the real python behind a wrapper that shadows it
    python = tmp_path / "python-without-psutil"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={blocker}:$PYTHONPATH exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    b = make_box(tmp_path / "np", python=str(python),
                 env={"PYTHONPATH": f"{blocker}:{box.host.env['PYTHONPATH']}"})
    try:
        assert b.agent.call("inspect")["psutil"] is False
        pid = b.start_ready("--children", "--orphan-port")["pid"]
        kids = b.children()
        state = lifecycle.find_server(b.agent)
        assert (state.state, state.pid) == ("ready", pid)
        result = lifecycle.stop_server(b.agent, grace=10)
        assert {p["pid"] for p in result["swept"]} == set(kids.values())
        assert not alive(pid) and not any(alive(p) for p in kids.values()) and not listening(b.port)
    finally:
        b.cleanup()


def test_gpu_memory_is_waited_for_after_exit(box: Box, tmp_path):
    """With nvidia-smi in the server's PATH, stop waits until no pid of the old tree holds GPU memory."""
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    from lifecycle_harness import FAKE_BIN, make_box

    env = dict(box.host.env, PATH=f"{FAKE_BIN}:{os.environ['PATH']}", FAKE_NVIDIA_SMI_DIR=str(gpu), FAKE_NVIDIA_SMI_LAG="0.5")
    b = make_box(tmp_path / "g", env=env)
    try:
        pid = b.start_ready("--gpu-dir", str(gpu))["pid"]
        result = lifecycle.stop_server(b.agent, grace=10)
        assert result["gpu"]["checked"] is True, result
        assert result["gpu"]["held_before"] == [pid]
        assert result["gpu"]["released_after_exit_s"] >= 0.5  # the driver's lag was waited out
        assert [r for r in b.journal() if r["event"] == "stop.gpu_released"]

        pid = b.start_ready("--gpu-dir", str(gpu))["pid"]
        (gpu / f"{pid}.stuck").write_text("")
        with pytest.raises(AgentError, match=f"GPU memory is still held by pid\\(s\\) {pid}"):
            b.agent.call("server_stop", grace=5, gpu_timeout=1)
        assert not alive(pid)
    finally:
        b.cleanup()


def test_a_traceback_of_an_optional_feature_during_start_is_not_a_crash(box: Box):
    """sglang logs a Traceback when it skips an optional module and then serves: only an exit is a crash."""
    box.start("--optional-traceback", "--start-delay", "2.5")
    done = lifecycle.wait_ready(box.agent, ready_timeout=120, on_event=box.events.append)
    assert done["type"] == "ready"
    warned = [e for e in box.events if isinstance(e, events.Warning)]
    assert warned and "Traceback during start" in warned[0].text and "still running" in warned[0].text


def test_a_traceback_logged_while_serving_is_not_a_failed_start(box: Box):
    box.start_ready()
    with open(box.workdir / "server.log", "a") as log:  # e.g. a bad request's handler error, later on
        log.write("Traceback (most recent call last):\nValueError: bad request\n")
    assert lifecycle.wait_ready(box.agent, ready_timeout=30)["type"] == "ready"


def test_stop_is_refused_while_another_operation_holds_the_host(box: Box):
    pid = box.start_ready()["pid"]
    me = psutil.Process()
    lock = {"operation": "deploy", "who": "alice", "pid": me.pid, "pid_start": start_ticks(me.pid),
            "started": "2026-01-01T00:00:00+00:00"}
    (box.workdir / "lock").write_text(json.dumps(lock))
    with pytest.raises(AgentError, match="host is busy: deploy by alice") as err:
        lifecycle.stop_server(box.agent, grace=5)
    assert err.value.exit_code == 3 and alive(pid)
    (box.workdir / "lock").unlink()
    lifecycle.stop_server(box.agent, grace=5)
    assert not alive(pid)
