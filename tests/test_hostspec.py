"""A host's settings have one set of defaults and rules, read by the config and by the agent alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynctl.agent import archive
from dynctl.base import hostspec
from dynctl.base.config import HostConfig, load_config
from dynctl.base.errors import ConfigError
from dynctl.core.lifecycle import ServerState, launch_in_force, server_argv


def ask_agent(tmp_path, host):
    request = {"protocol": 1, "verb": "ping", "params": {}, "host": {"workdir": str(tmp_path / "w"), **host}}
    # the agent as its archive lays it out: its package beside this checkout's dynctl (hostspec, sglang)
    path = os.pathsep.join([str(archive.remote_dir()), str(Path(hostspec.__file__).parent.parent)])
    proc = subprocess.run([sys.executable, "-m", "dynctl_agent"], input=json.dumps(request), capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": path}, timeout=60)
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("key, value, problem", [
    ("port", 70000, "expected an integer 1-65535, got 70000"),
    ("port", True, "expected an integer 1-65535, got True"),
    ("keep_history", 0, "an integer 1-100000, got 0"),
    ("workdir", "rel/dir", "'rel/dir' is relative"),
    ("workdir", "/", "is the root directory itself"),
])
def test_the_config_and_the_agent_refuse_the_same_values_in_the_same_words(tmp_path, key, value, problem):
    toml = tmp_path / "dynctl.toml"
    toml.write_text(f"[hosts.a]\n{key} = {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=f"hosts.a.{key}: .*{problem[:20]}"):
        load_config(str(toml))
    answer = ask_agent(tmp_path, {key: value})
    assert answer["ok"] is False and answer["kind"] == "usage" and problem in answer["error"], answer
    assert not (tmp_path / "w").exists()


def test_the_defaults_are_written_once():
    host = HostConfig(name="h")
    assert (host.workdir, host.port, host.keep_history) == (
        hostspec.DEFAULT_WORKDIR, hostspec.DEFAULT_PORT, hostspec.DEFAULT_KEEP_HISTORY)
    assert "dynctl/base/hostspec.py" in archive.agent_files()


def test_a_plain_start_runs_what_the_agent_would_run():
    host = HostConfig(name="h", python="/py", args=("--tp", "2"), port=31000)
    configured = ["/py", "-m", "sglang.launch_server", "--tp", "2", "--port", "31000", "--enable-metrics"]
    assert server_argv(host) == configured
    state = ServerState.from_agent({"state": "down", "port": 31000})
    assert launch_in_force(state, host) == (configured, "the configured launch argv (no release in force)")
    adopted = {"argv": ["/usr/bin/python3", "-m", "sglang.launch_server"], "pid": 42}
    assert hostspec.plain_start({"release": "3-x", "argv": None}, adopted, configured)[:2] == (
        adopted["argv"], "the adopted launch of pid 42, the baseline (release 3-x records none)")
    assert hostspec.plain_start({"release": "3-x", "argv": ["a"]}, adopted, configured)[:2] == (
        ["a"], "the launch argv of release 3-x")
