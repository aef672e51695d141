"""A remote host over SSH (paramiko): one connection per host, argv quoted once for the login shell.

Pitfalls handled here, each measured (see notes/test-environment.md): TCP_NODELAY on the socket
(47 ms -> 2.5 ms per command), stdout and stderr drained together with a deadline (paramiko's
recv_exit_status() deadlocks past ~2 MiB of unread output and ignores timeouts), stdin always closed,
and channels capped below sshd's MaxSessions (default 10).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import paramiko

from dynctl.config import SSHTarget
from dynctl.errors import ConfigError, DynctlError, HostKeyError, UnreachableError
from dynctl.transport.base import Result, sh_join
from dynctl.transport.forward import LocalForwarder
from dynctl.transport.known_hosts import AcceptNewPolicy, KnownHosts, changed_key_error
from dynctl.transport.ssh_route import Hop, resolve_route

_CHUNK = 1 << 16
_STDERR_KEEP = 1 << 16  # a stream keeps this much of the end of its stderr for error messages


class SSH:
    """Runs argv lists on one SSH host (optionally through ProxyJump hosts); safe to share between threads."""

    def __init__(self, target: SSHTarget, *, ssh_config_path: str | None = None, known_hosts_path: str,
                 identity_file: str | None = None, accept_new: bool = False, connect_timeout: float = 10.0,
                 max_channels: int = 8) -> None:
        self.target = target
        self.host_label = target.host  # the name the user wrote: an alias or a host name
        self.connect_timeout = connect_timeout
        self.max_channels = max_channels
        self.accept_new = accept_new
        self.identity_file = identity_file
        self.known_hosts = KnownHosts(known_hosts_path)
        self.connections_opened = 0  # SSH logins to the target made by this instance (reconnects included)
        self._lock = threading.RLock()
        self._slots = threading.BoundedSemaphore(max_channels)
        self._clients: list[paramiko.SSHClient] = []
        self._route: list[Hop] | None = None
        self._route_error: DynctlError | None = None
        try:
            self._route = resolve_route(target, ssh_config_path, identity_file)
        except DynctlError as err:  # reported on first use, so building a transport never fails
            self._route_error = err
        if self._route:
            hops = self._route
            via = f" via {', '.join(str(h) for h in hops[:-1])}" if len(hops) > 1 else ""
            self.description = f"ssh {hops[-1]}{via}"
        else:
            self.description = f"ssh {target}"

    # ---- connection

    def connect(self) -> paramiko.Transport:
        """The live SSH transport to the target, (re)connecting when there is none or it died."""
        with self._lock:
            if self._clients:
                live = self._clients[-1].get_transport()
                if live is not None and live.is_active():
                    return live
                self._close_clients()
            if self._route_error is not None:
                raise self._route_error
            assert self._route is not None
            self._clients = self._login_chain(self._route)
            self.connections_opened += 1
            transport = self._clients[-1].get_transport()
            assert transport is not None
            return transport

    def _login_chain(self, route: list[Hop]) -> list[paramiko.SSHClient]:
        clients: list[paramiko.SSHClient] = []
        sock = None
        try:
            for i, hop in enumerate(route):
                label = self.description if i == len(route) - 1 else f"jump host {hop} (for {self.description})"
                if i == 0:
                    sock = self._tcp_connect(hop, label)
                else:
                    sock = self._jump_channel(clients[-1], route[i - 1], hop)
                clients.append(self._login(hop, sock, label))
                sock = None
        except BaseException:
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.close()
            for c in reversed(clients):
                c.close()
            raise
        return clients

    def _tcp_connect(self, hop: Hop, label: str) -> socket.socket:
        where = f"{hop.hostname}:{hop.port}"
        try:
            sock = socket.create_connection((hop.hostname, hop.port), timeout=self.connect_timeout)
        except socket.gaierror as err:
            raise UnreachableError(f"{label}: cannot resolve host name '{hop.hostname}' ({err.strerror})") from None
        except ConnectionRefusedError:
            raise UnreachableError(f"{label}: connection refused by {where} (is sshd listening on port "
                                   f"{hop.port}?)") from None
        except TimeoutError:
            raise UnreachableError(f"{label}: no answer from {where} within {self.connect_timeout:g} s "
                                   "(host down, or a firewall drops the packets)") from None
        except OSError as err:
            raise UnreachableError(f"{label}: cannot connect to {where}: {err.strerror or err}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return sock

    def _jump_channel(self, gateway: paramiko.SSHClient, via: Hop, hop: Hop) -> paramiko.Channel:
        transport = gateway.get_transport()
        assert transport is not None
        try:
            return transport.open_channel("direct-tcpip", (hop.hostname, hop.port), ("", 0),
                                          timeout=self.connect_timeout)
        except paramiko.ChannelException as err:
            raise UnreachableError(f"{self.description}: jump host {via} could not connect to "
                                   f"{hop.hostname}:{hop.port} ({err.text})") from None
        except (paramiko.SSHException, EOFError, OSError) as err:
            raise UnreachableError(f"{self.description}: jump host {via} failed to open a tunnel to "
                                   f"{hop.hostname}:{hop.port}: {err or type(err).__name__}") from None

    def _login(self, hop: Hop, sock: socket.socket | paramiko.Channel, label: str) -> paramiko.SSHClient:
        keys = self._identity_files(hop)
        client = paramiko.SSHClient()
        self.known_hosts.load_into(client)
        client.set_missing_host_key_policy(AcceptNewPolicy(self.known_hosts, self.accept_new, label))
        t = self.connect_timeout
        try:
            client.connect(hop.hostname, hop.port, username=hop.user, sock=sock, key_filename=keys or None,
                           look_for_keys=not keys, allow_agent=not hop.identities_only, timeout=t,
                           banner_timeout=t, auth_timeout=t, channel_timeout=t)
        except HostKeyError:
            client.close()
            raise
        except paramiko.BadHostKeyException as err:
            client.close()
            raise changed_key_error(label, hop.known_hosts_name, self.known_hosts, err.key,
                                    err.expected_key) from None
        except paramiko.PasswordRequiredException:
            client.close()
            raise UnreachableError(f"{label}: identity file {', '.join(keys)} is passphrase-protected; "
                                   f"load it into ssh-agent (ssh-add) and try again") from None
        except paramiko.AuthenticationException:
            client.close()
            tried = f"key {', '.join(keys)}" if keys else "ssh-agent and ~/.ssh/id_* keys"
            raise UnreachableError(f"{label}: authentication failed for user '{hop.user}' (tried {tried}); "
                                   f"is its public key in ~{hop.user}/.ssh/authorized_keys there?") from None
        except (paramiko.SSHException, EOFError, OSError) as err:
            client.close()
            raise UnreachableError(f"{label}: {self._explain_handshake(err, hop)}") from None
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(30)
        return client

    def _explain_handshake(self, err: Exception, hop: Hop) -> str:
        text = str(err)
        if "banner" in text:
            return (f"connected to {hop.hostname}:{hop.port} but got no SSH banner within "
                    f"{self.connect_timeout:g} s (is that port an SSH server?)")
        if "No authentication methods available" in text:
            return ("no key to log in with: set identity_file for this host, IdentityFile in ~/.ssh/config, "
                    "or load a key into ssh-agent")
        return f"SSH handshake with {hop.hostname}:{hop.port} failed: {text or type(err).__name__}"

    def _identity_files(self, hop: Hop) -> list[str]:
        found = []
        for path in hop.identity_files:
            try:
                with open(path, "rb"):
                    found.append(path)
            except OSError as err:
                if self.identity_file and path == os.path.expanduser(self.identity_file):
                    raise ConfigError(f"identity_file {path} for {self.description}: {err.strerror}") from None
                # ssh_config IdentityFile entries that do not exist are skipped, as OpenSSH does
        return found

    def close(self) -> None:
        with self._lock:
            self._close_clients()

    def _close_clients(self) -> None:
        for c in reversed(self._clients):
            with contextlib.suppress(Exception):
                c.close()
        self._clients = []

    # ---- commands

    def run(self, argv: Sequence[str], stdin: bytes | None = None, timeout: float = 60.0) -> Result:
        """Run `argv` there; stdout and stderr are drained together, stdin is sent and then closed."""
        deadline = time.monotonic() + timeout
        with self._slot(timeout):
            chan = self._start(argv)
            try:
                if stdin:
                    _feed_in_background(chan, stdin)
                else:
                    chan.shutdown_write()
                return self._collect(chan, argv, deadline, timeout)
            finally:
                chan.close()

    def open_stream(self, argv: Sequence[str], stdin: bytes | None = None) -> SSHStream:
        """Start `argv` and read its stdout line by line; holds one channel until closed."""
        if not self._slots.acquire(timeout=max(self.connect_timeout, 30.0)):
            raise UnreachableError(f"{self.description}: all {self.max_channels} SSH channels stayed busy")
        try:
            chan = self._start(argv)
        except BaseException:
            self._slots.release()
            raise
        return SSHStream(chan, stdin, self._slots.release, self.description)

    @contextlib.contextmanager
    def _slot(self, timeout: float) -> Iterator[None]:
        if not self._slots.acquire(timeout=timeout):
            raise UnreachableError(f"{self.description}: all {self.max_channels} SSH channels stayed busy "
                                   f"for {timeout:g} s")
        try:
            yield
        finally:
            self._slots.release()

    def _start(self, argv: Sequence[str]) -> paramiko.Channel:
        if not argv:
            raise ValueError("empty argv")
        command = sh_join(argv)
        for attempt in (1, 2):
            transport = self.connect()
            try:
                chan = self._open_session(transport)
            except (paramiko.SSHException, EOFError, OSError) as err:
                # The connection died since the last use (server restarted, network blip): nothing was
                # started yet, so one fresh connection is safe.
                self._forget(transport)
                if attempt == 1:
                    continue
                raise UnreachableError(f"{self.description}: connection lost: {err or type(err).__name__}") from None
            try:
                chan.exec_command(command)
            except (paramiko.SSHException, EOFError, OSError) as err:
                chan.close()
                raise UnreachableError(f"{self.description}: could not start {argv[0]}: "
                                       f"{err or type(err).__name__}") from None
            return chan
        raise AssertionError("unreachable")

    def _open_session(self, transport: paramiko.Transport) -> paramiko.Channel:
        # sshd frees a closed session one turn of its event loop after our CLOSE, so an OPEN sent right
        # behind it can find MaxSessions still full ("no more sessions"): that refusal is retried.
        deadline = time.monotonic() + self.connect_timeout
        pause = 0.005
        while True:
            try:
                return transport.open_session(timeout=self.connect_timeout)
            except paramiko.ChannelException as err:
                if time.monotonic() + pause > deadline:
                    raise UnreachableError(
                        f"{self.description}: sshd refused a new session ({err.text}) for "
                        f"{self.connect_timeout:g} s; is its MaxSessions below {self.max_channels}?") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.1)

    def _forget(self, transport: paramiko.Transport) -> None:
        with self._lock:
            if self._clients and self._clients[-1].get_transport() is transport:
                self._close_clients()

    def _collect(self, chan: paramiko.Channel, argv: Sequence[str], deadline: float, timeout: float) -> Result:
        out, err = bytearray(), bytearray()
        while True:
            while chan.recv_ready():
                out += chan.recv(_CHUNK)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(_CHUNK)
            if chan.eof_received or chan.closed:
                if not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                self._timed_out(argv, timeout)
            select.select([chan], [], [], min(left, 1.0))
        if not chan.status_event.wait(max(0.0, deadline - time.monotonic())):
            self._timed_out(argv, timeout)
        rc = chan.exit_status
        if rc == -1:
            transport = chan.get_transport()
            if transport is None or not transport.is_active():
                raise UnreachableError(f"{self.description}: connection lost while running {argv[0]}")
            rc = 255  # the server sent exit-signal (killed) or no status; OpenSSH's client says 255 too
        return Result(rc, bytes(out), bytes(err))

    def _timed_out(self, argv: Sequence[str], timeout: float) -> None:
        raise UnreachableError(f"{self.description}: {argv[0]} did not finish within {timeout:g} s "
                               "(it may still be running there)")

    # ---- tunnels

    def open_channel(self, host: str, port: int, timeout: float | None = None) -> paramiko.Channel:
        """A `direct-tcpip` channel to host:port as seen from the target (ConnectionRefusedError if closed)."""
        transport = self.connect()
        try:
            return transport.open_channel("direct-tcpip", (host, port), ("127.0.0.1", 0),
                                          timeout=timeout or self.connect_timeout)
        except paramiko.ChannelException as err:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"{self.description}: cannot reach {host}:{port} "
                                         f"from there ({err.text})") from None
        except (paramiko.SSHException, EOFError) as err:
            self._forget(transport)
            raise UnreachableError(f"{self.description}: tunnel to {host}:{port} failed: "
                                   f"{err or type(err).__name__}") from None

    @contextlib.contextmanager
    def forward_local(self, remote_host: str, remote_port: int) -> Iterator[tuple[str, int]]:
        """A 127.0.0.1 port on this machine whose connections reach remote_host:remote_port from the target."""
        self.connect()
        forwarder = LocalForwarder(lambda: self.open_channel(remote_host, remote_port),
                                   name=f"{remote_host}:{remote_port}").start()
        try:
            yield forwarder.address
        finally:
            forwarder.close()


class SSHStream:
    """A running remote command: stdout as lines, stderr kept (its end) for error messages."""

    def __init__(self, chan: paramiko.Channel, stdin: bytes | None, release, description: str) -> None:
        self._chan = chan
        self._release = release
        self._released = False
        self.description = description
        self._err = bytearray()
        self._err_thread = threading.Thread(target=self._drain_stderr, name="ssh stream stderr", daemon=True)
        self._err_thread.start()
        if stdin:
            _feed_in_background(chan, stdin)
        else:
            chan.shutdown_write()

    def _drain_stderr(self) -> None:
        with contextlib.suppress(Exception):
            while True:
                data = self._chan.recv_stderr(_CHUNK)
                if not data:
                    return
                self._err += data
                if len(self._err) > 2 * _STDERR_KEEP:
                    del self._err[:-_STDERR_KEEP]

    def lines(self) -> Iterator[bytes]:
        buf = b""
        while True:
            try:
                data = self._chan.recv(_CHUNK)
            except (OSError, EOFError):
                data = b""
            if not data:
                break
            buf += data
            *complete, buf = buf.split(b"\n")
            for line in complete:
                yield line + b"\n"
        if buf:
            yield buf
        self._chan.status_event.wait(5)
        self._err_thread.join(5)

    @property
    def stderr(self) -> bytes:
        return bytes(self._err[-_STDERR_KEEP:])

    @property
    def rc(self) -> int | None:
        if not self._chan.status_event.is_set() or self._chan.exit_status == -1:
            return None
        return self._chan.exit_status

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._chan.close()
        if not self._released:
            self._released = True
            self._release()


def _feed_in_background(chan: paramiko.Channel, data: bytes) -> None:
    """Send stdin from a thread: a remote that writes before it reads must not deadlock against us."""

    def feed() -> None:
        with contextlib.suppress(Exception):
            chan.sendall(data)
            chan.shutdown_write()

    threading.Thread(target=feed, name="ssh stdin", daemon=True).start()
