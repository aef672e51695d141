"""Host keys the OpenSSH way: the user's known_hosts read-only, dynctl's own file for accept-new.

The files are read as sshd(8) documents them under SSH_KNOWN_HOSTS FILE FORMAT: comma-separated
patterns with `*`, `?` and `!` negation, `[host]:port`, hashed names (`|1|salt|hmac`), and the markers
`@cert-authority` (a CA whose host certificates are trusted for those hosts) and `@revoked` (a key never
to accept). A line dynctl cannot read is skipped with a warning, as OpenSSH skips it; it never makes
every connection fail.

A revoked key is always refused; a host certificate is accepted when a matching @cert-authority signed
it and it is valid for the host; otherwise the plain key decides: known and equal is accepted, a
different one is refused as changed, an unknown one only with accept-new (then appended to dynctl's
file, 0600, written to a temp file and renamed).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import hmac
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import paramiko

from dynctl.base.errors import ConfigError, HostKeyError
from dynctl.transport.host_cert import CERT_SUFFIX, HostCertificate, host_certificate

log = logging.getLogger("dynctl.ssh")

SYSTEM_FILES = ("~/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")
CERT_AUTHORITY, REVOKED = "@cert-authority", "@revoked"
_KEY_LABELS = {"ssh-ed25519": "ED25519", "ssh-rsa": "RSA", "ssh-dss": "DSA"}
_write_lock = threading.Lock()
_warned: set[tuple[str, int, str]] = set()  # each unreadable line is reported once per process


def key_label(key: paramiko.PKey) -> str:
    name = key.get_name()
    return _KEY_LABELS.get(name) or ("ECDSA" if name.startswith("ecdsa") else name)


def fingerprint(key: paramiko.PKey) -> str:
    """SHA256:... exactly as `ssh-keygen -lf` and OpenSSH's prompts print it."""
    return key.fingerprint


def _warn_once(path: Path, lineno: int, why: str) -> None:
    if (str(path), lineno, why) not in _warned:
        _warned.add((str(path), lineno, why))
        log.warning("%s line %d: %s; line skipped", path, lineno, why)


@dataclass(frozen=True)
class Entry:
    """One usable line of a known_hosts file."""

    path: Path
    lineno: int
    marker: str | None  # None, CERT_AUTHORITY or REVOKED
    patterns: tuple[str, ...]
    key: paramiko.PKey

    @property
    def where(self) -> str:
        return f"{self.path}:{self.lineno}"


def host_matches(patterns: Sequence[str], name: str) -> bool:
    """OpenSSH's match_hostname: any pattern matches and no negated one does (case-insensitive)."""
    name = name.lower()
    found = False
    for pattern in patterns:
        if pattern.startswith("|1|"):
            found = found or _hashed_matches(pattern, name)
            continue
        negated = pattern.startswith("!")
        if _glob(pattern[1:] if negated else pattern).fullmatch(name):
            if negated:
                return False
            found = True
    return found


def _glob(pattern: str) -> re.Pattern[str]:
    # Only * and ? are special in known_hosts; `[host]:port` brackets are literal.
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower()))


def _hashed_matches(pattern: str, name: str) -> bool:
    try:
        _, _, salt64, digest64 = pattern.split("|", 3)
        salt, digest = base64.b64decode(salt64, validate=True), base64.b64decode(digest64, validate=True)
    except (ValueError, binascii.Error):
        return False
    return hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), digest)


def parse_line(text: str) -> tuple[str | None, tuple[str, ...], str, str] | None:
    """(marker, patterns, key type, base64) of one line; None for blank and comment lines.

    Raises ValueError naming what is wrong with the line.
    """
    fields = text.split()
    if not fields or fields[0].startswith("#"):
        return None
    marker = None
    if fields[0].startswith("@"):
        marker = fields.pop(0)
        if marker not in (CERT_AUTHORITY, REVOKED):
            raise ValueError(f"unknown marker {marker!r} (OpenSSH knows {CERT_AUTHORITY} and {REVOKED})")
    if len(fields) < 3:
        raise ValueError("expected host patterns, a key type and a key")
    patterns = tuple(p for p in fields[0].split(",") if p)
    if not patterns:
        raise ValueError("no host pattern")
    return marker, patterns, fields[1], fields[2]


def read_entries(path: Path, name: str) -> list[Entry]:
    """The lines of `path` for host `name` that dynctl can use; the others are reported once and skipped.

    A line's key is decoded only when its patterns match: a large file costs one pattern test per line.
    """
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as err:
        raise ConfigError(f"{path}: unreadable known_hosts file: {err.strerror or err}") from None
    entries = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        try:
            parsed = parse_line(line)
        except ValueError as err:
            _warn_once(path, lineno, str(err))
            continue
        if parsed is None or not host_matches(parsed[1], name):
            continue
        marker, patterns, key_type, b64 = parsed
        try:
            blob = base64.b64decode(b64, validate=True)
        except (ValueError, binascii.Error):
            _warn_once(path, lineno, "the key is not valid base64")
            continue
        try:
            key = paramiko.PKey.from_type_string(key_type, blob)
        except paramiko.UnknownKeyType:
            _warn_once(path, lineno, f"key type {key_type!r} is not supported by dynctl")
            continue
        except (paramiko.SSHException, ValueError, TypeError, IndexError) as err:
            _warn_once(path, lineno, f"unreadable {key_type} key ({err or type(err).__name__})")
            continue
        entries.append(Entry(path, lineno, marker, patterns, key))
    return entries


class KnownHosts:
    """The known_hosts files dynctl reads, and the one it may append to."""

    def __init__(self, own_path: str, read_only_paths: tuple[str, ...] = SYSTEM_FILES) -> None:
        self.own_path = Path(os.path.expanduser(own_path))
        self.read_only_paths = [Path(os.path.expanduser(p)) for p in read_only_paths]

    def files(self) -> list[Path]:
        return [p for p in (*self.read_only_paths, self.own_path) if p.is_file()]

    def entries_for(self, name: str) -> list[Entry]:
        """The lines of every file whose patterns match `name` (read afresh: another process may have added one)."""
        return [e for path in self.files() for e in read_entries(path, name)]

    def remember(self, name: str, key: paramiko.PKey) -> None:
        """Append `name key` to dynctl's own file atomically; other processes are serialised by flock."""
        path = self.own_path
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        line = f"{name} {key.get_name()} {key.get_base64()}\n".encode()
        with _write_lock, open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            old = path.read_bytes() if path.exists() else b""
            if old and not old.endswith(b"\n"):
                old += b"\n"
            tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(old + line)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, 0o600)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
        log.warning("Permanently added '%s' (%s %s) to %s", name, key_label(key), fingerprint(key), path)


class HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Every host-key decision for one login to `hostname` (known_hosts name `name`).

    paramiko is given no keys of its own, so it asks this policy about every server key once the key
    exchange has proved the server holds it, before any credential is sent.
    """

    def __init__(self, store: KnownHosts, name: str, hostname: str, accept_new: bool, label: str) -> None:
        self.store = store
        self.name = name
        self.hostname = hostname
        self.accept_new = accept_new
        self.label = label
        self.entries = store.entries_for(name)
        self.accepted: list[tuple[str, str]] = []

    def host_key_order(self, offered: Sequence[str]) -> tuple[str, ...]:
        """The host key algorithms to offer, as OpenSSH orders them: certificates first where a CA is
        trusted for this host, then the types already known for it, then the rest."""
        first: list[str] = []
        if any(e.marker == CERT_AUTHORITY for e in self.entries):
            first += [k for k in offered if k.endswith(CERT_SUFFIX)]
        known = {e.key.get_name() for e in self.entries if e.marker is None}
        if "ssh-rsa" in known:
            known |= {"rsa-sha2-512", "rsa-sha2-256"}
        first += [k for k in offered if k in known and k not in first]
        return (*first, *(k for k in offered if k not in first))

    def transport_factory(self, sock, **kwargs) -> paramiko.Transport:
        transport = _OrderedTransport(sock, **kwargs)
        transport.order_host_keys = self.host_key_order
        return transport

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        for e in self.entries:
            if e.marker == REVOKED and e.key == key:
                raise HostKeyError(f"{self.label}: the {key_label(key)} host key of {self.name} ({fingerprint(key)}) "
                                   f"is marked @revoked in {e.where}; refusing to connect")
        try:
            cert = host_certificate(key)
        except ValueError as err:
            raise HostKeyError(f"{self.label}: {self.name} presented an {err}; refusing to connect") from None
        if cert is not None and self._trusted_certificate(cert):
            return
        plain = [e for e in self.entries if e.marker is None]
        if any(e.key == key for e in plain):
            return
        if plain:
            same_type = [e for e in plain if e.key.get_name() == key.get_name()]
            raise changed_key_error(self.label, self.name, key, (same_type or plain)[0])
        self._unknown(client, key, cert)

    def _trusted_certificate(self, cert: HostCertificate) -> bool:
        """True when a CA trusted for this host signed `cert` and it is valid; raises when it is not valid.

        A certificate whose CA no @cert-authority line trusts proves nothing: as OpenSSH does, the plain
        key inside it is judged instead.
        """
        for e in self.entries:
            if e.marker == REVOKED and e.key == cert.ca_key:
                raise HostKeyError(f"{self.label}: the host certificate of {self.name} is signed by CA "
                                   f"{key_label(cert.ca_key)} {fingerprint(cert.ca_key)}, which is marked @revoked "
                                   f"in {e.where}; refusing to connect")
        cas = [e for e in self.entries if e.marker == CERT_AUTHORITY and e.key == cert.ca_key]
        if not cas:
            return False
        problem = cert.problem(self.hostname)
        if problem:
            raise HostKeyError(f"{self.label}: the host certificate of {self.name} does not vouch for it: {problem} "
                               f"(its CA is trusted in {cas[0].where}); refusing to connect")
        return True

    def _unknown(self, client: paramiko.SSHClient, key: paramiko.PKey, cert: HostCertificate | None) -> None:
        if not self.accept_new:
            signed = (f" Its host certificate is signed by CA {key_label(cert.ca_key)} {fingerprint(cert.ca_key)}, "
                      f"which no @cert-authority line trusts for it." if cert is not None else "")
            raise HostKeyError(
                f"{self.label}: unknown host key for {self.name}: {key_label(key)} key fingerprint is "
                f"{fingerprint(key)}.{signed} Check it on the host (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub), "
                f"then trust it once by setting `accept_new_host_key = true` in this host's section "
                f"(hosts.NAME) of the dynctl config (it is then stored in {self.store.own_path}), or add it to "
                f"~/.ssh/known_hosts"
            )
        self.store.remember(self.name, key)
        self.accepted.append((self.name, fingerprint(key)))


class _OrderedTransport(paramiko.Transport):
    """A client transport that offers host key algorithms in the order its login asks for."""

    order_host_keys = None

    @property
    def preferred_keys(self):
        offered = super().preferred_keys
        return offered if self.order_host_keys is None else self.order_host_keys(offered)


def changed_key_error(label: str, name: str, presented: paramiko.PKey, expected: Entry) -> HostKeyError:
    return HostKeyError(
        f"{label}: HOST KEY CHANGED for {name} (possible man-in-the-middle; refusing to connect). "
        f"Known in {expected.where}: {key_label(expected.key)} {fingerprint(expected.key)}; presented now: "
        f"{key_label(presented)} {fingerprint(presented)}. If the host was reinstalled, verify the new key "
        f"on it and remove the old entry (ssh-keygen -R '{name}' -f {expected.path})"
    )
