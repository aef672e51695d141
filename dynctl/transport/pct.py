"""Inside a Proxmox LXC container: `pct exec <ctid> --keep-env 0 -- argv...` through another transport.

pct hands argv to lxc-attach with no shell in between, so this layer adds no quoting of its own; the
inner transport quotes once for its login shell. The command runs under a constant `sh -c` script that
reports the exit status on stderr, because some LXC versions lose it (3.0.4-3.2.1 returned 0 for
failing commands, lxc#3104; killed commands returned 0 until lxc#4204). The sentinel is trusted and
stripped, so stderr comes back byte for byte.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from dynctl.base.errors import UnreachableError
from dynctl.transport.base import Result, Stream, Transport

RC_MARK = b"\x1e__dynctl_rc="
# `(exec "$@")` runs argv as a program, never as a shell builtin or function, as lxc-attach would.
RC_SCRIPT = "(exec \"$@\"); rc=$?; printf '\\036__dynctl_rc=%d\\n' \"$rc\" >&2; exit \"$rc\""
_RC_TAIL = re.compile(re.escape(RC_MARK) + rb"(\d+)\n\Z")
# What `pct` itself says when it cannot run anything (a Perl die, exit 255).
_PCT_REFUSALS = (
    (re.compile(rb"container '?\d+'? not running"), "is not running"),
    (re.compile(rb"Configuration file '[^']*' does not exist"), "does not exist"),
)


def split_status(err: bytes) -> tuple[int | None, bytes]:
    """The exit status from the sentinel at the end of stderr, and stderr without it."""
    m = _RC_TAIL.search(err)
    if m is None:
        return None, err
    return int(m.group(1)), err[: m.start()]


class Pct:
    """Runs argv inside container `ctid` on the host that `inner` reaches."""

    def __init__(self, inner: Transport, ctid: int) -> None:
        if isinstance(ctid, bool) or not isinstance(ctid, int) or ctid < 1:
            raise ValueError(f"container id must be a positive integer, got {ctid!r}")
        self.inner = inner
        self.ctid = ctid
        self.description = f"{inner.description} → pct {ctid}"
        self._checked = False
        self._check_lock = threading.Lock()

    @property
    def host_label(self) -> str:
        return getattr(self.inner, "host_label", self.inner.description)

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """The argv the inner transport runs: pct, found on the far PATH (so a test shim can stand in)."""
        if not argv:
            raise ValueError("empty argv")
        return ["pct", "exec", str(self.ctid), "--keep-env", "0", "--", "sh", "-c", RC_SCRIPT, "sh",
                *map(str, argv)]

    def ensure_running(self) -> None:
        """`pct status` once per transport: a missing or stopped container is a clear error, not rc 255."""
        with self._check_lock:
            if self._checked:
                return
            res = self.inner.run(["pct", "status", str(self.ctid)], timeout=30)
            status = re.search(rb"status:\s*(\S+)", res.out) if res.ok else None
            if status and status.group(1) == b"running":
                self._checked = True
                return
            raise self._status_error(res, status.group(1).decode() if status else None)

    def _status_error(self, res: Result, status: str | None) -> UnreachableError:
        where, ct = self.host_label, self.ctid
        if status is not None:
            return UnreachableError(f"container {ct} is not running on {where} (pct status: {status}); "
                                    f"start it there with `pct start {ct}`")
        said = res.stderr.strip() or res.stdout.strip()
        if b"does not exist" in res.err:
            return UnreachableError(f"container {ct} does not exist on {where} (pct: {said}); "
                                    "check the host's `pct` id in the dynctl config")
        if res.rc == 127 or b"not found" in res.err:
            return UnreachableError(f"`pct` not found on {where}: is it a Proxmox VE node? ({said})")
        if b"run as root" in res.err:
            return UnreachableError(f"`pct` on {where} needs root: log in as root ({said})")
        return UnreachableError(f"`pct status {ct}` failed on {where} (exit {res.rc}): {said}")

    def run(self, argv: Sequence[str], stdin: bytes | None = None, timeout: float = 60.0) -> Result:
        self.ensure_running()
        res = self.inner.run(self.exec_argv(argv), stdin=stdin, timeout=timeout)
        rc, err = split_status(res.err)
        if rc is not None:
            return Result(rc, res.out, err)
        if res.rc == 255:
            for pattern, what in _PCT_REFUSALS:
                if pattern.search(res.err):
                    raise UnreachableError(f"container {self.ctid} {what} on {self.host_label} "
                                           f"(pct: {res.stderr.strip()})")
        if res.rc == 0:  # pct said success, yet the command never reported: LXC lost its status
            return Result(255, res.out, err + b"dynctl: no exit status came back from the container\n")
        return Result(res.rc, res.out, err)

    def open_stream(self, argv: Sequence[str], stdin: bytes | None = None) -> PctStream:
        self.ensure_running()
        return PctStream(self.inner.open_stream(self.exec_argv(argv), stdin=stdin))

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # The SSH connection is the Proxmox host's: tunnels opened on it start there (an address given to
        # them is as seen from there; in tests the shim's container shares the host's loopback).
        if name in ("connect", "connections_opened"):
            return getattr(self.inner, name)
        raise AttributeError(name)


class PctStream:
    """The inner stream, with the exit status taken from the sentinel when the inner one keeps stderr."""

    def __init__(self, inner: Stream) -> None:
        self._inner = inner

    def lines(self) -> Iterator[bytes]:
        return self._inner.lines()

    def close(self) -> None:
        self._inner.close()

    @property
    def rc(self) -> int | None:
        err = getattr(self._inner, "stderr", None)
        if isinstance(err, bytes):
            rc, _ = split_status(err)
            if rc is not None:
                return rc
        return self._inner.rc

    @property
    def stderr(self) -> bytes:
        return split_status(getattr(self._inner, "stderr", b""))[1]
