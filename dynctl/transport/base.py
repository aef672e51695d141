"""What every transport offers: run an argv there, stream an argv's output, write a file atomically."""

from __future__ import annotations

import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

# Writes stdin to $1 atomically: temp file in the same directory, chmod, rename. Constant script,
# arguments positional, so no quoting is ever built by concatenation.
ATOMIC_WRITE_SH = (
    'set -e; d=$(dirname -- "$1"); mkdir -p -- "$d"; t="$d/.$(basename -- "$1").tmp.$$"; '
    'trap \'rm -f -- "$t"\' EXIT; cat > "$t"; chmod "$2" "$t"; mv -f -- "$t" "$1"; trap - EXIT'
)


def sh_join(argv: Sequence[str]) -> str:
    """One POSIX-shell quoting layer: the string a remote login shell parses back into `argv`."""
    return " ".join(shlex.quote(str(a)) for a in argv)


@dataclass(frozen=True)
class Result:
    rc: int
    out: bytes
    err: bytes

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def stdout(self) -> str:
        return self.out.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.err.decode("utf-8", "replace")


class Stream(Protocol):
    """A running remote command whose stdout is read line by line."""

    def lines(self) -> Iterator[bytes]: ...

    def close(self) -> None: ...

    @property
    def rc(self) -> int | None: ...


class Transport(Protocol):
    description: str

    def run(self, argv: Sequence[str], stdin: bytes | None = None, timeout: float = 60.0) -> Result: ...

    def open_stream(self, argv: Sequence[str], stdin: bytes | None = None) -> Stream: ...

    def close(self) -> None: ...


def write_file_atomic(transport: Transport, path: str, data: bytes, mode: int = 0o600, timeout: float = 60.0) -> Result:
    """Write `data` to `path` on the far side: temp file next to it, then rename."""
    return transport.run(["sh", "-c", ATOMIC_WRITE_SH, "sh", path, f"{mode:o}"], stdin=data, timeout=timeout)
