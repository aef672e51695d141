"""The patch on a real host: read its files through the agent, plan, apply, revert."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dynctl.agent.client import AgentClient
from dynctl.base.errors import PreflightError
from dynctl.patching.engine import PatchRefused, Plan, plan_patch
from dynctl.patching.recipe import target_files
from dynctl.patching.versions import SUPPORTED, strategy_for, strategy_note


@dataclass
class PatchState:
    """What `dynctl patch status` shows: the sglang found, its strategy, and where the patch stands."""

    python: str
    version: str | None
    package_dir: str | None
    strategy: str  # patch | native | unsupported
    status: str  # not applied | applied | modified | refused | native | unsupported
    detail: str
    plan: Plan | None = None
    current: str | None = None
    release: dict[str, Any] | None = None
    incomplete: list[str] = field(default_factory=list)
    files: dict[str, Any] = field(default_factory=dict)

    @property
    def applied(self) -> bool:
        """The patch is in place, intact: applying it again changes nothing."""
        return self.plan is not None and self.plan.status == "applied"

    def to_json(self) -> dict[str, Any]:
        return {
            "python": self.python, "sglang_version": self.version, "package_dir": self.package_dir,
            "strategy": self.strategy, "status": self.status, "detail": self.detail,
            "files": self.files, "current_release": self.current, "release": self.release,
            "incomplete_releases": self.incomplete, "supported": SUPPORTED,
            "changes": [{"path": c.path, "sha256_before": c.sha256_before, "sha256_after": c.sha256_after}
                        for c in (self.plan.changes if self.plan else ())],
        }


def read_patch_state(agent: AgentClient) -> PatchState:
    """One agent round trip, then the pure planner; never raises for a refused or unsupported patch."""
    return patch_state_from(agent.call("patch_read", files=target_files()), agent.host.strategy)


def patch_state_from(answer: dict[str, Any], preference: str = "auto") -> PatchState:
    """The pure part of read_patch_state, for callers that fetched `patch_read`'s answer themselves;
    `preference` is the host's `strategy` key."""
    sglang = answer["sglang"]
    version = sglang.get("version")
    files = {path: (None if info is None else {"sha256": info.get("sha256"), "symlink": info.get("symlink")})
             for path, info in answer["files"].items()}
    state = PatchState(python=answer["python"], version=version, package_dir=sglang.get("package_dir"),
                       strategy="unsupported", status="unsupported", detail="", current=answer.get("current"),
                       release=answer.get("release"), incomplete=list(answer.get("incomplete") or []), files=files)
    try:
        state.strategy = strategy_for(version or "unknown", preference)
    except PreflightError as err:
        state.detail = str(err)
        return state
    if state.strategy == "native":
        state.status = "native"
        note = strategy_note(version, "native")
        state.detail = (f"sglang {version} has adaptive speculation: no file is patched, "
                        f"the threshold is a launch config"
                        + (' (strategy = "native")' if preference == "native" else "")
                        + (f"; {note}" if note else ""))
        return state
    originals = {path: (info or {}).get("text") for path, info in answer["files"].items()}
    release = answer.get("release") or {}
    expected = {f["path"]: f["sha256_after"] for f in release.get("files") or []}
    try:
        state.plan = plan_patch(version, originals, record=answer.get("record"), expected=expected)
    except PatchRefused as err:
        state.status = "modified" if "patched but modified" in str(err) else "refused"
        state.detail = str(err)
        return state
    if state.plan.status == "applied":
        state.status, state.detail = "applied", state.plan.message
    else:
        state.status, state.detail = "not applied", state.plan.message
    return state


def interrupted_release_message(release: str) -> str:
    """The same words as the agent's: `rollback` recovers an interrupted release by itself."""
    return (f"release {release} was interrupted mid-switch: `dynctl rollback` reverts it and restarts what ran "
            f"before it (`dynctl patch revert --release {release}` reverts the files alone); nothing was changed")


def plan_for_apply(state: PatchState, host: str | None = None) -> Plan:
    """The plan to apply, or the reason there is none, as an error (naming `host`) with the right exit code."""
    where = f"{host}: " if host else ""
    if state.strategy == "unsupported":
        raise PreflightError(where + state.detail)
    if state.strategy == "native":
        raise PreflightError(f"{where}sglang {state.version} uses the native strategy: there is no file to patch "
                             f"(dynctl deploy passes the adaptive config at launch)")
    if state.incomplete:
        raise PreflightError(where + interrupted_release_message(state.incomplete[0]))
    if state.plan is None:
        raise PatchRefused(where + state.detail)
    return state.plan


def apply_plan(agent: AgentClient, plan: Plan, threshold: int | None = None,
               launch_argv: list[str] | None = None) -> dict[str, Any]:
    """Swap the planned files in on the host as one release; nothing to do when already applied."""
    if plan.status == "applied":
        return {"release": None, "already": True, "detail": plan.message}
    return agent.call("patch_apply", files=plan.files_for_agent(), sglang_version=plan.version,
                      strategy="patch", threshold=threshold, launch_argv=launch_argv)


def revert(agent: AgentClient, release: str | None = None, every: bool = False) -> dict[str, Any]:
    return agent.call("patch_revert", release=release, all=every)
