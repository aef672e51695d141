"""The operator's server: a listening sglang launcher that dynctl did not start (SPEC §5, §8, §9).

A stand-in whose /proc cmdline is exactly `python -m sglang.launch_server --model-path ... --tp 8 --port P`
listens on the host's port. dynctl names it everywhere and never stops, signals or adopts it without the
operator's word for that very process (a prompt on a terminal, or --adopt; --yes alone is not enough);
another user's launcher is never taken over; the demo never touches it and moves to a free port. Taking it
over adopts it: its argv, environment and cwd become the baseline release, and a rollback to baseline
restarts exactly that launch.

The first half runs the agent through a Local transport (tests/servers); the second runs the CLI through
the real sshd and the `pct` stand-in against the demo host, with the sha256 of the sglang tree checked.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from dynctl.core import deploy as core
from dynctl.core import lifecycle
from dynctl.agent.client import AgentError
from dynctl.base.errors import OperationFailed, PreflightError
from lifecycle_harness import SHIM, Box, alive, box, listening, wait_for  # noqa: F401 - box is a fixture
from sshd_harness import free_port
from demo_box import dynctl, server_pid, session, tree_sha256

pytestmark = pytest.mark.slow

SECRET = "s3cr3t-value-never-printed"
NOBODY = 65534


def always(question: str) -> bool:
    return True


def standin_argv(port: int, python: str = sys.executable) -> list[str]:
    return [python, "-m", "sglang.launch_server", "--model-path", "/models/operator-model", "--tp", "8",
            "--port", str(port)]


@pytest.fixture(scope="module")
def anyone_shim() -> Iterator[Path]:
    """tests/servers copied where any uid can read it: a checkout and pytest's tmp dirs may be closed to others
    (mktemp and /tmp/pytest-of-root are 0700), and another user's stand-in must still start."""
    root = Path(tempfile.mkdtemp(prefix="dynctl-standin-", dir="/tmp"))
    shutil.copytree(SHIM.parent, root / "servers")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield root / "servers" / SHIM.name
    shutil.rmtree(root)


def spawn_standin(spawn, port: int, cwd: Path, user: int | None = None, shim: Path = SHIM) -> subprocess.Popen:
    """The operator's hand-started server (tests/servers behind sglang's launcher name), listening on `port`;
    run as `user` by the system's interpreter (stdlib only) from `shim`, which that user must be able to read."""
    env = dict(os.environ, PYTHONPATH=str(shim), OPERATOR_TOKEN=SECRET)
    env.pop("DYNCTL_SERVER_ID", None)
    argv = standin_argv(port)
    if user is not None:
        cwd = shim.parent / cwd.name
        argv = standin_argv(port, os.path.realpath(sys.executable))
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--", *argv]
    cwd.mkdir(parents=True, exist_ok=True)
    proc = spawn(argv, env=env, cwd=str(cwd), start_new_session=True)
    wait_for(lambda: listening(port), 30, what="the operator's server to listen")
    assert psutil.Process(proc.pid).cmdline() == argv[-len(standin_argv(port)):]  # setpriv execs: the same pid
    return proc


def signals_sent(workdir: Path) -> list[int]:
    path = workdir / "journal.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["pid"] for r in map(json.loads, lines) if r["event"] == "stop.signal"]


# ---------------------------------------------------------------- through the agent (Local transport)


def test_the_operators_server_is_named_and_nothing_without_the_word_touches_it(box: Box, tmp_path: Path):
    op = spawn_standin(box.spawn, box.port, tmp_path / "opcwd")
    state = lifecycle.find_server(box.agent)
    assert state.pid is None and state.state == "down"  # not ours: no managed server
    found = state.not_ours
    assert found["kind"] == "operator" and found["pid"] == op.pid and found["adoptable"] is True
    assert f"pid {op.pid}" in found["text"] and "not started by dynctl" in found["text"]
    assert "--tp 8" in found["text"] and "+`--enable-metrics`" in found["argv_diff"]

    with pytest.raises(PreflightError, match=f"(?s)pid {op.pid}, not started by dynctl.*--adopt") as err:
        lifecycle.stop(box.agent, grace=5)
    assert err.value.exit_code == 3
    with pytest.raises(PreflightError, match=f"(?s)stop refused.*pid {op.pid}.*--adopt") as err:
        lifecycle.stop_server(box.agent, grace=5)  # the agent itself refuses a plain stop
    assert err.value.exit_code == 3
    with pytest.raises(PreflightError, match=f"(?s)restart refused.*pid {op.pid}.*--adopt") as err:
        lifecycle.restart(box.agent, box.host, grace=5, ready_timeout=30)
    assert err.value.exit_code == 3
    with pytest.raises(PreflightError, match=f"(?s)restart refused: port {box.port} is served by pid {op.pid}"):
        lifecycle.restart_server(box.agent, None, grace=5, ready_timeout=30, baseline_argv=box.argv())
    with pytest.raises(AgentError, match=f"(?s)start refused: .*pid {op.pid}.*restart --adopt") as err:
        box.start()
    assert err.value.exit_code == 3
    # a word for another process (the start time the operator saw is not this one's) is refused too
    with pytest.raises(PreflightError, match="not the process that was confirmed"):
        lifecycle.restart_server(box.agent, None, grace=5, ready_timeout=30, baseline_argv=box.argv(),
                                 adopt={"pid": op.pid, "start": found["start"] + 1})
    assert alive(op.pid) and op.pid not in signals_sent(box.workdir) and box.pidfile() is None
    assert not (box.workdir / "adopted.json").exists()

    # `stop --pid N`, confirmed and pinned to its start time, still stops it
    result = lifecycle.stop(box.agent, grace=5, pid=op.pid)
    assert result["stopped"] and result["source"] == "operator"
    assert op.wait(10) == 0  # it drained on SIGTERM


def test_restart_with_the_word_adopts_its_argv_environment_and_cwd(box: Box, tmp_path: Path):
    cwd = tmp_path / "opcwd"
    op = spawn_standin(box.spawn, box.port, cwd)
    asked: list[str] = []
    ready = lifecycle.restart(box.agent, box.host, grace=10, ready_timeout=60,
                              adopt=lambda q: asked.append(q) or True)
    box.remember_server()
    assert f"Take over pid {op.pid}" in asked[0] and "not started by dynctl" in asked[0]
    # with no release in force the restart runs its own launch again: the question's diff is against that
    assert "(argv against what dynctl would run: none)" in asked[0], asked[0]
    assert op.wait(10) == 0 and op.pid in signals_sent(box.workdir)
    new = ready["pid"]
    proc = psutil.Process(new)
    assert proc.cmdline() == standin_argv(box.port)  # exactly the launch it had
    assert proc.environ()["OPERATOR_TOKEN"] == SECRET and proc.cwd() == str(cwd)
    state = lifecycle.find_server(box.agent)
    assert (state.pid, state.source) == (new, "pidfile")  # ours now
    adopted = box.workdir / "adopted.json"
    assert stat.S_IMODE(adopted.stat().st_mode) == 0o600
    assert json.loads(adopted.read_text())["env"]["OPERATOR_TOKEN"] == SECRET
    # the values are stored, never shown: not in status, not in the journal
    assert state.adopted["argv"] == standin_argv(box.port) and "OPERATOR_TOKEN" in state.adopted["env_keys"]
    assert SECRET not in json.dumps(box.agent.call("server_find"))
    assert SECRET not in (box.workdir / "journal.jsonl").read_text()
    # and the baseline is that launch: a plain restart keeps it
    again = lifecycle.restart(box.agent, box.host, grace=10, ready_timeout=60)
    box.remember_server()
    assert psutil.Process(again["pid"]).cmdline() == standin_argv(box.port)


def test_another_users_server_is_never_taken_over_only_stop_pid_stops_it(box: Box, tmp_path: Path, anyone_shim: Path):
    if os.geteuid() != 0:
        pytest.skip("starting a process as another uid needs root")
    op = spawn_standin(box.spawn, box.port, tmp_path / "nobody-cwd", user=NOBODY, shim=anyone_shim)
    assert psutil.Process(op.pid).uids().real == NOBODY
    state = lifecycle.find_server(box.agent)
    assert state.not_ours["kind"] == "operator" and state.not_ours["adoptable"] is False
    for attempt in (lambda: lifecycle.restart(box.agent, box.host, grace=5, ready_timeout=30, adopt=always),
                    lambda: lifecycle.stop(box.agent, grace=5, adopt=always)):
        with pytest.raises(PreflightError, match=f"(?s)pid {op.pid}.*runs as nobody.*never takes over another "
                                                 f"user's server, not even with --adopt") as err:
            attempt()
        assert err.value.exit_code == 3
    # the agent refuses the word too, naming the owner, whatever the client says
    with pytest.raises(PreflightError, match=f"(?s)restart refused.*pid {op.pid}.*runs as nobody \\(uid {NOBODY}\\)"):
        lifecycle.restart_server(box.agent, None, grace=5, ready_timeout=30, baseline_argv=box.argv(),
                                 adopt={"pid": op.pid, "start": state.not_ours["start"]})
    with pytest.raises(AgentError, match="stop refused.*runs as nobody.*not even with --adopt") as err:
        lifecycle.stop_server(box.agent, grace=5, adopt={"pid": op.pid, "start": state.not_ours["start"]})
    assert err.value.exit_code == 3
    assert alive(op.pid) and op.pid not in signals_sent(box.workdir)
    assert not (box.workdir / "adopted.json").exists()
    result = lifecycle.stop(box.agent, grace=5, pid=op.pid)  # the operator named it: confirmed, pinned
    assert result["stopped"] and op.wait(10) == 0


def test_a_pidfile_naming_another_users_process_never_makes_it_ours(box: Box, tmp_path: Path, anyone_shim: Path):
    """A server.json that names another uid's launcher (its real pid, start time and argv) does not make it
    ours: stop refuses it and signals nothing."""
    if os.geteuid() != 0:
        pytest.skip("starting a process as another uid needs root")
    op = spawn_standin(box.spawn, box.port, tmp_path / "nobody-cwd", user=NOBODY, shim=anyone_shim)
    box.workdir.mkdir(parents=True, exist_ok=True)
    start = int(Path(f"/proc/{op.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    record = {"pid": op.pid, "pid_start": start, "argv": psutil.Process(op.pid).cmdline(), "port": box.port,
              "marker": None}
    (box.workdir / "server.json").write_text(json.dumps(record))
    (box.workdir / "server.json").chmod(0o600)
    state = lifecycle.find_server(box.agent)
    assert state.pid is None and "runs as nobody" in state.pidfile
    with pytest.raises(PreflightError, match=f"pid {op.pid}.*runs as nobody"):
        lifecycle.stop(box.agent, grace=5)
    assert alive(op.pid) and op.pid not in signals_sent(box.workdir)


def test_a_refused_start_after_the_stop_never_claims_nothing_was_killed(box: Box, tmp_path: Path):
    """Our server, on SIGTERM, leaves a launcher for the port behind that dynctl did not start; the rollback's
    start is refused after dynctl stopped the server: the message must say the rollback failed and what it
    did, never "nothing was changed and nothing was killed"."""
    site = tmp_path / "stranger-site" / "sglang"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "launch_server.py").write_text("import time\nwhile True:\n    time.sleep(60)\n")
    code = (
        "import os, signal, subprocess, sys\n"
        "env = {k: v for k, v in os.environ.items() if k != 'DYNCTL_SERVER_ID'}\n"
        f"env['PYTHONPATH'] = {str(site.parent)!r}\n"
        "port = sys.argv[2]\n"
        "def leave_a_launcher():\n"
        "    p = subprocess.Popen([sys.executable, '-m', 'sglang.launch_server', '--port', port], env=env,\n"
        "                         start_new_session=True, stdin=subprocess.DEVNULL)\n"
        f"    open({str(tmp_path / 'stranger.pid')!r}, 'w').write(str(p.pid))\n"
        "original = signal.signal\n"
        "def chained(sig, handler):\n"  # the server's own SIGTERM handler runs after the launcher is left behind
        "    if sig == signal.SIGTERM and callable(handler):\n"
        "        inner = handler\n"
        "        handler = lambda *a: (leave_a_launcher(), inner(*a))\n"
        "    return original(sig, handler)\n"
        "signal.signal = chained\n"
        "sys.argv = [sys.argv[0], '--port', port]\n"
        f"import runpy; runpy.run_path({str(SHIM.parent / 'lifecycle_server.py')!r}, run_name='__main__')\n"
    )
    lifecycle.start_server(box.agent, [sys.executable, "-c", code, "--port", str(box.port)])
    box.remember_server()
    lifecycle.wait_ready(box.agent, 60)
    try:
        with pytest.raises(OperationFailed) as err:
            core.rollback(box.agent, box.host, to="baseline", grace=10, ready_timeout=30)
        message = str(err.value)
        assert err.value.exit_code == 1
        assert "rollback to baseline failed" in message and "start refused" in message
        assert "nothing was changed" not in message and "nothing was killed" not in message
        assert "stopped the server" in message
    finally:
        stranger = tmp_path / "stranger.pid"
        if stranger.exists():
            os.kill(int(stranger.read_text()), signal.SIGKILL)


# ---------------------------------------------------------------- the CLI on the demo host (sshd, pct)


def _standin_on(config: Path, tmp_path: Path, owned: list[subprocess.Popen]) -> subprocess.Popen:
    port = session(config).host.port

    def spawn(argv, **kw):
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                **kw)
        owned.append(proc)
        return proc

    return spawn_standin(spawn, port, tmp_path / "opcwd")


@pytest.mark.parametrize("via", ["pct", "ssh"])
def test_deploy_yes_refuses_the_operators_server_and_adopt_takes_it_over(demo_box, tmp_path, owned, via):
    config = demo_box(via=via)
    op = _standin_on(config, tmp_path, owned)
    before = tree_sha256(config)

    dry = dynctl("deploy", "--threshold", "5", "--dry-run", config=config)
    assert dry.returncode == 0, dry.stderr
    assert f"pid {op.pid} on the port was not started by dynctl" in dry.stdout.replace("\n", " ")
    plan = json.loads(dynctl("deploy", "--threshold", "5", "--dry-run", "--json", config=config).stdout)
    assert plan["launch_argv"] == [*standin_argv(session(config).host.port), "--speculative-disable-batch-threshold",
                                   "5", "--enable-metrics"]  # its own launch, dynctl's flags added
    plan = json.loads(dynctl("deploy", "--threshold", "5", "--dry-run", "--json", "--use-config-args",
                             config=config).stdout)
    assert plan["operator_server"]["pid"] == op.pid and plan["operator_server"]["started_by_dynctl"] is False
    assert plan["operator_server"]["cmdline"] == standin_argv(session(config).host.port)
    assert "-`sglang.launch_server`" in plan["operator_server"]["argv_diff"]
    status = json.loads(dynctl("status", "--json", config=config).stdout)
    assert f"pid {op.pid}" in status["server"]["not_ours"] and "not started by dynctl" in status["server"]["not_ours"]

    for argv in (["deploy", "--threshold", "5", "--yes"], ["rollback", "--yes"], ["restart", "--yes"],
                 ["stop", "--yes"]):
        res = dynctl(*argv, config=config)
        assert res.returncode == 3, (argv, res.stdout, res.stderr)
        text = " ".join(res.stderr.split())
        assert f"pid {op.pid}" in text and "not started by dynctl" in text and "--adopt" in text, text
        assert "nothing was changed" in text
    assert op.poll() is None and tree_sha256(config) == before
    assert not server_pid(config)

    # the stand-in cannot run the threshold: the configured (simulated) launch takes its place
    res = dynctl("deploy", "--threshold", "5", "--yes", "--adopt", "--use-config-args", "--soak", "0", config=config)
    assert res.returncode == 0, res.stdout + res.stderr
    assert op.wait(30) == 0  # taken over: SIGTERM, drained
    assert "taking over pid %d" % op.pid in " ".join(res.stdout.split())
    assert server_pid(config) and tree_sha256(config) != before
    assert SECRET not in res.stdout + res.stderr

    back = dynctl("rollback", "--to", "baseline", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0, back.stdout + back.stderr
    pid = server_pid(config)
    restored = psutil.Process(pid)
    assert restored.cmdline() == standin_argv(session(config).host.port)
    assert restored.environ()["OPERATOR_TOKEN"] == SECRET and restored.cwd() == str(tmp_path / "opcwd")
    assert tree_sha256(config) == before


def test_the_demo_leaves_the_operators_server_alone_and_takes_a_free_port(tmp_path, isolated_home, owned):
    from sglang_trees import sglang_wheel

    data = tmp_path / "data"
    cache = data / "dynctl" / "demo" / "cache"
    cache.mkdir(parents=True)
    wheel = sglang_wheel("0.5.9")
    shutil.copy(wheel, cache / wheel.name)
    env = dict(os.environ, HOME=str(isolated_home), XDG_DATA_HOME=str(data))
    env.pop("DYNCTL_CONFIG", None)
    port = free_port()

    def spawn(argv, **kw):
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                **kw)
        owned.append(proc)
        return proc

    op = spawn_standin(spawn, port, tmp_path / "opcwd")
    config = isolated_home / ".config" / "dynctl" / "config.toml"

    def run(*args):
        return subprocess.run([sys.executable, "-m", "dynctl", *args], capture_output=True, text=True, env=env,
                              stdin=subprocess.DEVNULL, timeout=600)

    try:
        out = run("demo", "--no-tui", "--port", str(port), "--level-seconds", "0.5", "--time-scale", "20")
        assert out.returncode == 0, out.stdout + out.stderr
        text = " ".join(out.stdout.split())
        used = tomllib.loads(config.read_text())["hosts"]["demo"]["port"]
        assert used != port and f"port {port} is taken by" in text and f"uses port {used} instead" in text
        assert op.poll() is None and psutil.Process(op.pid).status() != psutil.STATUS_ZOMBIE
        workdir = Path(tomllib.loads(config.read_text())["hosts"]["demo"]["workdir"])
        assert op.pid not in signals_sent(workdir)
        # its own previous server it may restart: a second demo keeps the free port's server as ours
        again = run("demo", "--no-tui", "--port", str(port), "--level-seconds", "0.5", "--time-scale", "20")
        assert again.returncode == 0, again.stdout + again.stderr
        assert op.poll() is None and op.pid not in signals_sent(workdir)
    finally:
        run("stop", "--host", "demo", "--yes", "--grace", "5")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_on_a_terminal_the_prompt_names_the_takeover_and_only_yes_takes_it_over(demo_box, tmp_path, owned):
    config = demo_box(via="local")
    op = _standin_on(config, tmp_path, owned)
    port = session(config).host.port
    env = dict(os.environ, TMUX_TMPDIR=str(tmp_path), TERM="xterm-256color")
    name = "dynctl-takeover"

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-J", "-t", name], capture_output=True, text=True,
                              env=env).stdout

    def run(answers: list[str]) -> str:
        command = f"{sys.executable} -m dynctl restart --grace 10 --config {config}; echo EXITED-$?; sleep 600"
        subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "200", "-y", "50", command], check=True,
                       env=env)
        try:
            for answer in answers:
                wait_for(lambda: screen().rstrip().endswith("[y/N]:"), 60, what="a prompt")
                text = screen()
                subprocess.run(["tmux", "send-keys", "-t", name, answer, "Enter"], check=True, env=env)
                wait_for(lambda: screen() != text, 10, what="the answer to be read")
            return wait_for(lambda: "EXITED-" in screen() and screen(), 120, what="dynctl to exit")
        finally:
            subprocess.run(["tmux", "kill-session", "-t", name], env=env, capture_output=True)

    declined = " ".join(run(["n"]).split())
    assert f"Take over pid {op.pid} on box, which was not started by dynctl?" in declined
    assert "EXITED-3" in declined and "--adopt" in declined
    assert op.poll() is None and not server_pid(config)

    accepted = " ".join(run(["y", "y"]).split())
    assert "EXITED-0" in accepted, accepted
    assert op.wait(30) == 0
    restored = psutil.Process(server_pid(config))
    assert restored.cmdline() == standin_argv(port) and restored.environ()["OPERATOR_TOKEN"] == SECRET


def test_rollback_and_stop_take_it_over_only_with_adopt(demo_box, tmp_path, owned):
    config = demo_box(via="local")
    port = session(config).host.port
    op = _standin_on(config, tmp_path, owned)
    before = tree_sha256(config)
    res = dynctl("rollback", "--yes", "--adopt", "--soak", "0", config=config)
    assert res.returncode == 0, res.stdout + res.stderr
    assert op.wait(30) == 0
    pid = server_pid(config)
    assert psutil.Process(pid).cmdline() == standin_argv(port) and tree_sha256(config) == before

    # the restored launch is ours now: a plain stop stops it; a second hand-started one needs --adopt again
    assert dynctl("stop", "--yes", config=config).returncode == 0 and not alive(pid)
    second = _standin_on(config, tmp_path / "2", owned)
    refused = dynctl("stop", "--yes", config=config)
    assert refused.returncode == 3 and f"pid {second.pid}, not started by dynctl" in " ".join(refused.stderr.split())
    assert second.poll() is None
    taken = dynctl("stop", "--yes", "--adopt", config=config)
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert second.wait(30) == 0
