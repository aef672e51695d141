"""Client side of the host agent: upload once under its hash, call verbs with JSON, map answers to errors."""

from __future__ import annotations

import getpass
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

from dynctl.agent import archive
from dynctl.base.config import Config, HostConfig
from dynctl.base.errors import (
    ConfigError,
    DynctlError,
    HostKeyError,
    OperationFailed,
    PreflightError,
    UnreachableError,
    UsageError,
)
from dynctl.base.hostspec import workdir_problem
from dynctl.transport import close_all, connect
from dynctl.transport.base import Transport

PROTOCOL = 1
_MISSING_RC = 97  # the boot program found no copy of this agent: upload it
_DAMAGED_RC = 96  # the copy is there but damaged (a file changed or gone, a module that does not load): repair it

# The programs that run on the host before the agent does (remote/bootstrap/): the boot program runs the
# agent's copy in workdir/agent/<hash> once it has checked that no other user could have changed the workdir
# or the copy and that the copy is intact (exit _MISSING_RC: not there, _DAMAGED_RC: damaged); the upload
# program installs that copy. The boot program gets its refusal texts (words.py) as an argument of their own.
_CONSTANTS = f"PROTOCOL = {PROTOCOL}\nMISSING = {_MISSING_RC}\nDAMAGED = {_DAMAGED_RC}\n"

CALL_TIMEOUT = 120.0  # seconds one verb may take (the long waits of a stop or a start raise it for their call)
LOOK_TIMEOUT = 30.0  # for what only looks (the live feed, `dynctl hosts`): an unanswered host is reported sooner


def boot_argv(python: str, workdir: str) -> list[str]:
    # -S: the agent is the standard library and its own copy, so site's work (site-packages, every .pth file
    # of the server's environment) is skipped on every call
    return [python, "-S", "-c", _CONSTANTS + archive.host_program("checks", "boot"), workdir, archive.agent_digest(),
            archive.host_program("words")]


def upload_argv(python: str, workdir: str, repair: bool = False) -> list[str]:
    return [python, "-c", archive.host_program("checks", "words", "upload"), workdir, archive.agent_digest(),
            *(["repair"] * repair)]


class AgentError(DynctlError):
    """A refusal or failure reported by the agent; `kind` says which."""

    def __init__(self, message: str, kind: str, answer: dict[str, Any]) -> None:
        super().__init__(message)
        self.kind = kind
        self.answer = answer
        # "down": the server an operation needs is not running; "cancelled": an operation that never started;
        # nothing was changed, so exit 3 too.
        self.exit_code = {"preflight": 3, "busy": 3, "down": 3, "cancelled": 3, "usage": 2, "protocol": 2}.get(kind, 1)


def open_agent(host: HostConfig, config: Config | None = None, timeout: float = CALL_TIMEOUT) -> AgentClient:
    """The agent of `host`, over the connection this process keeps for it: the one way every view and action
    reaches a host."""
    return AgentClient(connect(host, config), host, timeout)


def close_connections() -> None:
    """Close every connection this process opened to a host (at the end of a command)."""
    close_all()


class AgentClient:
    def __init__(self, transport: Transport, host: HostConfig, timeout: float = CALL_TIMEOUT) -> None:
        if problem := workdir_problem(host.workdir):  # config files are checked; hosts built in code are not
            raise ConfigError(f"hosts.{host.name}.workdir: {problem}")
        self.transport = transport
        self.host = host
        self.timeout = timeout
        self.round_trips = 0

    def _request(self, verb: str, params: dict[str, Any]) -> bytes:
        return json.dumps({
            "protocol": PROTOCOL,
            "verb": verb,
            "params": params,
            "host": {
                "name": self.host.name,
                "workdir": self.host.workdir,
                "python": self.host.python,
                "port": self.host.port,
                "env": self.host.env,
                "launch": self.host.launch_argv(),
                "args": list(self.host.args),
                "keep_history": self.host.keep_history,
            },
            "client": {"user": getpass.getuser(), "hostname": socket.gethostname()},
        }).encode()

    def _boot_argv(self) -> list[str]:
        # The host's env is applied by the agent to what it runs (with $VARS expanded there), not here:
        # `env PATH=/x:${PATH}` would hand the agent a literal "${PATH}".
        return boot_argv(self.host.python, self.host.workdir)

    def upload(self, repair: bool = False) -> None:
        """Install the agent unless an intact copy is there; `repair`: replace the copy in any case."""
        argv = upload_argv(self.host.python, self.host.workdir, repair)
        self.round_trips += 1
        res = self.transport.run(argv, stdin=archive.agent_archive(), timeout=self.timeout)
        # exit 3: the upload program's own refusal, whatever its text says
        if res.rc == 127 or (res.rc != 3 and b"No such file" in res.err and not res.out):
            raise PreflightError(
                f"{self.host.name}: python interpreter '{self.host.python}' not found "
                f"({self.transport.description}); set hosts.{self.host.name}.python"
            )
        if not res.ok:
            raise PreflightError(f"{self.host.name}: {res.stderr.strip() or 'agent upload failed'}")

    def call(self, verb: str, **params: Any) -> Any:
        """Run a verb; return its `result`, or raise AgentError with the agent's message."""
        answer = self._call_raw(verb, params)
        return answer.get("result")

    def call_through_drop(self, verb: str, lock: str, reconnect_for: float = 60.0, **params: Any) -> Any:
        """call() for a verb that is safe to send twice because it finds what an earlier one did (stop, start).

        After a dropped connection: reconnect and send it again, so the answer says what the host did rather
        than "unreachable"; while the first request still holds the host (`lock`, taken by us), wait for it.
        """
        dropped_at: float | None = None
        while True:
            try:
                return self.call(verb, **params)
            except HostKeyError:
                raise
            except UnreachableError as err:
                dropped_at = _pause_after_drop(err, dropped_at, reconnect_for)
            except AgentError as err:
                holder = err.answer.get("holder") or {}
                ours = (holder.get("operation") == lock and holder.get("who") == getpass.getuser()
                        and holder.get("client_host") == socket.gethostname())
                if dropped_at is None or err.kind != "busy" or not ours:
                    raise
                self._wait_unlocked(dropped_at + reconnect_for + self.timeout)

    def stream_through_drop(self, verb: str, reconnect_for: float = 60.0, **params: Any) -> Iterator[dict[str, Any]]:
        """stream() for a verb that only looks (a readiness wait): after a dropped connection, open it again."""
        dropped_at: float | None = None
        while True:
            try:
                yield from self.stream(verb, **params)
                return
            except HostKeyError:
                raise
            except UnreachableError as err:
                dropped_at = _pause_after_drop(err, dropped_at, reconnect_for)

    def _wait_unlocked(self, deadline: float) -> None:
        while self.call("op_current")["holder"] is not None:
            if time.monotonic() > deadline:
                raise UnreachableError(f"{self.host.name}: the request sent before the connection dropped still "
                                       "holds the host; see `dynctl status`")
            time.sleep(0.5)

    def _call_raw(self, verb: str, params: dict[str, Any]) -> dict[str, Any]:
        request = self._request(verb, params)
        for attempt in (1, 2):
            self.round_trips += 1
            res = self.transport.run(self._boot_argv(), stdin=request, timeout=self.timeout)
            if res.rc in (_MISSING_RC, _DAMAGED_RC) and attempt == 1:
                self.upload(repair=res.rc == _DAMAGED_RC)
                continue
            return self._parse(verb, res.rc, res.out, res.err)
        raise OperationFailed(f"{self.host.name}: the agent vanished right after upload")

    def _parse(self, verb: str, rc: int, out: bytes, err: bytes) -> dict[str, Any]:
        lines = [ln for ln in out.decode("utf-8", "replace").splitlines() if ln.strip()]
        if rc == _DAMAGED_RC and not lines:
            raise PreflightError(f"{self.host.name}: {err.decode('utf-8', 'replace').strip()[-800:]}; installing the "
                                 f"agent again did not repair it: check the disk under {self.host.workdir}, or remove "
                                 f"{self.host.workdir}/agent for a fresh copy; nothing was changed")
        if rc == 127 or (not lines and b"not found" in err):
            raise PreflightError(
                f"{self.host.name}: python interpreter '{self.host.python}' not found "
                f"({self.transport.description}); set hosts.{self.host.name}.python"
            )
        if not lines:
            raise OperationFailed(
                f"{self.host.name}: agent verb '{verb}' exited {rc} without an answer: "
                f"{err.decode('utf-8', 'replace').strip()[-800:]}"
            )
        try:
            answer = json.loads(lines[-1])
        except ValueError:
            raise OperationFailed(f"{self.host.name}: agent answered garbage: {lines[-1][:200]!r}") from None
        return self._check(answer)

    def _check(self, answer: dict[str, Any]) -> dict[str, Any]:
        if answer.get("protocol") != PROTOCOL:
            raise UsageError(
                f"{self.host.name}: agent protocol {answer.get('protocol')} does not match client protocol {PROTOCOL}"
            )
        if not answer.get("ok"):
            raise AgentError(f"{self.host.name}: {answer.get('error')}", answer.get("kind", "failed"), answer)
        return answer

    def stream(self, verb: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Run a streaming verb; yield each JSON line until the agent says done."""
        request = self._request(verb, params)
        for attempt in (1, 2):
            self.round_trips += 1
            stream = self.transport.open_stream(self._boot_argv(), stdin=request)
            got_any = False
            try:
                for raw in stream.lines():
                    if not raw.strip():
                        continue
                    got_any = True
                    item = self._check(json.loads(raw))
                    if item.get("done"):
                        return
                    yield item
            finally:
                stream.close()
            if not got_any and stream.rc in (_MISSING_RC, _DAMAGED_RC) and attempt == 1:
                self.upload(repair=stream.rc == _DAMAGED_RC)
                continue
            if not got_any and stream.rc == _DAMAGED_RC:
                raise PreflightError(f"{self.host.name}: the dynctl agent in {self.host.workdir}/agent is damaged and "
                                     "installing it again did not repair it (`dynctl hosts` shows why); nothing was "
                                     "changed")
            if stream.rc is None or stream.rc < 0:  # no exit status: the connection went away
                raise UnreachableError(f"{self.host.name}: connection lost during agent stream '{verb}'")
            raise OperationFailed(f"{self.host.name}: agent stream '{verb}' ended early (rc {stream.rc})")


def _pause_after_drop(err: UnreachableError, dropped_at: float | None, reconnect_for: float) -> float:
    """A moment before the next attempt; `err` again once the host has stayed away for `reconnect_for`."""
    dropped_at = dropped_at or time.monotonic()
    if time.monotonic() - dropped_at > reconnect_for:
        raise err
    time.sleep(1.0)
    return dropped_at
