"""`dynctl adopt`: a hand-started server becomes dynctl's without a restart, and later starts keep its launch.

The first tests run the agent through a Local transport against a stand-in whose /proc cmdline is sglang's
launcher (tests/servers); the last one hand-starts the simulator on a demo host, adopts it with the CLI, and
deploys and rolls back through it: the operator's own flags survive the deploy, and the rollback restores
exactly the adopted launch.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from dynctl.core import adoption, lifecycle
from dynctl.base.errors import PreflightError
from dynctl.live.snapshot import build_snapshot
from lifecycle_harness import SHIM, Box, box, listening, wait_for  # noqa: F401 - box is a fixture
from demo_box import dynctl, server_pid, session

pytestmark = pytest.mark.slow

SECRET = "adopt-secret-never-printed"


def hand_start(box: Box, cwd: Path, log: Path | None, *flags: str) -> subprocess.Popen:
    """The operator's server, started by hand from `cwd` with its output in `log` (None: no file)."""
    env = dict(os.environ, PYTHONPATH=str(SHIM), OPERATOR_TOKEN=SECRET)
    env.pop("DYNCTL_SERVER_ID", None)
    cwd.mkdir(parents=True, exist_ok=True)
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
    proc = box.spawn([sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/hand", "--port",
                      str(box.port), *flags], env=env, cwd=str(cwd), start_new_session=True, stdout=out, stderr=out)
    wait_for(lambda: listening(box.port), 30, what="the hand-started server to listen")
    return proc


def test_adopt_records_the_launch_and_leaves_the_server_running(box: Box, tmp_path: Path):
    log = tmp_path / "hand.log"
    op = hand_start(box, tmp_path / "opcwd", log, "--max-running-requests", "64")
    asked: list[str] = []
    result = adoption.adopt(box.agent, confirm=asked.append)
    assert f"Adopt pid {op.pid}" in asked[0] and "not started by dynctl" in asked[0] and "keeps running" in asked[0]
    assert result["adopted"] is True and result["pid"] == op.pid
    assert result["log"] == str(log) and result["cwd"] == str(tmp_path / "opcwd")
    assert "OPERATOR_TOKEN" in result["env_keys"] and SECRET not in json.dumps(result)
    record = box.workdir / "adopted.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert json.loads(record.read_text())["argv"] == psutil.Process(op.pid).cmdline()
    assert op.poll() is None  # not restarted, not signalled

    state = lifecycle.find_server(box.agent)  # now dynctl's server: ready, and its own log
    assert (state.pid, state.source, state.state, state.not_ours) == (op.pid, "adopted", "ready", None)
    assert state.log == str(log)
    assert any("server_args" in line for line in lifecycle.read_log(box.agent, 50))
    again = adoption.adopt(box.agent, confirm=asked.append)
    assert again["adopted"] is False and len(asked) == 1

    # restart needs no second word: the adopted launch, environment and cwd come back
    ready = lifecycle.restart(box.agent, box.host, grace=10, ready_timeout=60)
    box.remember_server()
    assert op.wait(10) == 0
    proc = psutil.Process(ready["pid"])
    assert proc.cmdline() == [sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/hand", "--port",
                              str(box.port), "--max-running-requests", "64"]
    assert proc.environ()["OPERATOR_TOKEN"] == SECRET and proc.cwd() == str(tmp_path / "opcwd")


def test_a_server_without_a_log_file_shows_none_and_nothing_else_is_adopted(box: Box, tmp_path: Path):
    with pytest.raises(PreflightError, match=f"no sglang server listens on port {box.port}") as err:
        adoption.adopt(box.agent)
    assert err.value.exit_code == 3
    box.start_ready()  # a server workdir/server.log already speaks of
    lifecycle.stop(box.agent, grace=5)
    hand_start(box, tmp_path / "opcwd", None)
    adoption.adopt(box.agent)
    state = lifecycle.find_server(box.agent)
    assert state.source == "adopted" and state.log is None
    assert lifecycle.read_log(box.agent, 50) == []  # never the previous server's log
    # the live view: ready, not "draining" from the previous server's SIGTERM line of a moment ago
    snap = None
    for raw in box.agent.stream("watch", interval=0.2, max_items=3, log_lines=50, gpus=False):
        snap = build_snapshot(raw, "box", snap)
        assert not any("SIGTERM received" in line for line in snap.log_lines)
    assert (snap.pid, snap.state) == (state.pid, "ready")


def test_adopt_then_deploy_keeps_the_hand_tuned_flags_and_rollback_restores_them(demo_box, tmp_path, owned):
    config = demo_box(via="local")
    host = session(config).host
    argv = [*lifecycle.server_argv(host), "--mem-fraction-static", "0.77"]
    opcwd = tmp_path / "opcwd"
    opcwd.mkdir()
    proc = subprocess.Popen(argv, env=dict(os.environ, **host.env, OPERATOR_TOKEN=SECRET), cwd=str(opcwd),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    owned.append(proc)
    wait_for(lambda: listening(host.port), 60, what="the hand-started simulator to listen")

    res = dynctl("adopt", "--yes", config=config)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"pid {proc.pid}" in res.stdout and proc.poll() is None
    status = json.loads(dynctl("status", "--json", config=config).stdout)
    assert status["server"]["pid"] == proc.pid and status["server"]["state"] in ("starting", "ready")

    dry = json.loads(dynctl("deploy", "--threshold", "5", "--dry-run", "--json", config=config).stdout)
    assert dry["launch_argv"] == [*argv, "--speculative-disable-batch-threshold", "5"]
    config_args = json.loads(dynctl("deploy", "--threshold", "5", "--dry-run", "--json", "--use-config-args",
                                    config=config).stdout)
    assert "--mem-fraction-static" not in config_args["launch_argv"]

    res = dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
    assert res.returncode == 0, res.stdout + res.stderr
    proc.wait(30)  # drained on SIGTERM; the simulator, like sglang, ends its own tree with SIGKILL
    deployed = psutil.Process(server_pid(config))
    assert deployed.cmdline()[-2:] == ["--speculative-disable-batch-threshold", "5"] and "0.77" in deployed.cmdline()
    assert deployed.environ()["OPERATOR_TOKEN"] == SECRET and deployed.cwd() == str(opcwd)  # exactly its launch
    res = dynctl("restart", "--yes", config=config)  # the release's argv, in the adopted environment still
    assert res.returncode == 0, res.stdout + res.stderr
    assert psutil.Process(server_pid(config)).environ()["OPERATOR_TOKEN"] == SECRET

    back = dynctl("rollback", "--to", "baseline", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0, back.stdout + back.stderr
    assert psutil.Process(server_pid(config)).cmdline() == argv


def test_adopt_write_config_records_the_launch_in_the_operators_file_keeping_it(box: Box, tmp_path: Path):
    import tomllib

    cfg = tmp_path / "dynctl.toml"
    original = ("# the operator's fleet\ndefault_host = \"box\"\n\n[hosts.box]  # the hand-run box\n"
                f"workdir = \"{box.workdir}\"\nport = {box.port}\npython = \"python3\"  # keep this comment\n"
                f"env = {{ PYTHONPATH = \"{SHIM}\" }}\n\n# another host, untouched\n[hosts.other]\nport = 31000\n")
    cfg.write_text(original)
    op = hand_start(box, tmp_path / "opcwd", None, "--max-running-requests", "64")
    res = dynctl("adopt", "--yes", "--write-config", config=cfg)
    assert res.returncode == 0, res.stdout + res.stderr
    assert op.poll() is None
    text = cfg.read_text()
    host = tomllib.loads(text)["hosts"]["box"]
    assert host["launch"] == [sys.executable, "-m", "sglang.launch_server"]
    assert host["args"] == ["--model-path", "/models/hand", "--max-running-requests", "64"]  # --port is dynctl's
    assert host["python"] == sys.executable and host["env"] == {"PYTHONPATH": str(SHIM)}
    for kept in ("# the operator's fleet", "[hosts.box]  # the hand-run box", "# keep this comment",
                 "\n# another host, untouched\n[hosts.other]\n"):
        assert kept in text
    assert SECRET not in text  # the environment stays in the 0600 record on the host, never in the config
