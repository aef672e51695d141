"""Putting the server into a bench mode: a live threshold change where the patch allows it, else a redeploy."""

from __future__ import annotations

from typing import Any, Protocol

from dynctl.base import sglang
from dynctl.agent.client import AgentClient, AgentError
from dynctl.bench.plan import Mode
from dynctl.base.errors import OperationFailed, PreflightError, UsageError


class Redeployer(Protocol):
    def redeploy(self, threshold: int) -> int:
        """Restart the server with `threshold` in force; return the threshold read back from it."""
        ...


class DeployRedeployer:
    """Switches modes where the threshold cannot change live: a full `dynctl deploy` of each threshold."""

    def __init__(self, agent: AgentClient, host: Any, confirm: Any = None, on_event: Any = None) -> None:
        self.agent = agent
        self.host = host
        self.confirm = confirm  # asked once, before the first restart
        self.on_event = on_event
        self.start_release: str | None = None  # what ran before the first redeploy, to go back to

    def restore(self) -> int | None:
        """Roll the host back to the release that was in force before the bench; the threshold read back."""
        from dynctl.base import events
        from dynctl.core import deploy

        if self.start_release is None:
            return None
        deploy.rollback(self.agent, self.host, to=self.start_release, on_event=self.on_event or events.ignore)
        info = self.agent.call("server_info")["info"] or {}
        return sglang.threshold_in_force(info)

    def redeploy(self, threshold: int) -> int:
        from dynctl.base import events
        from dynctl.core import deploy

        if self.confirm is not None:
            self.confirm()
            self.confirm = None
        if self.start_release is None:
            self.start_release = self.agent.call("releases")["current"] or deploy.BASELINE
        done = deploy.deploy_threshold(self.agent, self.host, threshold, self.on_event or events.ignore)
        return done.plan.threshold_in_effect if done.result is None else int(done.result["threshold_in_force"])


class ModeSwitcher:
    """Sets modes on one server and remembers what to restore."""

    def __init__(self, agent: AgentClient, host: str, probe: dict[str, Any], redeployer: Redeployer | None) -> None:
        self.agent = agent
        self.host = host
        self.probe = probe
        self.redeployer = redeployer
        self.original: int | None = probe.get("threshold")
        self.changed = False

    def check(self, modes: tuple[Mode, ...]) -> None:
        """Refuse before measuring anything when a mode cannot be reached on this server."""
        if all(m.threshold is None for m in modes):
            return
        if not self.probe.get("speculative_algorithm"):
            raise PreflightError(
                f"{self.host}: the server runs without speculative decoding (speculative_algorithm is not set), "
                "so there is no speculation mode to compare; launch it with --speculative-algorithm"
            )
        if self.redeployer is None and not self.probe.get("threshold_live"):
            raise self._cannot_redeploy()

    def enter(self, mode: Mode) -> int | None:
        if mode.threshold is None:
            return self.probe.get("threshold")
        if not self.probe.get("threshold_live"):
            in_force = self._redeploy(mode.threshold)
        else:
            in_force = self._set(mode.threshold)
        self.changed = True
        if in_force != mode.threshold:
            raise OperationFailed(f"{self.host}: asked for threshold {mode.threshold}, the server has {in_force}")
        return in_force

    def restore(self) -> int | None:
        """Put back the threshold found at the start; None when nothing had changed."""
        if not self.changed:
            return None
        back = getattr(self.redeployer, "restore", None)
        if not self.probe.get("threshold_live") and back is not None:
            self.changed = False
            return back()  # the release that ran before the bench, whatever its threshold
        if self.original is None:
            return None
        if self.probe.get("threshold_live"):
            in_force = self._set(int(self.original))
        else:
            in_force = self._redeploy(int(self.original))
        self.changed = False
        return in_force

    def _redeploy(self, threshold: int) -> int:
        if self.redeployer is None:
            raise self._cannot_redeploy()
        return self.redeployer.redeploy(threshold)

    def _cannot_redeploy(self) -> PreflightError:
        return PreflightError(
            f"{self.host}: the server's speculation threshold cannot change live (it is not patched, or its "
            f"sglang version has no live switch), and this run does not redeploy; `dynctl bench --compare` "
            f"redeploys for each mode (asking first), or run `dynctl deploy --threshold N --host {self.host}`")

    def _set(self, threshold: int) -> int:
        try:
            answer = self.agent.call("set_threshold", threshold=threshold)
        except AgentError as err:
            if err.answer.get("not_ours"):  # a listener that is not our server: neither switched nor redeployed
                raise PreflightError(str(err)) from None
            if err.kind == "preflight":
                return self._redeploy(threshold)
            if err.kind == "usage":
                raise UsageError(str(err)) from None
            raise
        return int(answer["threshold"])
