"""This machine, through subprocess: no shell, argv as given."""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Iterator, Sequence

from dynctl.base.errors import CommandTimeout, PreflightError
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


def _leave_running(proc: subprocess.Popen) -> None:
    """After Ctrl-C: let the command finish on its own (its answer goes unread) and reap it when it does,
    so it is neither killed nor left a zombie."""
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    threading.Thread(target=proc.wait, daemon=True).start()


class Local:
    description = "local"

    def run(self, argv: Sequence[str], stdin: bytes | None = None, timeout: float = 60.0) -> Result:
        """Run argv in a session of its own, as sshd and pct would: a Ctrl-C in this terminal interrupts dynctl,
        never the agent half way through a stop; the caller asks the host what became of it."""
        try:
            proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except FileNotFoundError as err:
            return Result(127, b"", f"{argv[0]}: command not found ({err.strerror})\n".encode())
        try:
            out, err = proc.communicate(stdin if stdin is not None else b"", timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            proc.communicate()
            raise CommandTimeout(f"local command {argv[0]} did not finish within {timeout:g} s") from exc
        except KeyboardInterrupt:
            _leave_running(proc)
            raise
        return Result(proc.returncode, out, err)

    def open_stream(self, argv: Sequence[str], stdin: bytes | None = None) -> LocalStream:
        return LocalStream(argv, stdin)

    def close(self) -> None:
        pass
