"""The SSH transport against a real OpenSSH server on loopback: commands, keys, ssh_config, limits.

Host-key and secret scenarios (SPEC §9) are in test_faults.py, known_hosts syntax in test_known_hosts.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import os
import socket
import threading
from pathlib import Path

import httpx
import psutil
import pytest
from polling import at_once, finishes, wait_for
from ssh_tunnel import forward_local, open_channel
from sshd_harness import FakeHost, connection_owner, free_port

from dynctl.base.config import SSHTarget, load_config
from dynctl.base.errors import ConfigError, UnreachableError
from dynctl.transport import close_all, connect
from dynctl.transport.ssh import SSH

pytestmark = pytest.mark.slow


# ---- commands


def test_run_separates_streams_and_returns_the_exit_status(sshd: FakeHost):
    t = sshd.ssh()
    res = t.run(["sh", "-c", "printf 'out\\n'; printf 'err' >&2; exit 7"])
    assert (res.rc, res.out, res.err) == (7, b"out\n", b"err")
    assert t.description == f"ssh {sshd.user}@127.0.0.1:{sshd.port}"
    sock = t.connect().sock
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    t.close()


def test_runs_in_the_sessions_home_not_the_machines(sshd: FakeHost):
    res = sshd.ssh().run(["sh", "-c", 'echo "$HOME"'])
    assert res.stdout.strip() == str(sshd.tmp / "home")


def test_ten_mib_on_stdout_and_stderr_at_once_do_not_hang(sshd: FakeHost):
    t = sshd.ssh()
    # tee writes each block to both streams in turn: a client that drains one stream at a time
    # stops reading the other after paramiko's 2 MiB window and both sides wait forever (the timeout says so).
    res = t.run(["sh", "-c", "head -c 10485760 /dev/urandom | tee /dev/stderr"], timeout=60)
    assert res.rc == 0
    assert len(res.out) == len(res.err) == 10 * 1024 * 1024
    assert hashlib.sha256(res.out).digest() == hashlib.sha256(res.err).digest()


def test_stderr_first_then_stdout_large(sshd: FakeHost):
    res = sshd.ssh().run(["sh", "-c", "head -c 4194304 /dev/zero >&2; head -c 4194304 /dev/zero"])
    assert (res.rc, len(res.out), len(res.err)) == (0, 4194304, 4194304)


def test_stdin_is_passed_through_byte_exact(sshd: FakeHost):
    data = os.urandom(3 * 1024 * 1024) + b"\x00\n\r\xff"
    res = sshd.ssh().run(["sha256sum"], stdin=data)
    assert res.stdout.split()[0] == hashlib.sha256(data).hexdigest()


def test_stdin_is_closed_when_not_given(sshd: FakeHost):
    res = sshd.ssh().run(["cat"], timeout=30)  # an open stdin keeps cat waiting: the timeout is an error
    assert (res.rc, res.out) == (0, b"")


def test_command_timeout_is_an_error_naming_the_command(sshd: FakeHost):
    t = sshd.ssh()
    with pytest.raises(UnreachableError, match=r"sleep did not finish within 1 s") as info:
        t.run(["sleep", "20"], timeout=1)  # without the timeout: rc 0 after 20 s, no error
    assert info.value.exit_code == 4
    assert t.run(["true"]).rc == 0  # the connection is still usable


def test_killed_command_reports_255_like_openssh(sshd: FakeHost):
    assert sshd.ssh().run(["sh", "-c", "kill -KILL $$"]).rc == 255


def test_stream_yields_lines_and_exit_status(sshd: FakeHost):
    t = sshd.ssh()
    s = t.open_stream(["sh", "-c", "cat; echo two; echo warn >&2; exit 3"], stdin=b"one\n")
    try:
        assert list(s.lines()) == [b"one\n", b"two\n"]
    finally:
        s.close()
    assert s.rc == 3
    assert s.stderr == b"warn\n"


def test_stream_splits_lines_exactly(sshd: FakeHost):
    script = "seq 1 50000; head -c 1048576 /dev/zero | tr '\\0' x; echo; printf 'last'"
    s = sshd.ssh().open_stream(["sh", "-c", script])
    try:
        lines = list(s.lines())
    finally:
        s.close()
    assert lines[:50000] == [f"{i}\n".encode() for i in range(1, 50001)]
    assert lines[50000:] == [b"x" * 1048576 + b"\n", b"last"]
    assert s.rc == 0


def test_stream_close_releases_its_channel(sshd: FakeHost):
    t = sshd.ssh(max_channels=1)
    s = t.open_stream(["sh", "-c", "echo ready; exec sleep 30"])
    assert next(iter(s.lines())) == b"ready\n"
    s.close()
    assert t.run(["true"], timeout=5).rc == 0


# ---- connection sharing, limits, reconnect


def test_concurrent_runs_share_one_connection_and_stay_below_max_sessions(sshd: FakeHost):
    t = sshd.ssh(max_channels=8)  # the test sshd has the default MaxSessions 10
    results, errors = [], []

    def one(i: int) -> None:
        try:
            results.append(t.run(["sh", "-c", f"sleep 0.2; echo {i}"], timeout=30))
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert errors == []
    assert sorted(int(r.out) for r in results) == list(range(24))
    assert t.connections_opened == 1


def test_channel_cap_is_what_keeps_sessions_under_the_limit(sshd_factory):
    small = sshd_factory(max_sessions=3)
    ok = small.ssh(max_channels=3)
    argv = ["sh", "-c", "sleep 0.3"]
    outcomes: list[object] = []
    threads = [threading.Thread(target=lambda: outcomes.append(ok.run(argv).rc)) for _ in range(9)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert outcomes == [0] * 9
    # Control: with a cap above the server's MaxSessions, sessions are refused; once that lasts
    # longer than the connect timeout it is reported clearly.
    too_many = small.ssh(max_channels=6, connect_timeout=10)
    assert too_many.run(["true"]).rc == 0  # logged in at leisure: the short timeout is for sessions alone
    too_many.connect_timeout = 0.3
    errors: list[Exception] = []

    def run_one() -> None:
        try:
            too_many.run(["sh", "-c", "sleep 1"])
        except UnreachableError as err:
            errors.append(err)

    threads = [threading.Thread(target=run_one) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert errors and "refused a new session" in str(errors[0]) and "MaxSessions" in str(errors[0])


def test_reconnects_after_the_server_drops_the_connection(sshd_factory):
    fh = sshd_factory()
    t = fh.ssh()
    assert t.run(["true"]).rc == 0
    first = t.connect()
    fh.server.drop_connections()
    wait_for(lambda: not first.is_active(), 10, "the first transport to close")
    assert t.run(["echo", "back"]).out == b"back\n"
    assert t.connections_opened == 2


def test_reconnects_when_the_drop_is_not_yet_noticed(sshd_factory):
    fh = sshd_factory()
    t = fh.ssh()
    assert t.run(["true"]).rc == 0
    fh.server.drop_connections()
    assert t.run(["echo", "back"]).out == b"back\n"  # open_session on the dead connection is retried once


def test_one_connection_for_many_threads_connecting_at_once(sshd: FakeHost):
    t = sshd.ssh()
    assert at_once(lambda: t.run(["true"]).rc, 12) == [0] * 12
    assert t.connections_opened == 1


def test_commands_that_end_at_once_never_drop_the_shared_connection(sshd: FakeHost):
    """Our EOF must not follow our CLOSE: sshd drops the whole connection when it reads an EOF for a
    channel it has freed, and a command that ends before we send our EOF makes that race likely (seen as
    an EOFError in about one round of twenty on a loaded machine before the EOF was sent in order)."""
    t = sshd.ssh()
    logged = sshd.server.log.stat().st_size
    for _ in range(20):
        assert at_once(lambda: t.run(["true"]).rc, 12) == [0] * 12
    assert t.connections_opened == 1
    assert b"nonexistent channel" not in sshd.server.log.read_bytes()[logged:]


# ---- unreachable, keys, host keys


def test_closed_port_is_unreachable_within_the_connect_timeout(sshd: FakeHost):
    port = free_port()
    t = SSH(SSHTarget("root", "127.0.0.1", port), known_hosts_path=str(sshd.trusted_known_hosts()),
            identity_file=str(sshd.client_key), connect_timeout=2)
    with pytest.raises(UnreachableError, match=rf"connection refused by 127\.0\.0\.1:{port}") as info:
        t.run(["true"])  # refused, not timed out: that message would name the timeout
    assert info.value.exit_code == 4


def test_silent_port_times_out_on_the_banner(sshd: FakeHost):
    with socket.socket() as silent:  # accepts TCP (backlog) but never speaks SSH
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        t = SSH(SSHTarget("root", "127.0.0.1", port), known_hosts_path=str(sshd.trusted_known_hosts()),
                identity_file=str(sshd.client_key), connect_timeout=1)
        with pytest.raises(UnreachableError, match=rf"127\.0\.0\.1:{port} but got no SSH banner within 1 s"):
            finishes(lambda: t.run(["true"]), 60, "the connection to a port that never speaks SSH")


class _Peer:
    """A TCP port that is not SSH: it answers like an HTTP server, or closes after `close_after` seconds."""

    def __init__(self, *, answer: bytes = b"", close_after: float = 0.0) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.answer, self.close_after = answer, close_after
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                if self.answer:
                    conn.recv(256)  # the client's SSH banner, read as a request line
                    conn.sendall(self.answer)
                # what the peer does, not test synchronisation: it holds the connection, then closes
                self.done.wait(self.close_after)

    def close(self) -> None:
        self.done.set()
        self.sock.close()


@pytest.fixture
def peer():
    made: list[_Peer] = []

    def make(**kw) -> _Peer:
        made.append(_Peer(**kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_a_port_that_speaks_http_is_not_an_ssh_server(sshd: FakeHost, peer):
    http = peer(answer=b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    t = SSH(SSHTarget("root", "127.0.0.1", http.port), known_hosts_path=str(sshd.trusted_known_hosts()),
            identity_file=str(sshd.client_key), connect_timeout=10)
    with pytest.raises(UnreachableError) as info:
        t.run(["true"])
    assert f"127.0.0.1:{http.port} is not an SSH server: it answered 'HTTP/1.1 400 Bad Request'" in str(info.value)
    assert info.value.exit_code == 4


def test_a_peer_that_closes_is_reported_as_closed_not_as_a_timeout(sshd: FakeHost, peer):
    closing = peer(close_after=1.0)
    t = SSH(SSHTarget("root", "127.0.0.1", closing.port), known_hosts_path=str(sshd.trusted_known_hosts()),
            identity_file=str(sshd.client_key), connect_timeout=10)
    with pytest.raises(UnreachableError) as info:
        t.run(["true"])
    message = str(info.value)
    assert f"127.0.0.1:{closing.port} closed the connection after 1." in message
    assert "before sending an SSH banner" in message
    assert "within" not in message  # it did not wait for the 10 s timeout, and does not say so


# ---- ssh_config and ProxyJump


def write_ssh_config(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def trust(path: Path, *hosts: FakeHost) -> str:
    path.write_text("".join(h.host_key_line + "\n" for h in hosts))
    return str(path)


def test_ssh_config_alias_sets_hostname_user_port_and_identity(sshd: FakeHost, isolated_home: Path):
    (isolated_home / ".ssh" / "config").write_text(
        f"Host gpubox\n  HostName 127.0.0.1\n  User {sshd.user}\n  Port {sshd.port}\n"
        f"  IdentityFile {sshd.client_key}\n"
    )
    t = SSH(SSHTarget(None, "gpubox", None), known_hosts_path=str(sshd.trusted_known_hosts()))
    assert t.description == f"ssh {sshd.user}@127.0.0.1:{sshd.port}"
    assert t.run(["echo", "via alias"]).out == b"via alias\n"


def test_unknown_alias_is_named_without_touching_the_network(sshd: FakeHost, tmp_path: Path):
    cfg = write_ssh_config(tmp_path / "ssh_config", "Host other\n  HostName 127.0.0.1\n")
    t = SSH(SSHTarget(None, "gpubxo", None), ssh_config_path=cfg, known_hosts_path=str(tmp_path / "kh"))
    with pytest.raises(UnreachableError, match=r"'gpubxo' is not a Host alias in .*ssh_config") as info:
        t.run(["true"])
    assert info.value.exit_code == 4


def test_proxyjump_through_one_jump_host(sshd: FakeHost, sshd_factory, tmp_path: Path):
    jump = sshd_factory("127.0.0.2")
    cfg = write_ssh_config(tmp_path / "ssh_config", (
        f"Host target\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
        f"  ProxyJump {jump.user}@127.0.0.2:{jump.port}\n"
    ))
    t = SSH(SSHTarget(None, "target", None), ssh_config_path=cfg, identity_file=str(sshd.client_key),
            known_hosts_path=trust(tmp_path / "kh", sshd, jump))
    assert t.description == f"ssh {sshd.user}@127.0.0.1:{sshd.port} via {jump.user}@127.0.0.2:{jump.port}"
    client_port = int(t.run(["sh", "-c", 'echo "$SSH_CONNECTION"']).out.split()[1])
    # The target's peer is a socket owned by the jump host's sshd session, not by this process.
    owner = connection_owner(client_port, sshd.port)
    assert owner in {p.pid for p in jump.server.session_processes()}


def test_proxyjump_through_two_hosts(sshd: FakeHost, sshd_factory, tmp_path: Path):
    j1, j2 = sshd_factory("127.0.0.2"), sshd_factory("127.0.0.3")
    cfg = write_ssh_config(tmp_path / "ssh_config", (
        f"Host j1\n  HostName 127.0.0.2\n  Port {j1.port}\n  User {j1.user}\n  IdentityFile {sshd.client_key}\n"
        f"Host j2\n  HostName 127.0.0.3\n  Port {j2.port}\n  User {j2.user}\n  IdentityFile {sshd.client_key}\n"
        f"Host target\n  HostName 127.0.0.1\n  Port {sshd.port}\n  ProxyJump j1,j2\n"
    ))
    t = SSH(SSHTarget(sshd.user, "target", None), ssh_config_path=cfg, identity_file=str(sshd.client_key),
            known_hosts_path=trust(tmp_path / "kh", sshd, j1, j2))
    assert t.run(["echo", "two hops"]).out == b"two hops\n"
    target_peer = int(t.run(["sh", "-c", 'echo "$SSH_CONNECTION"']).out.split()[1])
    assert connection_owner(target_peer, sshd.port) in {p.pid for p in j2.server.session_processes()}
    # ...and j2's peer is j1: the client side of every connection into j2 belongs to j1's session.
    j2_peers = {c.raddr.port for p in j2.server.session_processes() for c in p.net_connections("tcp")
                if c.raddr and c.laddr.port == j2.port}
    j1_sessions = {p.pid for p in j1.server.session_processes()}
    assert j2_peers and all(connection_owner(port, j2.port) in j1_sessions for port in j2_peers)


def test_jump_host_down_names_the_jump_host(sshd: FakeHost, sshd_factory, tmp_path: Path):
    jump = sshd_factory("127.0.0.2")
    jump_port = jump.port
    jump.stop()
    cfg = write_ssh_config(tmp_path / "ssh_config", (
        f"Host target\n  HostName 127.0.0.1\n  Port {sshd.port}\n  ProxyJump root@127.0.0.2:{jump_port}\n"
    ))
    t = SSH(SSHTarget(sshd.user, "target", None), ssh_config_path=cfg, identity_file=str(sshd.client_key),
            known_hosts_path=trust(tmp_path / "kh", sshd, jump), connect_timeout=3)
    with pytest.raises(UnreachableError) as info:
        t.run(["true"])
    message = str(info.value)
    assert f"jump host root@127.0.0.2:{jump_port}" in message and "connection refused" in message
    assert info.value.exit_code == 4


def test_jump_host_that_cannot_reach_the_target(sshd: FakeHost, sshd_factory, tmp_path: Path):
    jump = sshd_factory("127.0.0.2")
    closed = free_port()
    cfg = write_ssh_config(tmp_path / "ssh_config", (
        f"Host target\n  HostName 127.0.0.1\n  Port {closed}\n  ProxyJump {jump.user}@127.0.0.2:{jump.port}\n"
    ))
    t = SSH(SSHTarget(sshd.user, "target", None), ssh_config_path=cfg, identity_file=str(sshd.client_key),
            known_hosts_path=trust(tmp_path / "kh", sshd, jump))
    with pytest.raises(UnreachableError, match=rf"jump host .*127\.0\.0\.2:{jump.port} could not connect to "
                                               rf"127\.0\.0\.1:{closed}"):
        t.run(["true"])


# ---- tunnels


class _Hello(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802
        body = f"hello {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_forward_local_carries_http_keepalive(sshd: FakeHost):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    t = sshd.ssh()
    try:
        with forward_local(t, "127.0.0.1", server.server_address[1]) as (host, port):
            assert host == "127.0.0.1" and port != server.server_address[1]
            with httpx.Client(base_url=f"http://{host}:{port}", timeout=5) as client:
                bodies = [client.get(f"/{i}").text for i in range(50)]
        assert bodies == [f"hello /{i}" for i in range(50)]
    finally:
        server.shutdown()
        server.server_close()
        t.close()


def test_tunnel_to_a_closed_port_is_connection_refused(sshd: FakeHost):
    t = sshd.ssh()
    closed = free_port()
    with pytest.raises(ConnectionRefusedError, match=rf"cannot reach 127\.0\.0\.1:{closed}"):
        open_channel(t, "127.0.0.1", closed)
    with forward_local(t, "127.0.0.1", closed) as (host, port), pytest.raises(httpx.TransportError):
        httpx.get(f"http://{host}:{port}/", timeout=5)
    assert t.run(["true"]).rc == 0


# ---- the config fixture other tests use


def test_write_config_gives_a_working_host(sshd: FakeHost, tmp_path: Path):
    cfg = sshd.write_config(tmp_path / "dynctl.toml", {"box": {"ssh": sshd.target, "workdir": str(tmp_path / "w")}})
    config = load_config(cfg)
    host = config.host("box")
    try:
        t = connect(host, config)
        assert connect(host, config) is t
        assert t.run(["echo", "ok"]).out == b"ok\n"
    finally:
        close_all()


def test_closing_a_stream_from_another_thread_ends_its_reader(sshd: FakeHost):
    t = sshd.ssh()
    s = t.open_stream(["sh", "-c", "echo first; exec sleep 30"])
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(s.lines()))
    reader.start()
    wait_for(lambda: got == [b"first\n"], 10, "the first line")
    s.close()
    reader.join(5)
    assert not reader.is_alive()
    assert s.rc is None  # still running there: no exit status was reported


def test_command_that_leaves_a_child_holding_stdout_still_returns(sshd: FakeHost):
    # waiting for the child's end of stdout would run into the timeout, an error
    res = sshd.ssh().run(["sh", "-c", "sleep 600 & echo $!"], timeout=60)
    child = psutil.Process(int(res.out))  # psutil's kill refuses a pid reused since: only this sleep is hit
    try:
        assert res.rc == 0 and child.cmdline() == ["sleep", "600"]
    finally:
        with contextlib.suppress(psutil.Error):
            child.kill()


def test_proxycommand_is_refused_rather_than_bypassed(tmp_path: Path):
    cfg = write_ssh_config(tmp_path / "ssh_config", "Host boxed\n  HostName 127.0.0.1\n  ProxyCommand nc %h %p\n")
    t = SSH(SSHTarget("root", "boxed", None), ssh_config_path=cfg, known_hosts_path=str(tmp_path / "kh"))
    with pytest.raises(ConfigError, match=r"Host boxed: ProxyCommand is not supported by dynctl; use ProxyJump"):
        t.run(["true"])
