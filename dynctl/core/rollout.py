"""A rolling deploy or rollback over a fleet, through the gateways in front of it (UI-free).

Per host: set the worker's drain time, remove it from every gateway, wait until no gateway lists it and
the server has no request left, run the host's own deploy (or rollback) as one host operation, register it
again, wait until the gateway says ready, send one request through the gateway, move on. A deploy is started
on the host prepared while the gateways drain it (checked and validated, nothing changed) and told to go once
the drain is over, so starting it costs the host no time out of its gateways. Every step is
written to a record on the client before it is taken, so a rollout cut short (Ctrl-C, SIGKILL, a lost
link) resumes where it was: the host in the middle first, and no host is left out of its gateway.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dynctl.core import deploy as core
from dynctl.base import events
from dynctl.core import operations
from dynctl.agent.client import AgentClient, open_agent
from dynctl.base.config import Config, user_state_dir
from dynctl.base.errors import DynctlError, OperationFailed, PreflightError
from dynctl.core.fleet import Fleet, Member, endpoint_slot, fan_out
from dynctl.core.gateway import GatewayClient
from dynctl.core.lifecycle import Confirm, proceed

DEFAULT_DRAIN_S = 30.0  # the longest request a gateway is given to finish before its worker is removed
REGISTER_TIMEOUT_S = 120.0
GO_SLACK_S = 30.0  # a prepared host deploy waits this much longer than its drains may take for its go
_save_lock = threading.Lock()
MIDDLE = ("draining", "running", "registering")  # a host's states between leaving its gateway and coming back


def rollouts_dir() -> Path:
    return user_state_dir() / "rollouts"


@dataclass
class HostResult:
    host: str
    outcome: str = "untouched"  # untouched | unchanged | deployed | rolled back | failed | re-registered
    detail: str = ""
    drain_s: float = 0.0
    operation_s: float = 0.0
    register_s: float = 0.0
    elapsed_s: float = 0.0
    exit_code: int = 0


@dataclass
class Rollout:
    """The record of one rolling operation, kept in the client's state dir (0600)."""

    id: str
    fleet: str
    action: str  # deploy | rollback
    target: str  # the threshold, or the rollback's --to
    started: str
    hosts: dict[str, str] = field(default_factory=dict)  # host -> pending | draining | running | registering | done | failed
    state: str = "running"  # running | done | failed | stopped (declined at the canary pause)
    results: list[dict[str, Any]] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return rollouts_dir() / f"{self.id}.json"

    def save(self) -> None:
        """Write the record whole (temp file, fsync, rename): a SIGKILL leaves the last state, never half of one."""
        with _save_lock:  # hosts of one batch (--max-unavailable > 1) report from their own threads
            rollouts_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)

    def mark(self, host: str, state: str) -> None:
        self.hosts[host] = state
        self.save()


def list_rollouts() -> list[Rollout]:
    """Every rollout record on this client, newest first."""
    found = []
    for path in sorted(rollouts_dir().glob("*.json"), reverse=True) if rollouts_dir().is_dir() else []:
        try:
            found.append(Rollout(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return found


def unfinished(fleet: str) -> Rollout | None:
    return next((r for r in list_rollouts() if r.fleet == fleet and r.state == "running"), None)


def _new(fleet: Fleet, action: str, target: str) -> Rollout:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return Rollout(f"{stamp}-rollout-{uuid.uuid4().hex[:8]}", fleet.name, action, target,
                   dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                   {m.host.name: "pending" for m in fleet.members})


@dataclass
class HostPlan:
    member: Member
    agent: AgentClient
    plan: core.DeployPlan | None = None  # deploy only
    unchanged: str | None = None  # why the host needs no operation


def _prefixed(host: str, sink: events.EventSink) -> events.EventSink:
    def emit(event: Any) -> None:
        match event:
            case events.StepStarted(step=step, detail=detail):
                sink(events.StepStarted(step, f"{host}: {detail}"))
            case events.StepDone(step=step, elapsed=elapsed, detail=detail):
                sink(events.StepDone(step, elapsed, f"{host}: {detail}"))
            case events.Note(text=text):
                sink(events.Note(f"{host}: {text}"))
            case events.Warning(text=text):
                sink(events.Warning(f"{host}: {text}"))
            case events.Finished(outcome=outcome, detail=detail):
                sink(events.Note(f"{host}: {outcome} {detail}".rstrip()))
            case _:
                sink(event)
    return emit


class RollingOperation:
    """`dynctl deploy|rollback --host GROUP`: pre-flight everything, then host by host (K at a time)."""

    def __init__(self, config: Config, fleet: Fleet, action: str, target: Any, *, on_event: events.EventSink =
                 events.ignore, confirm: Confirm = proceed, grace: float = 60.0, ready_timeout: float = 900.0,
                 soak: float = core.DEFAULT_SOAK_S, drain: float = DEFAULT_DRAIN_S, max_unavailable: int = 1,
                 canary: int = 0):
        self.config, self.fleet, self.action = config, fleet, action
        self.target = target
        self.on_event, self.confirm = on_event, confirm
        self.grace, self.ready_timeout, self.soak, self.drain = grace, ready_timeout, soak, drain
        self.max_unavailable, self.canary = max_unavailable, canary
        self.gateways: dict[str, GatewayClient] = {}
        self.results: dict[str, HostResult] = {m.host.name: HostResult(m.host.name) for m in fleet.members}
        self.record: Rollout | None = None  # once the rollout has started
        self.middle: set[str] = set()  # hosts a cut-short rollout left between drain and re-registration

    # ---------------------------------------------------------------- pre-flight: nothing changes here

    def preflight(self) -> list[HostPlan]:
        cut_short = unfinished(self.fleet.name)
        self.middle = {h for h, st in (cut_short.hosts.items() if cut_short else ()) if st in MIDDLE}
        for gw in self.fleet.gateways:
            client = GatewayClient(gw)  # a missing admin key is named here (exit 2)
            client.workers()  # an unreachable gateway or a refused key: exit 4 / 2, before any host
            self.gateways[gw.url] = client
        for m in self.fleet.members:
            if not m.gateways:
                self.on_event(events.Warning(f"{m.host.name}: no gateway in front of it: no drain, its clients see "
                                             "the restart"))
        plans = fan_out(list(self.fleet.members), self._plan)
        errors = [p for p in plans if isinstance(p, DynctlError)]
        if errors:
            worst = max(errors, key=lambda e: e.exit_code)
            text = "; ".join(str(e) for e in errors)
            raise type(worst)(f"{text} (fleet {self.fleet.name}: nothing was changed on any host)")
        return plans  # type: ignore[return-value]

    def _plan(self, member: Member) -> HostPlan | DynctlError:
        with endpoint_slot(member.host):
            return self._plan_one(member)

    def _plan_one(self, member: Member) -> HostPlan | DynctlError:
        try:
            agent = open_agent(member.host, self.config)
            if member.host.name in self.middle:
                self._finish_cut_short(agent, member.host.name)
            if self.action == "deploy":
                plan = core.plan_deploy(agent, member.host, self.target)
                if plan.operator:
                    raise PreflightError(f"{member.host.name}: {plan.operator_line()}; a fleet rollout never takes "
                                         "over a server dynctl did not start: deploy that host alone with --adopt")
                return HostPlan(member, agent, plan, plan.noop)
            core.refuse_if_busy(agent)
            return HostPlan(member, agent)
        except DynctlError as err:
            return err

    def _finish_cut_short(self, agent: AgentClient, name: str) -> None:
        """The host operation a killed rollout left running goes on on the host: follow it to its end first; one
        it left prepared, waiting for a go that will not come, is taken back (it changed nothing)."""
        holder = agent.call("op_current")["holder"]
        if not holder:
            return
        sink = _prefixed(name, self.on_event)
        op_id = holder.get("op") or operations.LATEST
        if holder.get("op") and not agent.call("op_cancel", op_id=op_id)["go"]:
            sink(events.Note(f"the {holder.get('operation')} that a cut-short rollout prepared never had its go: "
                             "taken back, nothing was changed"))
            with contextlib.suppress(DynctlError):  # its final word: not started
                operations.conclude(agent, "operation", operations.follow(agent, op_id))
            return
        sink(events.Note(f"the {holder.get('operation')} that a cut-short rollout started still runs: following it"))
        try:
            operations.conclude(agent, "operation", operations.follow(agent, op_id), sink)
        except DynctlError as err:
            sink(events.Warning(f"it ended without success ({err}); the host is planned again"))

    # ---------------------------------------------------------------- the rollout

    def run(self, yes_to_canary: Callable[[str], bool]) -> tuple[Rollout, list[HostResult]]:
        """Roll every host that needs it; `yes_to_canary` is asked after the canary hosts, and a False stops the
        rollout there (state "stopped"): the hosts after them stay untouched."""
        plans = self.preflight()
        target = str(self.target)
        record = unfinished(self.fleet.name)
        if record is not None and (record.action, record.target) != (self.action, target):
            self.on_event(events.Warning(f"rollout {record.id} ({record.action} {record.target}) was cut short; "
                                         "its hosts are put back in their gateways first"))
        middle = {h for h, st in (record.hosts.items() if record else ()) if st in MIDDLE}
        resumed = record is not None and (record.action, record.target) == (self.action, target)
        if not resumed:
            if record is not None:
                record.state = "failed"
                record.save()
            record = _new(self.fleet, self.action, target)
        elif record is not None:
            self.on_event(events.Note(f"resuming rollout {record.id}"))
        assert record is not None  # the unfinished one resumed, or a new one
        plans.sort(key=lambda p: p.member.host.name not in middle)  # the host in the middle first
        todo = [p for p in plans if self._needs_work(p, record, middle)]
        for p in plans:
            if p not in todo:
                self.results[p.member.host.name].outcome = "unchanged"
                self.results[p.member.host.name].detail = p.unchanged or "done by this rollout already"
                if record.hosts.get(p.member.host.name) != "done":
                    record.hosts[p.member.host.name] = "done"
        if not todo:
            record.state = "done"
            record.save()
            return record, list(self.results.values())
        names = ", ".join(p.member.host.name for p in todo)
        what = f"threshold {target}" if self.action == "deploy" else f"a rollback to {self.target or 'the previous release'}"
        via = ", ".join(g.url for g in self.fleet.gateways) or "no gateway (no drain)"
        self.confirm(f"Rolling {self.action} of {what} to {len(todo)} hosts of {self.fleet.name} ({names}), "
                     f"{self.max_unavailable} at a time, through {via}?")
        record.save()
        self.record = record
        self.on_event(events.Note(f"rollout {record.id}: {len(todo)} hosts, {self.max_unavailable} at a time"))
        batches: list[list[HostPlan]] = []
        rest = list(todo)
        if self.canary and len(rest) > self.canary:
            batches.append(rest[:self.canary])
            rest = rest[self.canary:]
        while rest:
            batches.append(rest[:self.max_unavailable])
            rest = rest[self.max_unavailable:]
        for i, batch in enumerate(batches):
            if i == 1 and self.canary:
                left = ", ".join(p.member.host.name for b in batches[1:] for p in b)
                done = ", ".join(p.member.host.name for p in batches[0])
                if not yes_to_canary(f"Canary hosts done ({done}); continue with {left}?"):
                    for p in (p for b in batches[1:] for p in b):
                        self.results[p.member.host.name].detail = "stopped at the canary pause"
                    self.on_event(events.Note(f"stopped at the canary pause: {done} done; {left} untouched"))
                    record.state = "stopped"
                    record.results = [asdict(r) for r in self.results.values()]
                    record.save()
                    return record, list(self.results.values())
                self.on_event(events.Note(f"canary hosts done ({done}): going on with {left}"))
            outcomes = fan_out(batch, lambda p: self._one(p, record, p.member.host.name in middle),
                               self.max_unavailable)
            if not all(outcomes):
                record.state = "failed"
                record.results = [asdict(r) for r in self.results.values()]
                record.save()
                return record, list(self.results.values())
        record.state = "done"
        record.results = [asdict(r) for r in self.results.values()]
        record.save()
        return record, list(self.results.values())

    def _needs_work(self, p: HostPlan, record: Rollout, middle: set[str]) -> bool:
        name = p.member.host.name
        if name in middle:
            return True
        if self.action == "deploy":
            return p.unchanged is None
        return record.hosts.get(name) != "done"

    def _one(self, p: HostPlan, record: Rollout, in_middle: bool) -> bool:
        host = p.member.host
        result = self.results[host.name]
        sink = _prefixed(host.name, self.on_event)
        url = host.gateway_url
        clients = [self.gateways[g.url] for g in p.member.gateways]
        t0 = time.monotonic()
        ok = True
        # a host cut short after its operation ended only needs to be back in its gateways
        operate = (p.unchanged is None if self.action == "deploy"
                   else not (in_middle and record.hosts.get(host.name) == "registering"))
        try:
            record.mark(host.name, "draining")
            t = time.monotonic()
            prepared = self._prepare(p, sink, len(clients)) if operate and clients else None
            try:
                for client in clients:
                    self._drain(client, url, p, sink)
            except BaseException:
                if prepared is not None:
                    prepared.cancel()
                raise
            result.drain_s = time.monotonic() - t
            record.mark(host.name, "running")
            t = time.monotonic()
            if operate:
                try:
                    outcome = self._operate(p, sink, prepared)
                    result.outcome = outcome
                except DynctlError as err:
                    ok = False
                    result.outcome, result.detail, result.exit_code = "failed", str(err), err.exit_code
            else:
                result.outcome, result.detail = "re-registered", p.unchanged or "its operation had ended"
            result.operation_s = time.monotonic() - t
        finally:
            record.mark(host.name, "registering")
            t = time.monotonic()
            try:
                for client in clients:
                    self._register(client, url, sink)
            except DynctlError as err:
                ok = False
                result.outcome = "failed"
                result.detail = (result.detail + "; " if result.detail else "") + str(err)
                result.exit_code = result.exit_code or err.exit_code
            result.register_s = time.monotonic() - t
            result.elapsed_s = time.monotonic() - t0
            record.mark(host.name, "done" if ok else "failed")
        return ok

    def _drain(self, client: GatewayClient, url: str, p: HostPlan, sink: events.EventSink) -> None:
        worker = client.find(url)
        if worker is None:
            sink(events.Note(f"not registered in {client.gateway.url}: nothing to drain there"))
            return
        t = time.monotonic()
        sink(events.StepStarted("drain", f"out of {client.gateway.url} (up to {self.drain:g} s for its requests)"))
        client.set_drain(worker, self.drain)
        client.remove(worker)
        load = client.wait_gone(url, time.monotonic() + self.drain + 30)
        if load:  # requests were still streaming when the gateway let go of it: let the server finish them
            self._wait_idle(p, time.monotonic() + self.drain)
        sink(events.StepDone("drain", time.monotonic() - t, f"removed from {client.gateway.url}"
                             + (f", {load} requests were still finishing" if load else "")))

    def _wait_idle(self, p: HostPlan, deadline: float) -> None:
        """Until the server itself runs and queues nothing (requests the gateway had sent before)."""
        from dynctl.live.server_status import sample_server

        while time.monotonic() < deadline:
            snap = sample_server(p.agent, p.member.host.simulated)
            if snap.state != "ready" or ((snap.running_reqs or 0) + (snap.queue_reqs or 0)) == 0:
                return
            time.sleep(0.05)  # a sample is itself a round trip

    def _prepare(self, p: HostPlan, sink: events.EventSink, gateways: int) -> operations.Prepared | None:
        """The host's deploy, started while the gateways drain it: checked and validated there, changing nothing
        until the go after the drain (and ending by itself, not started, if that go never comes)."""
        if self.action != "deploy" or p.plan is None:
            return None
        # the longest the drains may take (each: the gateway's settle time, then the server's own requests)
        go_within = gateways * (2 * self.drain + 30) + GO_SLACK_S
        return core.prepare(p.agent, p.plan, go_within, sink, grace=self.grace, ready_timeout=self.ready_timeout,
                            soak=self.soak)

    def _operate(self, p: HostPlan, sink: events.EventSink, prepared: operations.Prepared | None = None) -> str:
        if prepared is not None:
            prepared.go()
            return "deployed"
        if self.action == "deploy":
            assert p.plan is not None
            core.deploy(p.agent, p.plan, sink, grace=self.grace, ready_timeout=self.ready_timeout, soak=self.soak)
            return "deployed"
        core.rollback(p.agent, p.member.host, self.target, sink, grace=self.grace, ready_timeout=self.ready_timeout,
                      soak=self.soak)
        return "rolled back"

    def _register(self, client: GatewayClient, url: str, sink: events.EventSink) -> None:
        t = time.monotonic()
        if client.find(url) is None:
            client.add(url)
        client.wait_ready(url, time.monotonic() + REGISTER_TIMEOUT_S)
        routed = client.probe(url)
        seen = "served by it" if routed == url else f"served by {routed}" if routed else "answered"
        sink(events.StepDone("gateway", time.monotonic() - t, f"ready in {client.gateway.url}; a request through "
                                                              f"it {seen}"))

    def close(self) -> None:
        for client in self.gateways.values():
            client.close()


def exit_code(results: list[HostResult], state: str = "done") -> int:
    """0 when every host is done; 1 when one failed, or the rollout stopped at the canary pause after changing
    the canary hosts (never 3: those hosts did change)."""
    failed = [r for r in results if r.outcome == "failed"]
    return 1 if failed or state == "stopped" else 0


__all__ = ["DEFAULT_DRAIN_S", "HostResult", "Rollout", "RollingOperation", "exit_code", "list_rollouts",
           "rollouts_dir", "unfinished", "OperationFailed"]
