"""The TUI's keys wired to the core: the same deploy, rollback, lifecycle and bench the CLI runs (UI-free)."""

from __future__ import annotations

from typing import Any

from dynctl import deploy as core
from dynctl import lifecycle
from dynctl.agent import AgentClient
from dynctl.config import Config, HostConfig
from dynctl.transport import connect

OnEvent = Any


class CoreActions:
    """HostActions (dynctl.tui.actions) for one configured host."""

    def __init__(self, config: Config, host: HostConfig, grace: float = 60.0, ready_timeout: float = 900.0) -> None:
        self.config = config
        self.host = host
        self.grace = grace
        self.ready_timeout = ready_timeout

    def _agent(self) -> AgentClient:
        return AgentClient(connect(self.host, self.config), self.host)

    def deploy(self, threshold: int, on_event: OnEvent) -> Any:
        agent = self._agent()
        plan = core.plan_deploy(agent, self.host, threshold)
        if plan.noop:
            on_event({"type": "final", "final": True, "ok": True, "text": plan.noop})
            return {"noop": plan.noop}
        for warning in plan.warnings:
            on_event({"type": "warning", "text": warning})
        return core.deploy(agent, plan, on_event, grace=self.grace, ready_timeout=self.ready_timeout)

    def rollback(self, on_event: OnEvent) -> Any:
        return core.rollback(self._agent(), self.host, None, on_event, grace=self.grace,
                             ready_timeout=self.ready_timeout)

    def set_threshold(self, n: int) -> int:
        return core.set_threshold(self._agent(), n)["in_force"]

    def stop(self, on_event: OnEvent) -> Any:
        return lifecycle.stop_server(self._agent(), self.grace, on_event=on_event)

    def start(self, on_event: OnEvent) -> Any:
        agent = self._agent()
        lifecycle.start_server(agent, None, on_event=on_event, baseline_argv=lifecycle.server_argv(self.host))
        return lifecycle.wait_ready(agent, self.ready_timeout, on_event=on_event)

    def restart(self, on_event: OnEvent) -> Any:
        return lifecycle.restart_server(self._agent(), grace=self.grace, ready_timeout=self.ready_timeout,
                                        on_event=on_event, baseline_argv=lifecycle.server_argv(self.host))

    def bench(self, on_event: OnEvent) -> Any:
        """A short sweep of the deployed mode (1..64 streams, 10 s a level); `dynctl bench` has the options."""
        from dynctl.bench.plan import BenchPlan
        from dynctl.bench.runner import run_bench

        plan = BenchPlan(concurrency=(1, 2, 4, 8, 16, 32, 64), duration=10.0, input_len=256, output_len=128)
        return run_bench(self._agent(), self.host.name, plan, lambda e: _relay_bench(e, on_event),
                         simulated=self.host.simulated)


def _relay_bench(event: Any, on_event: OnEvent) -> None:
    """Bench progress as one line per level for the actions panel (ticks are too many to show)."""
    from dynctl.bench import events as bench

    if isinstance(event, bench.LevelStarted):
        on_event({"type": "step_started", "step": f"{event.mode.name} c={event.concurrency}",
                  "detail": f"level {event.index}/{event.total}"})
    elif isinstance(event, bench.LevelDone):
        lvl, server = event.level, event.level.get("server") or {}
        share = server.get("spec_on_share")
        spec = "" if share is None else f", speculation {share:.0%} of steps"
        on_event({"type": "info", "text": f"{event.mode.name} c={lvl['max_concurrency']}: "
                                          f"{lvl['output_throughput']:.0f} tok/s, TTFT p50 "
                                          f"{lvl.get('median_ttft_ms') or 0:.0f} ms, batch "
                                          f"{server.get('mean_batch_size') or 0:.1f}{spec}"})
    elif isinstance(event, bench.BenchWarning):
        on_event({"type": "warning", "text": event.message})
    elif isinstance(event, bench.ThresholdRestored):
        on_event({"type": "info", "text": f"threshold {event.threshold} put back"})


def actions_for(config: Config, hosts: list[HostConfig]):
    """The ActionsFactory the TUI takes: host name → CoreActions."""
    by_name = {h.name: h for h in hosts}

    def factory(name: str) -> CoreActions:
        return CoreActions(config, by_name[name])

    return factory
