"""Errors the user can act on, each carrying the exit code of SPEC §2."""

from __future__ import annotations


class DynctlError(Exception):
    """Base error: `str(err)` is the message shown to the operator."""

    exit_code = 1


class OperationFailed(DynctlError):
    """The operation failed (and was rolled back where that applies)."""

    exit_code = 1


class UsageError(DynctlError):
    """Bad arguments or a bad config file."""

    exit_code = 2


class ConfigError(UsageError):
    pass


class PreflightError(DynctlError):
    """A pre-flight check failed; nothing on the host was changed."""

    exit_code = 3


class UnreachableError(DynctlError):
    """Host unreachable, or authentication / host-key failure."""

    exit_code = 4


class HostKeyError(UnreachableError):
    pass


class CommandTimeout(DynctlError):
    """A command on the host did not finish in time."""

    exit_code = 1


class Interrupted(DynctlError):
    """Ctrl-C while following an operation; the message says what became of it on the host."""

    exit_code = 130
