"""The TUI's keys bound to one configured host: the same core commands the CLI runs, nothing decided here (UI-free).

The TUI asks its own questions (dialogs) before it calls, so the commands run with `lifecycle.proceed`; a deploy
asks the TUI's `confirm` itself, once it has planned, so the dialog can show the plan's warnings.
"""

from __future__ import annotations

from typing import Any

from dynctl.core import deploy as core
from dynctl.core import lifecycle
from dynctl.agent.client import AgentClient, open_agent
from dynctl.base.config import Config, HostConfig
from dynctl.base.events import EventSink


class CoreActions:
    """HostActions (dynctl.tui.actions) for one configured host."""

    def __init__(self, config: Config, host: HostConfig, grace: float = 60.0, ready_timeout: float = 900.0) -> None:
        self.config = config
        self.host = host
        self.grace = grace
        self.ready_timeout = ready_timeout

    def _agent(self) -> AgentClient:
        return open_agent(self.host, self.config)

    def deploy(self, threshold: int, on_event: EventSink, confirm: lifecycle.Confirm) -> Any:
        return core.deploy_threshold(self._agent(), self.host, threshold, on_event, confirm, grace=self.grace,
                                     ready_timeout=self.ready_timeout)

    def rollback(self, on_event: EventSink) -> Any:
        return core.rollback(self._agent(), self.host, None, on_event, grace=self.grace,
                             ready_timeout=self.ready_timeout)

    def set_threshold(self, n: int, on_event: EventSink) -> Any:
        return core.set_threshold(self._agent(), n, on_event)

    def stop(self, on_event: EventSink) -> Any:
        return lifecycle.stop(self._agent(), self.grace, on_event)

    def start(self, on_event: EventSink) -> Any:
        return lifecycle.start(self._agent(), self.host, self.ready_timeout, on_event)

    def restart(self, on_event: EventSink) -> Any:
        return lifecycle.restart(self._agent(), self.host, self.grace, self.ready_timeout, on_event)

    def bench(self, on_event: EventSink) -> Any:
        """A short sweep of the deployed mode (1..64 streams, 10 s a level); `dynctl bench` has the options."""
        from dynctl.bench.plan import BenchPlan
        from dynctl.bench.runner import run_bench

        plan = BenchPlan(concurrency=(1, 2, 4, 8, 16, 32, 64), duration=10.0, input_len=256, output_len=128)
        return run_bench(self._agent(), self.host.name, plan, on_event, simulated=self.host.simulated)


def actions_for(config: Config, hosts: list[HostConfig]):
    """The ActionsFactory the TUI takes: host name → CoreActions."""
    by_name = {h.name: h for h in hosts}

    def factory(name: str) -> CoreActions:
        return CoreActions(config, by_name[name])

    return factory
