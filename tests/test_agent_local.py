"""The host agent through the Local transport: upload by hash, protocol, inspect, bad hosts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynctl import resources
from dynctl.agent import AgentClient, AgentError
from dynctl.config import HostConfig
from dynctl.errors import PreflightError
from dynctl.inventory import describe_host
from dynctl.transport.local import Local


def make_agent(tmp_path: Path, **overrides) -> AgentClient:
    fields = {"name": "t", "python": sys.executable, "workdir": str(tmp_path / "work"), "port": 1}
    fields.update(overrides)
    return AgentClient(Local(), HostConfig(**fields))


def test_uploads_once_under_its_hash(tmp_path):
    agent = make_agent(tmp_path)
    assert agent.call("ping")["pong"] is True
    uploaded = tmp_path / "work" / f"agent-{resources.agent_digest()}.py"
    assert uploaded.read_bytes() == resources.agent_source()
    assert uploaded.stat().st_mode & 0o777 == 0o600
    assert agent.round_trips == 3  # missing → upload → call
    agent.call("ping")
    assert agent.round_trips == 4  # already there: one round trip


def test_workdir_with_spaces_and_dollar(tmp_path):
    agent = make_agent(tmp_path, workdir=str(tmp_path / "a dir $HOME `x`"))
    info = agent.call("inspect")
    assert info["workdir"]["path"] == str(tmp_path / "a dir $HOME `x`")
    assert (tmp_path / "a dir $HOME `x`" / f"agent-{resources.agent_digest()}.py").is_file()


def test_missing_python_is_a_preflight_error(tmp_path):
    agent = make_agent(tmp_path, python=str(tmp_path / "no" / "python3"))
    with pytest.raises(PreflightError, match="python interpreter .* not found"):
        agent.call("inspect")


def test_workdir_not_creatable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    agent = make_agent(tmp_path, workdir=str(blocker / "work"))
    with pytest.raises(PreflightError, match="cannot write the dynctl agent"):
        agent.call("ping")
    assert blocker.read_text() == ""


def test_unknown_verb_and_protocol_mismatch(tmp_path):
    agent = make_agent(tmp_path)
    with pytest.raises(AgentError, match="unknown agent verb 'nope'") as info:
        agent.call("nope")
    assert info.value.exit_code == 2
    script = resources.remote_dir() / "dynctl_agent.py"
    proc = subprocess.run([sys.executable, str(script)], input=json.dumps({"protocol": 999, "verb": "ping"}),
                          capture_output=True, text=True)
    answer = json.loads(proc.stdout)
    assert proc.returncode == 2
    assert answer["ok"] is False and "protocol 1" in answer["error"] and "999" in answer["error"]


def test_inspect_without_sglang_says_so(tmp_path):
    agent = make_agent(tmp_path, env={"PYTHONPATH": str(tmp_path / "empty")})
    info = describe_host(agent.host, agent)
    assert info.sglang_version is None
    assert info.strategy == "absent"
    assert info.python_version == "%d.%d.%d" % sys.version_info[:3]


def test_inspect_finds_sglang_without_importing_it(tmp_path):
    """A tree whose __init__ raises on import is still found, with its version from dist-info."""
    site = tmp_path / "site"
    pkg = site / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('heavy import attempted')\n")
    dist = site / "sglang-0.5.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.9\n")
    agent = make_agent(tmp_path, env={"PYTHONPATH": str(site)})
    raw = agent.call("inspect")
    assert raw["sglang"] == {"version": "0.5.9", "package_dir": str(pkg)}


def test_inspect_reports_port_listener(tmp_path):
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        raw = make_agent(tmp_path, port=port).call("inspect")
    assert raw["port_in_use"] is True
    assert [p["pid"] for p in raw["port_listeners"]] == [os.getpid()]
