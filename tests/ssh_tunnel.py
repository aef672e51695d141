"""A local TCP port whose connections are carried to a far address over SSH `direct-tcpip` channels: for the
tests and benchmarks that compare the agent's own load generator with one run here through a tunnel.

HTTP clients (httpx) then talk to 127.0.0.1:PORT as to any server; `http.client` over a raw paramiko
Channel fails intermittently (IncompleteRead), a real local socket does not.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import paramiko

from dynctl.base.errors import UnreachableError
from dynctl.transport.ssh import SSH

log = logging.getLogger("dynctl.ssh")

_CHUNK = 1 << 16


class LocalForwarder:
    """Listens on 127.0.0.1:<free port>; each accepted connection gets its own channel from `open_channel`."""

    def __init__(self, open_channel: Callable[[], Any], name: str = "") -> None:
        self._open_channel = open_channel
        self._name = name
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(32)
        self.address: tuple[str, int] = self._listener.getsockname()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._open: set[Any] = set()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"forward {name}", daemon=True)

    def start(self) -> LocalForwarder:
        self._acceptor.start()
        return self

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not _readable([self._listener], 0.25):
                    continue
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self._serve, args=(conn,), name=f"forward {self._name} conn", daemon=True)
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()]
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            chan = self._open_channel()
        except Exception as err:  # noqa: BLE001 - any failure means: refuse this one connection
            log.debug("forward %s: %s", self._name, err)
            _reset(conn)
            return
        with self._lock:
            self._open.update((conn, chan))
        try:
            _pump(conn, chan, self._stop)
        except Exception as err:  # noqa: BLE001 - the tunnel or the connection broke: end this one
            log.debug("forward %s: %s", self._name, err)
        finally:
            with self._lock:
                self._open.discard(conn)
                self._open.discard(chan)
            with contextlib.suppress(Exception):
                chan.close()
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            live = list(self._open)
            threads = list(self._threads)
        for end in live:
            with contextlib.suppress(Exception):
                end.close()
        self._acceptor.join(2)
        for t in threads:
            t.join(2)


def _readable(ends: list[Any], timeout: float) -> list[Any]:
    """The ends with data (or EOF) waiting; selectors, unlike select.select, takes fds above 1024."""
    with selectors.DefaultSelector() as sel:
        for end in ends:
            sel.register(end, selectors.EVENT_READ)
        return [key.fileobj for key, _ in sel.select(timeout)]


def _pump(conn: socket.socket, chan: Any, stop: threading.Event) -> None:
    """Copy both ways until both sides have finished sending (half-closes are passed on)."""
    conn_open, chan_open = True, True
    while (conn_open or chan_open) and not stop.is_set():
        watch = ([conn] if conn_open else []) + ([chan] if chan_open else [])
        ready = _readable(watch, 0.5)
        if conn in ready:
            data = _recv(conn)
            if data:
                chan.sendall(data)
            else:
                conn_open = False
                with contextlib.suppress(Exception):
                    chan.shutdown_write()
        if chan in ready:
            data = chan.recv(_CHUNK)
            if data:
                try:
                    conn.sendall(data)
                except OSError:
                    return
            else:
                chan_open = False
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_WR)
        if chan.closed and not chan.recv_ready():
            return


def _recv(conn: socket.socket) -> bytes:
    try:
        return conn.recv(_CHUNK)
    except OSError:
        return b""


def _reset(conn: socket.socket) -> None:
    """Close with RST so the client sees 'connection reset', not a silent empty answer."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        conn.close()


def open_channel(ssh: SSH, host: str, port: int, timeout: float | None = None) -> paramiko.Channel:
    """A `direct-tcpip` channel to host:port as seen from the target (ConnectionRefusedError if closed)."""
    transport = ssh.connect()
    try:
        return transport.open_channel("direct-tcpip", (host, port), ("127.0.0.1", 0),
                                      timeout=timeout or ssh.connect_timeout)
    except paramiko.ChannelException as err:
        raise ConnectionRefusedError(errno.ECONNREFUSED, f"{ssh.description}: cannot reach {host}:{port} "
                                     f"from there ({err.text})") from None
    except (paramiko.SSHException, EOFError) as err:
        ssh._forget(transport)  # the connection is gone: the next call opens a new one
        raise UnreachableError(f"{ssh.description}: tunnel to {host}:{port} failed: "
                               f"{err or type(err).__name__}") from None


@contextlib.contextmanager
def forward_local(ssh: SSH, remote_host: str, remote_port: int) -> Iterator[tuple[str, int]]:
    """A 127.0.0.1 port on this machine whose connections reach remote_host:remote_port from the target."""
    ssh.connect()
    forwarder = LocalForwarder(lambda: open_channel(ssh, remote_host, remote_port),
                               name=f"{remote_host}:{remote_port}").start()
    try:
        yield forwarder.address
    finally:
        forwarder.close()
