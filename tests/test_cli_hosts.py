"""`dynctl hosts` and `dynctl status` through the real sshd and the pct stand-in: good hosts and bad ones."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


CTID = 131


def dynctl(*args: str, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynctl", *args, "--config", str(config)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


@pytest.fixture
def fleet(sshd, tmp_path):
    """Four hosts on one sshd: plain SSH, SSH+pct, a stopped container, and a closed port."""
    ct = sshd.make_ct(CTID)
    sshd.make_ct(CTID + 1, state="stopped")
    weird = ct / "work dir $HOME `x`"
    hosts = {
        "plain": {"ssh": sshd.target, "python": sys.executable, "workdir": str(tmp_path / "plain-work")},
        "boxed": {"ssh": sshd.target, "pct": CTID, "python": sys.executable, "workdir": str(weird)},
        "stopped": {"ssh": sshd.target, "pct": CTID + 1, "python": sys.executable},
        "gone": {"ssh": f"root@127.0.0.1:{closed_port()}", "python": sys.executable},
    }
    return sshd.write_config(tmp_path / "dynctl.toml", hosts), weird


def test_status_over_ssh_and_pct(fleet):
    config, weird = fleet
    out = dynctl("status", "--host", "boxed", "--json", config=config)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)["host"]
    assert report["route"].endswith(f"pct {CTID}")
    assert report["workdir"]["path"] == str(weird) and report["workdir"]["writable"]
    assert report["sglang_version"] is None and report["strategy"] == "absent"  # says so, exit 0
    text = dynctl("status", "--host", "boxed", config=config)
    assert text.returncode == 0 and "not installed" in text.stdout


def test_hosts_lists_each_with_its_route(fleet):
    config, _ = fleet
    out = dynctl("hosts", "--json", config=config)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["plain"]["reachable"] and rows["boxed"]["reachable"]
    assert rows["plain"]["latency_ms"] > 0
    assert not rows["stopped"]["reachable"] and "not running" in rows["stopped"]["error"]
    assert not rows["gone"]["reachable"]
    assert out.returncode == 4  # some host is unreachable


@pytest.mark.parametrize(("host", "fragment"), [
    ("stopped", f"container {CTID + 1} is not running"),
    ("gone", "127.0.0.1"),
])
def test_unreachable_hosts_exit_4(fleet, host, fragment):
    config, _ = fleet
    out = dynctl("status", "--host", host, config=config)
    assert out.returncode == 4, out.stdout + out.stderr
    assert fragment in out.stderr


def test_missing_python_on_the_host_exit_3(sshd, tmp_path):
    config = sshd.write_config(tmp_path / "dynctl.toml",
                               {"box": {"ssh": sshd.target, "python": "/opt/nowhere/bin/python3"}})
    out = dynctl("status", config=config)
    assert out.returncode == 3
    assert "/opt/nowhere/bin/python3" in out.stderr and "not found" in out.stderr


@pytest.mark.parametrize(("answer", "fragment"), [
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "is not an SSH server: it answered 'HTTP/1.1 400"),
    (b"", "closed the connection after"),
])
def test_a_port_that_is_not_ssh_is_one_line_without_a_traceback(tmp_path, answer, fragment):
    """paramiko's transport thread logs its own traceback; none of it may reach the operator's terminal."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]

        def serve() -> None:
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                with conn:
                    conn.recv(256)
                    conn.sendall(answer)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        config = tmp_path / "dynctl.toml"
        config.write_text(f'[hosts.web]\nssh = "root@127.0.0.1:{port}"\naccept_new_host_key = true\n')
        out = dynctl("status", config=config)
    assert out.returncode == 4, out.stdout + out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert f"127.0.0.1:{port}" in lines[0] and fragment in lines[0]
