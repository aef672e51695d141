"""This machine, through subprocess: no shell, argv as given."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence

from dynctl.errors import CommandTimeout, PreflightError
from dynctl.transport.base import Result


class LocalStream:
    def __init__(self, argv: Sequence[str], stdin: bytes | None) -> None:
        try:
            self._proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except FileNotFoundError as err:
            raise PreflightError(f"{argv[0]}: command not found on this machine ({err.strerror})") from None
        if stdin is not None:
            assert self._proc.stdin is not None
            # a command may exit before reading its input (the agent's boot stub asking for an upload):
            # its exit status says what happened, not the broken pipe
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.write(stdin)
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()

    def lines(self) -> Iterator[bytes]:
        assert self._proc.stdout is not None
        yield from self._proc.stdout

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout:
            self._proc.stdout.close()

    @property
    def rc(self) -> int | None:
        return self._proc.poll()


class Local:
    description = "local"

    def run(self, argv: Sequence[str], stdin: bytes | None = None, timeout: float = 60.0) -> Result:
        try:
            proc = subprocess.run(
                list(argv),
                input=stdin if stdin is not None else b"",
                capture_output=True,
                timeout=timeout,
            )
        except FileNotFoundError as err:
            return Result(127, b"", f"{argv[0]}: command not found ({err.strerror})\n".encode())
        except subprocess.TimeoutExpired as err:
            raise CommandTimeout(f"local command {argv[0]} did not finish within {timeout:g} s") from err
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def open_stream(self, argv: Sequence[str], stdin: bytes | None = None) -> LocalStream:
        return LocalStream(argv, stdin)

    def close(self) -> None:
        pass
