"""Groups, gateways and worker URLs in the config, and what --host GROUP / --hosts name; bad ones exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dynctl.base.config import load_config
from dynctl.base.errors import ConfigError, UsageError
from dynctl.core.fleet import fleet_target

FLEET = """
[hosts.a]
ssh = "root@10.0.0.1"
[hosts.b]
ssh = "root@10.0.0.2:2222"
port = 31000
[hosts.c]
worker_url = "http://gpu-c.internal:30000/"
[hosts.d]

[groups.prod]
hosts = ["a", "b", "edge"]
gateway = "http://127.0.0.1:30080"
admin_key_env = "SMG_ADMIN_KEY"

[groups.edge]
hosts = ["c"]

[groups.lab]
hosts = ["d", "a"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "dynctl.toml"
    path.write_text(text)
    return path


def test_groups_expand_in_order_with_their_gateways(tmp_path):
    cfg = load_config(write(tmp_path, FLEET))
    fleet = fleet_target(cfg, "prod", None)
    assert [m.host.name for m in fleet.members] == ["a", "b", "c"]
    assert [g.url for g in fleet.gateways] == ["http://127.0.0.1:30080"]
    # c is in prod through edge: prod's gateway routes to it too
    assert [g.url for g in fleet.members[2].gateways] == ["http://127.0.0.1:30080"]
    lab = fleet_target(cfg, "lab", None)
    assert [m.host.name for m in lab.members] == ["d", "a"]
    assert lab.members[0].gateways == () and lab.members[1].gateways[0].group == "prod"


def test_worker_url_defaults_to_the_ssh_host_and_port(tmp_path):
    cfg = load_config(write(tmp_path, FLEET))
    assert cfg.hosts["a"].gateway_url == "http://10.0.0.1:30000"
    assert cfg.hosts["b"].gateway_url == "http://10.0.0.2:31000"  # the server's port, not ssh's
    assert cfg.hosts["c"].gateway_url == "http://gpu-c.internal:30000"
    assert cfg.hosts["d"].gateway_url == "http://127.0.0.1:30000"


def test_hosts_list_mixes_hosts_and_groups_each_once(tmp_path):
    cfg = load_config(write(tmp_path, FLEET))
    fleet = fleet_target(cfg, None, "d, edge,a,lab")
    assert [m.host.name for m in fleet.members] == ["d", "c", "a"]
    assert fleet_target(cfg, "a", None) is None  # one host: the one-host command
    assert fleet_target(cfg, None, None) is None


@pytest.mark.parametrize("hosts, host, message", [
    ("a,,b", None, "none empty"),
    ("a,zz", None, "no host or group named 'zz'"),
    ("a", "b", "give one of them"),
])
def test_bad_hosts_lists_are_usage_errors(tmp_path, hosts, host, message):
    cfg = load_config(write(tmp_path, FLEET))
    with pytest.raises(UsageError, match=message):
        fleet_target(cfg, host, hosts)


def test_a_group_given_to_a_one_host_command_is_named(tmp_path):
    cfg = load_config(write(tmp_path, FLEET))
    with pytest.raises(UsageError, match="'prod' is a group"):
        cfg.host("prod")


@pytest.mark.parametrize("text, message", [
    ('[groups.x]\nhosts = ["a", "nope"]', r"groups.x.hosts: 'nope' is neither a host nor a group"),
    ('[groups.x]\nhosts = ["y"]\n[groups.y]\nhosts = ["z"]\n[groups.z]\nhosts = ["x"]',
     r"groups form a cycle: x → y → z → x"),
    ('[groups.x]\nhosts = ["x"]', r"cycle: x → x"),
    ('[groups."bad name"]\nhosts = ["a"]', r"\[groups.bad name\]: a group name uses letters"),
    ('[groups.a]\nhosts = ["a"]', r"'a' is also a host name"),
    ('[groups.x]\nhosts = []', r"groups.x.hosts: expected a non-empty list"),
    ('[groups.x]\nhosts = ["a", "a"]', r"'a' is listed twice"),
    ('[groups.x]\nhosts = ["a"]\ngateway = "10.0.0.9:30080"', r"groups.x.gateway: expected http://HOST"),
    ('[groups.x]\nhosts = ["a"]\ngateway = "http://admin:s3cret@gw:30080"', r"must not carry credentials"),
    ('[groups.x]\nhosts = ["a"]\ngateway = "http://gw:1"\nadmin_key_env = "KEY VALUE"', r"admin_key_env: expected"),
    ('[groups.x]\nhosts = ["a"]\nadmin_key_env = "K"', r"admin_key_env: set without a gateway"),
    ('[groups.x]\nhosts = ["a"]\ndrain = 5', r"groups.x.drain: unknown key"),
    ('[hosts.b]\nworker_url = "ftp://x"', r"hosts.b.worker_url: expected http"),
])
def test_bad_group_config_names_file_and_key(tmp_path, text, message):
    path = write(tmp_path, '[hosts.a]\n' + text + "\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert "s3cret" not in str(err.value)


def test_bad_group_exits_2_before_any_host_is_contacted(tmp_path):
    path = write(tmp_path, '[hosts.a]\nssh = "root@192.0.2.1"\n[groups.x]\nhosts = ["a", "ghost"]\n')
    for argv in (["status", "--host", "x"], ["deploy", "--threshold", "5", "--host", "x", "--yes"],
                 ["status", "--hosts", "a,ghost"]):
        out = subprocess.run([sys.executable, "-m", "dynctl", *argv, "--config", str(path)], capture_output=True,
                             text=True, stdin=subprocess.DEVNULL, timeout=60)
        assert out.returncode == 2, out.stdout + out.stderr
        assert "ghost" in out.stderr


def test_an_unreachable_gateway_exits_4_before_any_host_is_contacted(tmp_path):
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = write(tmp_path, f'[hosts.a]\nssh = "root@192.0.2.1"\n[groups.x]\nhosts = ["a"]\n'
                           f'gateway = "http://127.0.0.1:{port}"\n')
    out = subprocess.run([sys.executable, "-m", "dynctl", "deploy", "--threshold", "5", "--host", "x", "--yes",
                          "--config", str(path)], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert out.returncode == 4, out.stdout + out.stderr
    assert f"gateway http://127.0.0.1:{port} (group x): GET /workers" in out.stderr
    assert "192.0.2.1" not in out.stderr  # the host was never tried
