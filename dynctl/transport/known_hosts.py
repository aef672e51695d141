"""Host keys the OpenSSH way: the user's known_hosts read-only, dynctl's own file for accept-new.

A changed key is always refused; an unknown one only when the user opted into accept-new for that
host, and then it is appended to dynctl's file (0600, written to a temp file and renamed).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from pathlib import Path

import paramiko

from dynctl.errors import ConfigError, HostKeyError

log = logging.getLogger("dynctl.ssh")

SYSTEM_FILES = ("~/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")
_KEY_LABELS = {"ssh-ed25519": "ED25519", "ssh-rsa": "RSA", "ssh-dss": "DSA"}
_write_lock = threading.Lock()


def key_label(key: paramiko.PKey) -> str:
    name = key.get_name()
    return _KEY_LABELS.get(name) or ("ECDSA" if name.startswith("ecdsa") else name)


def fingerprint(key: paramiko.PKey) -> str:
    """SHA256:... exactly as `ssh-keygen -lf` and OpenSSH's prompts print it."""
    return key.fingerprint


class KnownHosts:
    """The known_hosts files dynctl reads, and the one it may append to."""

    def __init__(self, own_path: str, read_only_paths: tuple[str, ...] = SYSTEM_FILES) -> None:
        self.own_path = Path(os.path.expanduser(own_path))
        self.read_only_paths = [Path(os.path.expanduser(p)) for p in read_only_paths]

    def files(self) -> list[Path]:
        return [p for p in (*self.read_only_paths, self.own_path) if p.is_file()]

    def load_into(self, client: paramiko.SSHClient) -> None:
        """Give `client` every known key; none of these files is ever written by paramiko."""
        for path in self.files():
            try:
                if path == self.own_path:
                    client.get_host_keys().load(str(path))
                else:
                    client.load_system_host_keys(str(path))
            except (paramiko.hostkeys.InvalidHostKey, OSError, UnicodeDecodeError) as err:
                raise ConfigError(f"{path}: unreadable known_hosts file: {err}") from None

    def where_is(self, name: str, key: paramiko.PKey) -> Path | None:
        """Which file holds `key` for `name` (to point the user at the entry to fix)."""
        for path in self.files():
            with contextlib.suppress(Exception):
                entry = paramiko.HostKeys(str(path)).lookup(name)
                if entry is not None and entry.get(key.get_name()) == key:
                    return path
        return None

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


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko only for a host with no known key: refuse, or accept-new when opted in."""

    def __init__(self, store: KnownHosts, accept_new: bool, label: str) -> None:
        self.store = store
        self.accept_new = accept_new
        self.label = label
        self.accepted: list[tuple[str, str]] = []

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.accept_new:
            raise HostKeyError(
                f"{self.label}: unknown host key for {hostname}: {key_label(key)} key fingerprint is "
                f"{fingerprint(key)}. Check it on the host (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub), "
                f"then trust it once by setting `accept_new_host_key = true` in this host's section "
                f"(hosts.NAME) of the dynctl config (it is then stored in {self.store.own_path}), or add it to "
                f"~/.ssh/known_hosts"
            )
        self.store.remember(hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.accepted.append((hostname, fingerprint(key)))


def changed_key_error(label: str, name: str, store: KnownHosts, presented: paramiko.PKey,
                      expected: paramiko.PKey) -> HostKeyError:
    where = store.where_is(name, expected)
    where_text = f" in {where}" if where else ""
    fix = f"ssh-keygen -R '{name}' -f {where}" if where else f"ssh-keygen -R '{name}'"
    return HostKeyError(
        f"{label}: HOST KEY CHANGED for {name} (possible man-in-the-middle; refusing to connect). "
        f"Known{where_text}: {key_label(expected)} {fingerprint(expected)}; presented now: "
        f"{key_label(presented)} {fingerprint(presented)}. If the host was reinstalled, verify the new key "
        f"on it and remove the old entry ({fix})"
    )
