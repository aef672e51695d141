"""Faults inside the host transaction and at its edges: any failure after the switch rolls back, a full workdir
disk neither keeps a release applied nor keeps the server from being stopped, the final word reaches the
client, torn event lines, unbounded waits, Ctrl-C during a stop, and config values no host can run.

Real processes and signals, the demo host (on this machine, over SSH and in the `pct` stand-in), real tmpfs
mounts for the full disks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from demo_box import dynctl, server_info, server_pid, session, tree_sha256
from polling import alive, wait_for
from sshd_harness import free_port
from test_patch_agent import _mounted
from typer.testing import CliRunner

from dynctl.core import deploy as core
from dynctl.core import lifecycle
from dynctl.agent.client import AgentClient, AgentError
from dynctl.cli import app
from dynctl.base.config import HostConfig
from dynctl.base.errors import OperationFailed
from dynctl.transport.local import Local
from dynctl_agent import operations, oprecords, store
from dynctl_agent.protocol import LIMITS, Context


def one_line(text: str) -> str:
    """The words of `text` on one line, without the frame rich draws around a usage error."""
    return " ".join(text.translate(str.maketrans("│╭╮╰╯─", "      ")).split())


def journal(workdir: Path) -> list[dict]:
    try:
        text = (workdir / "journal.jsonl").read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def signalled(workdir: Path, pid: int, sig: str) -> bool:
    return any(e.get("event") == "stop.signal" and e.get("pid") == pid and e.get("signal") == sig
               for e in journal(workdir))


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` over `where` (0700, as a workdir must be), its files copied in first."""
    keep = where.with_name(where.name + ".kept")
    where.mkdir(parents=True, exist_ok=True)
    shutil.copytree(where, keep, symlinks=True)
    with _mounted([["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)]], where):
        shutil.copytree(keep, where, symlinks=True, dirs_exist_ok=True)
        yield where


def fill(folder: Path, leave: int = 0, name: str = "filler") -> Path:
    """Write a filler in `folder` until the disk refuses more (a real ENOSPC), then give back `leave` bytes."""
    filler = folder / name
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


def start_server(config: Path, *flags: str) -> int:
    s = session(config)
    pid = lifecycle.start_server(s.agent, lifecycle.server_argv(s.host, flags))["pid"]
    lifecycle.wait_ready(s.agent, 120)
    return pid


# =========================================================================== any failure after the switch


@pytest.mark.slow
def test_a_start_that_raises_after_the_switch_rolls_back_and_restarts_the_previous_server(demo_box):
    """A NUL byte in the new launch argv (a host built in code, past the config check) fails the start after
    the old server was stopped: the release is reverted and the previous launch serves again."""
    config = demo_box(via="local")
    s = session(config)
    old = start_server(config)
    pristine = tree_sha256(config)
    plan = core.plan_deploy(s.agent, s.host, 5)
    plan.launch_argv = [*plan.launch_argv, "--served-model-name", "a\0b"]
    with pytest.raises(OperationFailed) as err:
        core.deploy(s.agent, plan, ready_timeout=60, soak=0)
    said = one_line(str(err.value))
    assert err.value.exit_code == 1
    assert "NUL byte" in said and "rolled back to baseline, which is serving again" in said, said
    assert tree_sha256(config) == pristine
    assert server_pid(config) not in (None, old) and server_info(config) is not None
    assert [r["state"] for r in core.list_releases(s.agent)] == ["reverted"]


@pytest.mark.slow
@pytest.mark.parametrize("via", ["local", "pct"])
def test_the_workdir_disk_filling_during_the_stop_rolls_back_and_says_so(demo_box, via):
    """The workdir's disk fills while the old server drains: the start of the new one cannot write its log, and
    the rollback still reverts the release, starts the previous server and tells the client what it did."""
    config = demo_box(via=via)
    workdir = Path(session(config).host.workdir)
    session(config).agent.call("ping")  # the agent unpacked before the tmpfs goes over the workdir
    with tmpfs(workdir, "16m"):
        pid = start_server(config, "--sim-ignore-sigterm")  # a drain of --grace seconds to fill the disk in
        pristine = tree_sha256(config)
        proc = subprocess.Popen([sys.executable, "-m", "dynctl", "deploy", "--threshold", "5", "--yes", "--grace", "4",
                                 "--soak", "0", "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        filler = None
        try:
            wait_for(lambda: signalled(workdir, pid, "SIGTERM"), 120, "the deploy's SIGTERM to the old server")
            filler = fill(workdir)
            out, err = proc.communicate(timeout=240)
            said = one_line(out + err)
            after = tree_sha256(config)
            serving = server_info(config)
            releases = core.list_releases(session(config).agent)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if filler is not None:
                filler.unlink()
            stopped = dynctl("stop", "--yes", "--grace", "5", config=config)  # nothing may hold the tmpfs at umount
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert proc.returncode == 1, said
    assert "No space left on device" in said and "rolled back to baseline, which is serving again" in said, said
    assert after == pristine
    assert serving is not None
    assert [r["state"] for r in releases] == ["reverted"]
    assert not alive(pid)


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["rollback", "restart"])
def test_a_rollback_or_restart_whose_disk_fills_during_the_stop_still_ends_serving(demo_box, verb):
    """The room a worker keeps from its start is given back when it begins to change the host: the revert's
    records, the new server's log and its pidfile still fit on a disk that filled during the drain."""
    config = demo_box(via="local", DYNCTL_SIM_IGNORE_SIGTERM="1")  # every server drains for the whole grace
    workdir = Path(session(config).host.workdir)
    session(config).agent.call("ping")
    with tmpfs(workdir, "16m"):
        start_server(config)
        pristine = tree_sha256(config)
        if verb == "rollback":
            first = dynctl("deploy", "--threshold", "5", "--yes", "--grace", "1", "--soak", "0", config=config)
            assert first.returncode == 0, first.stdout + first.stderr
        pid = server_pid(config)
        proc = subprocess.Popen([sys.executable, "-m", "dynctl", verb, "--yes", "--grace", "4", "--config", str(config)]
                                + (["--soak", "0"] if verb == "rollback" else []),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        filler = None
        try:
            wait_for(lambda: signalled(workdir, pid, "SIGTERM"), 120, f"the {verb}'s SIGTERM to the server")
            filler = fill(workdir)
            out, err = proc.communicate(timeout=240)
            said = one_line(out + err)
            after = tree_sha256(config)
            now = server_pid(config)
            serving = server_info(config)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if filler is not None:
                filler.unlink()
            dynctl("stop", "--yes", "--grace", "1", config=config)  # nothing may hold the tmpfs at umount
    assert proc.returncode == 0, said
    assert ("rolled back" if verb == "rollback" else "restarted the server") in said
    assert after == pristine
    assert now not in (None, pid) and serving is not None


def test_the_final_word_reaches_the_follower_when_the_event_log_cannot_take_it(tmp_path):
    """The worker reserves its final word's room when it starts: on a disk that filled since, the final goes
    there, and op_follow, op_detach and op_list read it."""
    ops = tmp_path / "work" / "ops"
    ops.mkdir(parents=True)
    with tmpfs(ops, "1m"):
        ctx = Context({"workdir": str(tmp_path / "work"), "name": "box"}, {"user": "tester"})
        op_id = "20261201T000000-deploy-abcdef"
        store.write_json_atomic(str(ops / f"{op_id}.json"), {"id": op_id, "kind": "deploy"})
        oplog = oprecords.OpLog(ctx, op_id, "deploy")
        oplog.make_room()
        oplog.emit("started", required=True, kind="deploy", pid=os.getpid())
        fill(ops)
        oplog.emit("step_started", step="stop")
        oplog.release_room()  # the rollback's room, given back and taken again: the disk keeps filling
        fill(ops, name="filler-2")
        tail = ["server log line %d %s" % (i, "x" * 200) for i in range(400)]  # more than the spot holds
        went = oplog.finish(final=True, ok=False, kind="failed", error="deploy of release 0001 failed: full disk; "
                            "rolled back to baseline, which is serving again", log_tail=tail)
        events = [e["op"] for e in operations.op_follow(ctx, op_id=op_id)]
        listed = operations.op_list(ctx)["ops"]
        detached = operations.op_detach(ctx, op_id)
    assert went == str(ops / f"{op_id}.final")
    assert events[0]["type"] == "started" and [e["type"] for e in events].count("final") == 1
    assert events[-1]["type"] == "final" and events[-1]["seq"] == len(events)
    assert events[-1]["error"].endswith("rolled back to baseline, which is serving again")
    assert events[-1]["ok"] is False and 0 < len(events[-1]["log_tail"]) < len(tail)
    assert listed[0]["state"] == "failed" and "rolled back" in listed[0]["error"]
    assert detached["state"] == "finished" and detached["final"]["kind"] == "failed"


def test_a_final_word_that_lands_in_the_event_log_gives_its_reserved_room_back(tmp_path):
    ctx = Context({"workdir": str(tmp_path / "work")}, {"user": "tester"})
    (tmp_path / "work" / "ops").mkdir(parents=True)
    oplog = oprecords.OpLog(ctx, "20261201T000000-deploy-abcdef", "deploy")
    oplog.make_room()
    assert Path(oplog.spot).stat().st_size == oprecords.FINAL_ROOM
    assert Path(oplog.reserve).stat().st_size == oprecords.ROLLBACK_ROOM
    assert oplog.finish(final=True, ok=True) == oplog.path
    assert sorted(p.name for p in (tmp_path / "work" / "ops").iterdir()) == [Path(oplog.path).name]


# =========================================================================== a full disk and the event log


def test_an_event_line_is_appended_whole_or_not_at_all(tmp_path):
    """Two pages left and a 20 KiB line: the write comes back short; the line must not stay half written."""
    folder = tmp_path / "ops"
    folder.mkdir()
    with tmpfs(folder, "256k"):
        path = folder / "x.jsonl"
        oprecords.append(str(path), {"t": "0", "type": "info", "text": "first"})
        before = path.read_bytes()
        fill(folder, leave=8192)
        with pytest.raises(OSError):
            oprecords.append(str(path), {"t": "1", "type": "log", "text": "y" * 20000})
        after = path.read_bytes()
    assert after == before


@pytest.mark.slow
def test_ops_follow_reads_past_a_torn_event_line(local_demo, tmp_path):
    """A line torn by a writer that died half way, alone or with the next record appended to it (the final
    event included): `ops follow` still reports the deploy as the success it was (exit 0)."""
    agent, host = local_demo.agent, local_demo.host
    start_server(tmp_path / "dynctl.toml")
    core.deploy(agent, core.plan_deploy(agent, host, 5), ready_timeout=60, soak=0)
    ops = Path(host.workdir) / "ops"
    path = next(ops.glob("*-deploy-*.jsonl"))
    lines = path.read_bytes().splitlines(keepends=True)
    torn = lines[2][: len(lines[2]) // 2]
    path.write_bytes(b"".join([*lines[:2], torn + b"\n", *lines[3:-1], torn + lines[-1]]))
    follow = dynctl("ops", "follow", "latest", config=tmp_path / "dynctl.toml")
    assert follow.returncode == 0, follow.stdout + follow.stderr
    said = one_line(follow.stdout + follow.stderr)
    assert "threshold 5 in force" in said and "could not be read" in said


# =========================================================================== stop on a full workdir disk


@pytest.mark.slow
@pytest.mark.parametrize("via", ["local", "pct"])
def test_the_server_is_stopped_through_dynctl_on_a_full_workdir_disk(demo_box, via):
    """Neither the host lock nor the journal nor the pidfile can be written: the stop goes on without them
    (SIGTERM, grace, SIGKILL, sweep) and says what it could not record."""
    config = demo_box(via=via)
    workdir = Path(session(config).host.workdir)
    session(config).agent.call("ping")
    with tmpfs(workdir, "8m"):
        pid = start_server(config, "--sim-ignore-sigterm")
        filler = fill(workdir)
        try:
            out = dynctl("stop", "--yes", "--grace", "1", config=config)
            gone = not alive(pid)
        finally:
            filler.unlink()
            dynctl("stop", "--yes", "--grace", "1", config=config)  # nothing may hold the tmpfs at umount
        left = sorted(p.name for p in workdir.iterdir() if ".tmp." in p.name or p.name == "lock")
    assert out.returncode == 0, out.stdout + out.stderr
    said = one_line(out.stdout + out.stderr)
    assert gone and "sent SIGKILL" in said
    assert "could not be written (No space left on device): stopped without it" in said
    assert left == []


def servers_on(port: int) -> list[psutil.Process]:
    """Processes started for this test's port (its own free port: nobody else's)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        if "--port" in argv and argv[argv.index("--port") + 1:][:1] == [str(port)]:
            found.append(p)
    return found


@pytest.mark.slow
def test_a_server_whose_pidfile_cannot_be_written_is_not_left_running(demo_box):
    """A server dynctl cannot record is one it could never find or stop again: the record is written before the
    spawn, so where it cannot be (here the pidfile's place is taken by a directory) nothing is started, and the
    start is refused saying so."""
    config = demo_box(via="local")
    host = session(config).host
    workdir = Path(host.workdir)
    session(config).agent.call("ping")
    (workdir / "server.json").mkdir()
    try:
        out = dynctl("start", "--yes", config=config)
        left = wait_for(lambda: servers_on(host.port) == [] or None, 10, "no server left running") and []
    finally:
        for proc in servers_on(host.port):
            proc.kill()
        (workdir / "server.json").rmdir()
    said = one_line(out.stdout + out.stderr)
    assert out.returncode == 3, said
    assert "cannot record the new server" in said and "nothing was started" in said
    assert left == [] and "stopped again" not in said  # refused before the spawn, not a server spawned and killed


# =========================================================================== Ctrl-C during a local stop


@pytest.mark.slow
@pytest.mark.parametrize("via", ["local", "ssh", "pct"])
def test_ctrl_c_during_a_stop_lets_the_stop_finish_with_sigkill(demo_box, via):
    """SIGINT to the whole process group of `dynctl stop` (what a terminal's Ctrl-C does) while a server that
    ignores SIGTERM drains: the agent is not in that group (its own session locally, sshd's over SSH), so the
    stop goes on to SIGKILL, and the client says so instead of guessing."""
    config = demo_box(via=via)
    workdir = Path(session(config).host.workdir)
    pid = start_server(config, "--sim-ignore-sigterm")
    proc = subprocess.Popen([sys.executable, "-m", "dynctl", "stop", "--yes", "--grace", "4", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # its own group, as a shell gives each job
    try:
        wait_for(lambda: signalled(workdir, pid, "SIGTERM"), 60, "the stop's SIGTERM")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = one_line(out + err)
    wait_for(lambda: not alive(pid), 30, "the server to be SIGKILLed after the grace")
    # the agent journals a signal once it is sent, so the entry can land just after the process is gone
    wait_for(lambda: signalled(workdir, pid, "SIGKILL"), 30, "the stop's SIGKILL in the journal")
    assert server_pid(config) is None
    assert proc.returncode == 130, said
    assert "the stop continues on the host" in said and "SIGKILL after the 4 s grace" in said, said


# =========================================================================== bounded waits


def unreachable(tmp_path: Path) -> Path:
    path = tmp_path / "dynctl.toml"
    path.write_text(f'[hosts.gone]\nssh = "root@127.0.0.1:{free_port()}"\n')
    return path


@pytest.mark.parametrize("value", ["inf", "1e400", "nan", "-1", "-inf"])
@pytest.mark.parametrize(("command", "option", "most"), [
    (["deploy", "--threshold", "5"], "--soak", 3600), (["rollback"], "--soak", 3600),
    (["deploy", "--threshold", "5"], "--grace", 3600), (["rollback"], "--grace", 3600),
    (["restart"], "--grace", 3600), (["stop"], "--grace", 3600),
    (["deploy", "--threshold", "5"], "--ready-timeout", 7200), (["rollback"], "--ready-timeout", 7200),
    (["restart"], "--ready-timeout", 7200), (["start"], "--ready-timeout", 7200),
])
def test_a_wait_must_be_finite_and_bounded(tmp_path: Path, command: list[str], option: str, most: int, value: str):
    result = CliRunner().invoke(app, [*command, f"{option}={value}", "--yes", "--config", str(unreachable(tmp_path))])
    said = one_line(result.output)
    assert result.exit_code == 2, said
    assert f"Invalid value for '{option}'" in said and f"to {most}" in said
    assert "connection refused" not in said


def test_a_wait_past_its_maximum_is_refused_and_one_at_it_is_not(tmp_path: Path):
    config = unreachable(tmp_path)
    over = CliRunner().invoke(app, ["deploy", "--threshold", "5", "--soak", "3600.5", "--yes", "--config", str(config)])
    assert over.exit_code == 2 and "Invalid value for '--soak'" in one_line(over.output)
    at = CliRunner().invoke(app, ["deploy", "--threshold", "5", "--soak", "3600", "--yes", "--config", str(config)])
    assert at.exit_code == 4, at.output  # accepted: it went on to the (unreachable) host


def test_the_client_and_the_agent_bound_the_waits_alike():
    assert LIMITS["grace"][1] == lifecycle.MAX_GRACE_S
    assert LIMITS["ready_timeout"][1] == lifecycle.MAX_READY_TIMEOUT_S
    assert LIMITS["soak"][1] == core.MAX_SOAK_S


@pytest.fixture(scope="module")
def bare_agent(tmp_path_factory: pytest.TempPathFactory) -> AgentClient:
    """The real agent on this machine, for a workdir that holds nothing but the agent (uploaded once)."""
    workdir = tmp_path_factory.mktemp("bare") / "wd"
    return AgentClient(Local(), HostConfig(name="box", python=sys.executable, workdir=str(workdir), port=free_port()))


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e400, -1.0, 1e9])
@pytest.mark.parametrize(("verb", "params"), [
    ("server_stop", {"grace": "X"}),
    ("server_stop", {"grace": 1, "port_timeout": "X"}),
    ("server_wait_ready", {"ready_timeout": "X"}),
    ("op_start", {"kind": "deploy", "params": {"soak": "X"}}),
    ("op_start", {"kind": "rollback", "params": {"grace": "X"}}),
    ("op_start", {"kind": "restart", "params": {"ready_timeout": "X"}}),
])
def test_the_agent_refuses_an_unbounded_wait_before_it_changes_anything(bare_agent: AgentClient, verb: str,
                                                                         params: dict, value: float):
    """The agent is an edge too: a client that skips the CLI's check gets a usage error, and nothing is claimed."""
    agent = bare_agent
    workdir = Path(agent.host.workdir)
    params = json.loads(json.dumps(params).replace('"X"', json.dumps(value)))  # Infinity and NaN as JSON has them
    with pytest.raises(AgentError) as err:
        if verb == "server_wait_ready":
            list(agent.stream(verb, **params))
        else:
            agent.call(verb, **params)
    assert err.value.exit_code == 2, err.value
    assert "must be a finite number of seconds" in str(err.value) and "nothing was changed" in str(err.value)
    assert not (workdir / "ops").exists()
    assert not (workdir / "lock").exists() and not (workdir / "journal.jsonl").exists()


# =========================================================================== config values no host can run


@pytest.mark.parametrize(("text", "fragment"), [
    ('args = ["--model-path", "/m\\u0000x"]', "hosts.box.args[1]: contains a NUL byte"),
    ('env = { HF_TOKEN = "a\\u0000b" }', "hosts.box.env.HF_TOKEN: contains a NUL byte"),
    ('launch = ["python3\\u0000", "-m", "sglang.launch_server"]', "hosts.box.launch[0]: contains a NUL byte"),
    ('python = "/usr/bin/python3\\u0000"', "hosts.box.python: contains a NUL byte"),
    ('workdir = "/root/.dynctl\\u0000"', "hosts.box.workdir: contains a NUL byte"),
    ('env = { "PATH\\n" = "/bin" }', "hosts.box.env.'PATH\\n': not a valid environment variable name"),
    ('env = { "A\\nB" = "1" }', "not a valid environment variable name"),
    ('args = ["--speculative-disable-batch-threshold", "4"]',
     "hosts.box.args: remove --speculative-disable-batch-threshold; dynctl adds it itself"),
    ('args = ["--speculative-disable-batch-threshold=4"]',
     "hosts.box.args: remove --speculative-disable-batch-threshold; dynctl adds it itself"),
    ('args = ["--speculative-adaptive"]', "hosts.box.args: remove --speculative-adaptive; dynctl adds it itself"),
    ('args = ["--speculative-adaptive-config", "/x.json"]',
     "hosts.box.args: remove --speculative-adaptive-config; dynctl adds it itself"),
    ('args = ["--tp", "8", "--port=31000"]', "hosts.box.args: remove --port; dynctl adds it itself"),
    ('args = ["--enable-metrics"]', "hosts.box.args: remove --enable-metrics; dynctl adds it itself"),
])
@pytest.mark.parametrize("command", [["status"], ["deploy", "--threshold", "5", "--yes"], ["start", "--yes"]])
def test_config_values_no_host_can_run_exit_2_naming_file_host_and_key(tmp_path: Path, text: str, fragment: str,
                                                                       command: list[str]):
    path = tmp_path / "dynctl.toml"
    path.write_text(f'[hosts.box]\nssh = "root@127.0.0.1:{free_port()}"\n{text}\n')
    result = CliRunner().invoke(app, [*command, "--config", str(path)])
    said = one_line(result.output)
    assert result.exit_code == 2, said
    assert str(path) in said and fragment in said
    assert "connection refused" not in said


def test_args_that_only_look_like_dynctls_flags_are_kept(tmp_path: Path):
    from dynctl.base.config import load_config

    path = tmp_path / "dynctl.toml"
    path.write_text('[hosts.box]\nargs = ["--portal", "--speculative-num-steps", "3", "--model-path", "--port"]\n'
                    'env = { PATH_2 = "/bin" }\n')
    with pytest.raises(Exception, match="remove --port;"):  # the last one is the real flag
        load_config(path)
    path.write_text('[hosts.box]\nargs = ["--portal", "--speculative-num-steps", "3"]\nenv = { PATH_2 = "/bin" }\n')
    host = load_config(path).host("box")
    assert host.args == ("--portal", "--speculative-num-steps", "3") and host.env == {"PATH_2": "/bin"}
