"""A remote host over SSH (paramiko): one connection per host, argv quoted once for the login shell.

Pitfalls handled here, each measured (see notes/test-environment.md): TCP_NODELAY on the socket
(47 ms -> 2.5 ms per command), stdout and stderr drained together with a deadline (paramiko's
recv_exit_status() deadlocks past ~2 MiB of unread output and ignores timeouts), stdin always closed,
and channels capped below sshd's MaxSessions (default 10).
"""

from __future__ import annotations

import contextlib
import select
import threading
import time
from collections.abc import Iterator, Sequence

import paramiko

from dynctl.base.config import SSHTarget
from dynctl.base.errors import DynctlError, UnreachableError
from dynctl.transport.base import Result, sh_join
from dynctl.transport.known_hosts import KnownHosts
from dynctl.transport.ssh_login import Login, login_chain
from dynctl.transport.ssh_route import Hop, resolve_route

_CHUNK = 1 << 16
_STDERR_KEEP = 1 << 16  # a stream keeps this much of the end of its stderr for error messages
_EOF_GRACE = 2.0  # seconds to wait for end of output once the command has exited


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
        self._login = Login(KnownHosts(known_hosts_path), accept_new=accept_new, timeout=connect_timeout,
                            identity_file=identity_file, description=self.description)

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
            self._clients = login_chain(self._route, self._login)
            self.connections_opened += 1
            transport = self._clients[-1].get_transport()
            assert transport is not None
            return transport

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
                    _send_eof(chan)
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
        deadline = time.monotonic() + self.connect_timeout
        pause, reconnected = 0.005, False
        while True:
            transport = self.connect()
            chan = None
            try:
                chan = transport.open_session(timeout=self.connect_timeout)
                chan.exec_command(command)
                return chan
            except (paramiko.SSHException, EOFError, OSError) as err:
                if chan is not None:
                    chan.close()
                reason = getattr(err, "text", None) or str(err) or type(err).__name__
                # No answer to a channel open means a peer that vanished without a word (paramiko still
                # calls such a transport active), unlike a refusal, which sshd sends at once.
                dead = isinstance(err, (EOFError, OSError)) or "Timeout" in reason
            if dead or not transport.is_active():
                # The connection died since its last use (sshd restarted, network blip). The session
                # was refused or never answered, so the command did not start: one reconnect is safe.
                self._forget(transport)
                if reconnected:
                    raise UnreachableError(f"{self.description}: connection lost: {reason}")
                reconnected = True
                continue
            # sshd frees a closed session one turn of its event loop after our CLOSE, so a session opened
            # right behind it can find MaxSessions still full ("no more sessions"): that refusal, seen at
            # open or at exec, passes within moments.
            if time.monotonic() + pause > deadline:
                raise UnreachableError(f"{self.description}: sshd refused a new session ({reason}) for "
                                       f"{self.connect_timeout:g} s; is its MaxSessions below {self.max_channels}?")
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _forget(self, transport: paramiko.Transport) -> None:
        with self._lock:
            if self._clients and self._clients[-1].get_transport() is transport:
                self._close_clients()

    def _collect(self, chan: paramiko.Channel, argv: Sequence[str], deadline: float, timeout: float) -> Result:
        out, err = bytearray(), bytearray()
        exited_at = None
        while True:
            while chan.recv_ready():
                out += chan.recv(_CHUNK)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(_CHUNK)
            if chan.eof_received or chan.closed:
                if not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                continue
            now = time.monotonic()
            if chan.exit_status_ready():
                # The command exited but something it started still holds stdout open (a server
                # launched without redirecting its output): return rather than wait for that to end.
                exited_at = exited_at or now
                if now - exited_at > _EOF_GRACE:
                    break
            left = deadline - now
            if left <= 0:
                self._timed_out(argv, timeout)
            select.select([chan], [], [], min(left, 0.25))
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
            _send_eof(chan)

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
        buf = bytearray()
        while True:
            try:
                data = self._chan.recv(_CHUNK)
            except (OSError, EOFError):
                data = b""
            if not data:
                break
            scan, start = len(buf), 0  # only the new bytes can hold a newline not yet seen
            buf += data
            while (end := buf.find(b"\n", scan)) >= 0:
                yield bytes(buf[start:end + 1])
                start = scan = end + 1
            del buf[:start]
        if buf:
            yield bytes(buf)
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


def _send_eof(chan: paramiko.Channel) -> None:
    """Our EOF on `chan`, never after our CLOSE.

    paramiko's shutdown_write builds the EOF under the channel's lock but sends it after letting go, so
    when the command has already ended (`true`), the transport thread can answer sshd's CLOSE with ours
    in between; sshd then reads an EOF for a channel it has freed and drops the whole connection, with
    every command sharing it. Sent under the lock, it goes out first, or
    not at all once the CLOSE has been answered (that sends our EOF itself).
    """
    with chan.lock:
        message = chan._send_eof()  # None once an EOF went out
        if message is not None and chan.transport is not None:
            chan.transport._send_user_message(message)


def _feed_in_background(chan: paramiko.Channel, data: bytes) -> None:
    """Send stdin from a thread: a remote that writes before it reads must not deadlock against us."""

    def feed() -> None:
        with contextlib.suppress(Exception):
            chan.sendall(data)
            _send_eof(chan)

    threading.Thread(target=feed, name="ssh stdin", daemon=True).start()
