"""Config lookup order, parsing, and errors that name file, key and what was expected (SPEC §3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynctl.base.config import LOCAL_HOST, find_config_path, load_config, parse_ssh_target
from dynctl.base.errors import ConfigError

SPEC_EXAMPLE = """
default_host = "glm5"

[hosts.glm5]
ssh = "root@127.0.0.1:2222"
pct = 129
python = "/opt/sglang/bin/python3"
workdir = "/root/.dynctl"
port = 30000
env = { SGLANG_ENABLE_SPEC_V2 = "1" }
args = ["--model-path", "/models/GLM-5-NVFP4", "--tp", "8"]
"""


def write(tmp_path: Path, text: str, name: str = "dynctl.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_spec_example_parses(tmp_path):
    cfg = load_config(write(tmp_path, SPEC_EXAMPLE))
    host = cfg.host(None)
    assert host.name == "glm5"
    assert str(host.ssh) == "root@127.0.0.1:2222"
    assert host.pct == 129
    assert host.env == {"SGLANG_ENABLE_SPEC_V2": "1"}
    assert host.args[:2] == ("--model-path", "/models/GLM-5-NVFP4")
    assert host.launch_argv() == ["/opt/sglang/bin/python3", "-m", "sglang.launch_server"]
    assert host.route == "ssh root@127.0.0.1:2222 → pct 129"


def test_lookup_order(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".config" / "dynctl").mkdir(parents=True)
    user = write(home / ".config" / "dynctl", "", "config.toml")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("DYNCTL_CONFIG", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert find_config_path() == user
    local = write(cwd, "")
    assert find_config_path() == local
    env = write(tmp_path, "", "env.toml")
    monkeypatch.setenv("DYNCTL_CONFIG", str(env))
    assert find_config_path() == env
    explicit = write(tmp_path, "", "explicit.toml")
    assert find_config_path(explicit) == explicit


def test_no_config_means_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DYNCTL_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = load_config()
    assert cfg.path is None
    assert cfg.host(None).name == LOCAL_HOST
    assert cfg.host(None).ssh is None


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[hosts.a]\nssh = 'root@x'\npct = 'abc'\n", "hosts.a.pct: expected a Proxmox container id"),
        ("[hosts.a]\nport = 70000\n", "hosts.a.port: expected an integer 1-65535"),
        ("[hosts.a]\nport = '30000'\n", "hosts.a.port"),
        ("[hosts.a]\nargs = '--tp 8'\n", "hosts.a.args: expected a list of strings"),
        ("[hosts.a]\nenv = { 'BAD-NAME' = '1' }\n", "hosts.a.env.BAD-NAME"),
        ("[hosts.a]\nbogus = 1\n", "hosts.a.bogus: unknown key"),
        ("default_host = 'b'\n[hosts.a]\n", "default_host = 'b' names no [hosts.b]"),
        ("[hosts.a]\nssh = 'root@host:99999'\n", "hosts.a.ssh: port 99999"),
        ("[hosts.a]\nlaunch = []\n", "hosts.a.launch: must not be empty"),
        ("[hosts.a\n", "TOML syntax error"),
        ("hosts = 3\n", "'hosts' must be a table"),
        ("[hosts.a]\nstrategy = 'adaptive'\n", "hosts.a.strategy: expected one of 'auto', 'patch', 'native'"),
        ("[hosts.a]\nstrategy = 1\n", "hosts.a.strategy: expected one of"),
        ("[hosts.a]\nstrategy = 'Native'\n", "got 'Native'"),
    ],
)
def test_errors_name_file_and_key(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert fragment in str(info.value)
    assert info.value.exit_code == 2


def test_unknown_host_name(tmp_path):
    cfg = load_config(write(tmp_path, SPEC_EXAMPLE))
    with pytest.raises(ConfigError, match="no host named 'nobody' \\(defined: glm5\\)"):
        cfg.host("nobody")


def test_missing_explicit_config(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.toml")


@pytest.mark.parametrize(
    ("text", "user", "host", "port"),
    [("root@pve", "root", "pve", None), ("pve", None, "pve", None), ("u@127.0.0.1:2222", "u", "127.0.0.1", 2222),
     ("u@[::1]:22", "u", "::1", 22)],
)
def test_ssh_targets(text, user, host, port):
    t = parse_ssh_target(text)
    assert (t.user, t.host, t.port) == (user, host, port)


@pytest.mark.parametrize("strategy", ["auto", "patch", "native"])
def test_strategy_key(tmp_path, strategy):
    cfg = load_config(write(tmp_path, f"[hosts.a]\nstrategy = '{strategy}'\n"))
    assert cfg.host("a").strategy == strategy


def test_strategy_defaults_to_auto(tmp_path):
    assert load_config(write(tmp_path, SPEC_EXAMPLE)).host(None).strategy == "auto"
