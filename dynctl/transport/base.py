"""What every transport offers: run an argv there, stream an argv's output."""

from __future__ import annotations

import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

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
