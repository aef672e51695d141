"""Logging in over SSH, hop by hop: TCP, key exchange with host-key checks, auth; failures in words.

Each ProxyJump hop rides on a `direct-tcpip` channel of the previous one (paramiko parses ProxyJump
but does not act on it). Every paramiko failure becomes an UnreachableError / HostKeyError (exit 4)
naming the host:port and what failed; key material is never part of a message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Sequence

import paramiko

from dynctl.base.errors import ConfigError, HostKeyError, UnreachableError
from dynctl.transport.known_hosts import HostKeyPolicy, KnownHosts
from dynctl.transport.ssh_route import Hop

# paramiko's transport thread logs its own failures, tracebacks included; with no handler configured
# Python prints them on stderr ahead of dynctl's one-line error. Its log goes to per-hop channels
# below this one, which keep what the peer sent before its banner and report nothing themselves.
_WIRE_LOG = "dynctl.ssh.wire"
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger(_WIRE_LOG).addHandler(logging.NullHandler())
logging.getLogger(_WIRE_LOG).propagate = False


class _PeerLines(logging.Handler):
    """The first lines a peer sent instead of an SSH banner (paramiko logs each as "Banner: ...")."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            text = record.getMessage()
            if text.startswith("Banner: ") and len(self.lines) < 3:
                self.lines.append(text[len("Banner: "):][:120])


class Login:
    """How to log in to each hop: which host keys to trust, which key to offer, how long to wait."""

    def __init__(self, known_hosts: KnownHosts, *, accept_new: bool, timeout: float,
                 identity_file: str | None, description: str = "ssh") -> None:
        self.known_hosts = known_hosts
        self.accept_new = accept_new
        self.timeout = timeout
        self.identity_file = identity_file
        self.description = description  # the target, for messages about any hop

    def tcp_connect(self, hop: Hop, label: str) -> socket.socket:
        where = f"{hop.hostname}:{hop.port}"
        try:
            sock = socket.create_connection((hop.hostname, hop.port), timeout=self.timeout)
        except socket.gaierror as err:
            raise UnreachableError(f"{label}: cannot resolve host name '{hop.hostname}' ({err.strerror})") from None
        except ConnectionRefusedError:
            raise UnreachableError(f"{label}: connection refused by {where} (is sshd listening on port "
                                   f"{hop.port}?)") from None
        except TimeoutError:
            raise UnreachableError(f"{label}: no answer from {where} within {self.timeout:g} s "
                                   "(host down, or a firewall drops the packets)") from None
        except OSError as err:
            raise UnreachableError(f"{label}: cannot connect to {where}: {err.strerror or err}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # 47 ms -> 2.5 ms per command
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return sock

    def jump_channel(self, gateway: paramiko.SSHClient, via: Hop, hop: Hop) -> paramiko.Channel:
        transport = gateway.get_transport()
        assert transport is not None
        try:
            return transport.open_channel("direct-tcpip", (hop.hostname, hop.port), ("", 0), timeout=self.timeout)
        except paramiko.ChannelException as err:
            raise UnreachableError(f"{self.description}: jump host {via} could not connect to "
                                   f"{hop.hostname}:{hop.port} ({err.text})") from None
        except (paramiko.SSHException, EOFError, OSError) as err:
            raise UnreachableError(f"{self.description}: jump host {via} failed to open a tunnel to "
                                   f"{hop.hostname}:{hop.port}: {err or type(err).__name__}") from None

    def login(self, hop: Hop, sock: socket.socket | paramiko.Channel, label: str) -> paramiko.SSHClient:
        keys = self._identity_files(hop)
        client = paramiko.SSHClient()
        # paramiko gets no known keys: every decision is the policy's, which reads known_hosts as OpenSSH does.
        policy = HostKeyPolicy(self.known_hosts, hop.known_hosts_name, hop.hostname, self.accept_new, label)
        client.set_missing_host_key_policy(policy)
        # One channel per hop address keeps the number of loggers bounded however often we reconnect.
        wire = logging.getLogger(f"{_WIRE_LOG}.{hop.hostname.replace('.', '_')}_{hop.port}")
        peer = _PeerLines()
        wire.setLevel(logging.DEBUG)
        wire.addHandler(peer)
        client.set_log_channel(wire.name)
        t = self.timeout
        started = time.monotonic()
        try:
            # `timeout` bounds the whole key exchange: longer than the banner wait, or paramiko gives up
            # silently and fails later with a misleading "No existing session".
            client.connect(hop.hostname, hop.port, username=hop.user, sock=sock, key_filename=keys or None,
                           look_for_keys=not keys, allow_agent=not hop.identities_only, timeout=2 * t,
                           banner_timeout=t, auth_timeout=t, channel_timeout=t,
                           transport_factory=policy.transport_factory)
        except HostKeyError:
            client.close()
            raise
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
            why = self._explain_handshake(err, hop, time.monotonic() - started, peer.lines)
            raise UnreachableError(f"{label}: {why}") from None
        finally:
            wire.removeHandler(peer)
            wire.setLevel(logging.WARNING)  # paramiko's per-packet debug lines cost nothing once filtered here
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(30)  # keeps NAT/firewall state alive; it cannot detect a dead peer
        return client

    def _explain_handshake(self, err: Exception, hop: Hop, elapsed: float, peer_lines: list[str]) -> str:
        where = f"{hop.hostname}:{hop.port}"
        text = str(err)
        no_banner = "banner" in text or "protocol version" in text
        # paramiko raises its banner error from inside the read that failed: that read says what happened.
        cause = err.__context__ if no_banner else err
        said = next((line.strip() for line in peer_lines if line.strip()), "")
        if no_banner and said:
            return (f"{where} is not an SSH server: it answered {said!r} instead of an SSH banner "
                    f"(wrong port in the ssh target or ~/.ssh/config?)")
        if isinstance(cause, (EOFError, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
            stage = "before sending an SSH banner" if cause is not err else "during the SSH handshake"
            return f"{where} closed the connection after {elapsed:.1f} s, {stage} (is that port an SSH server?)"
        if "banner" in text:
            return (f"connected to {where} but got no SSH banner within {self.timeout:g} s "
                    f"(is that port an SSH server?)")
        if "No existing session" in text:
            return f"SSH key exchange with {hop.hostname}:{hop.port} did not finish within {2 * self.timeout:g} s"
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


def login_chain(route: Sequence[Hop], login: Login) -> list[paramiko.SSHClient]:
    """Log in to every hop in order; the last client is the target. Nothing stays open on failure."""
    clients: list[paramiko.SSHClient] = []
    sock: socket.socket | paramiko.Channel | None = None
    try:
        for i, hop in enumerate(route):
            last = i == len(route) - 1
            label = login.description if last else f"jump host {hop} (for {login.description})"
            if i == 0:
                sock = login.tcp_connect(hop, label)
            else:
                sock = login.jump_channel(clients[-1], route[i - 1], hop)
            clients.append(login.login(hop, sock, label))
            sock = None
    except BaseException:
        if sock is not None:
            with contextlib.suppress(Exception):
                sock.close()
        for c in reversed(clients):
            c.close()
        raise
    return clients
