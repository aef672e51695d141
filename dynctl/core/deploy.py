"""Deploy, rollback and the live threshold: plan here, run the critical sequence on the host (UI-free).

`deploy_threshold`, `rollback` and `set_threshold` are the commands as an operator asks for them, decisions
included (warnings, nothing to do, what to confirm): the CLI and the TUI's keys both call them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dynctl.base import events, sglang
from dynctl.core import adoption, operations
from dynctl.agent.client import AgentClient
from dynctl.base.config import HostConfig
from dynctl.base.errors import PreflightError
from dynctl.core.lifecycle import (
    Adopt, Confirm, find_server, live_threshold, never_adopt, operator_server, proceed, server_argv, takeover,
)
from dynctl.core.native import plan_native
from dynctl.patching import parse_threshold, plan_patch, strategy_for
from dynctl.patching.host import patch_state_from, plan_for_apply, read_patch_state
from dynctl.patching.recipe import target_files
from dynctl.patching.versions import unmeasured_note

THRESHOLD_FLAG = sglang.THRESHOLD_FLAG
BASELINE = "baseline"  # the rollback target that means: no release, the configured launch argv
ADAPTIVE_CONFIG = "adaptive.json"
# After the health gate the new server is watched this long; dying in that time rolls the deploy back.
DEFAULT_SOAK_S = 5.0
MAX_SOAK_S = 3600.0  # the host lock is held for the soak: an hour is the most a deploy may keep it for that


@dataclass
class DeployPlan:
    host: HostConfig
    sglang_version: str
    strategy: str  # patch | native
    threshold: int
    files: list[dict[str, Any]]
    diff: str
    launch_argv: list[str]
    baseline_argv: list[str]
    artifacts: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    patch_detail: str = ""
    noop: str | None = None  # why nothing needs doing, when that is so
    # the operator's server on the port, not started by dynctl: {"pid", "start", "cmdline", "argv_diff", ...}
    operator: dict[str, Any] | None = None
    adopt: dict[str, Any] | None = None  # the operator's word to take it over, pinned: {"pid", "start"}
    # what the server will enforce, when that differs from `threshold` (native: sglang's CUDA-graph padding)
    effective_threshold: int | None = None

    @property
    def threshold_in_effect(self) -> int:
        return self.threshold if self.effective_threshold is None else self.effective_threshold

    def to_json(self) -> dict[str, Any]:
        operator = None
        if self.operator:
            operator = {"pid": self.operator["pid"], "started_by_dynctl": False, "cmdline": self.operator["cmdline"],
                        "argv_diff": self.operator.get("argv_diff"), "owner": self.operator.get("owner"),
                        "adoptable": self.operator.get("adoptable")}
        return {
            "host": self.host.name, "sglang_version": self.sglang_version, "strategy": self.strategy,
            "threshold": self.threshold, "effective_threshold": self.threshold_in_effect,
            "files": [f["path"] for f in self.files], "launch_argv": self.launch_argv,
            "artifacts": self.artifacts, "warnings": self.warnings, "patch": self.patch_detail, "noop": self.noop,
            "operator_server": operator,
        }

    def operator_line(self) -> str | None:
        """The operator's server in words, for the plan and the dry run; None when there is none."""
        op = self.operator
        if not op:
            return None
        cmdline = events.one_line(sglang.redact_argv(op.get("cmdline")), 300)
        return (f"pid {op['pid']} on the port was not started by dynctl: {cmdline}; argv "
                f"against the launch argv below: {op.get('argv_diff') or '?'}")


def plan_deploy(agent: AgentClient, host: HostConfig, threshold: Any, use_config_args: bool = False) -> DeployPlan:
    """Inspect the host and work out what deploying `threshold` means there; changes nothing.

    The launch builds on the operator's own (the server being taken over, else the adopted baseline) with
    dynctl's flags set; the configured launch and `args` replace it only with `use_config_args`."""
    threshold = parse_threshold(threshold)
    baseline = server_argv(host)
    context = agent.call("deploy_context", files=target_files())  # one round trip for the whole plan
    base = None if use_config_args else adoption.launch_base(context)

    def launch(extra: list[str]) -> list[str]:
        return server_argv(host, extra) if base is None else adoption.adopted_launch(base[0], extra)
    _refuse_busy(agent, context["holder"])
    state = patch_state_from(context["patch"], host.strategy)
    if state.version is None:
        raise PreflightError(f"{host.name}: sglang is not installed for {state.python}; nothing to deploy to")
    # refuses unsupported versions, and a `strategy` key the release cannot take (exit 3)
    strategy = strategy_for(state.version, host.strategy)
    if strategy == "patch":
        plan = plan_for_apply(state, host.name)
        if plan.status == "applied":
            files: list[dict[str, Any]] = []
        else:
            files = plan.files_for_agent()
        argv = launch([THRESHOLD_FLAG, str(threshold)])
        dplan = DeployPlan(host, state.version, strategy, threshold, files, plan.diff(), argv, baseline,
                           patch_detail=plan.message)
        if (note := unmeasured_note(state.version)) is not None:
            dplan.warnings.append(note)
    else:
        args = _speculation_args(host, context, base)
        native = plan_native(threshold, args=args, config_path="{release_dir}/" + ADAPTIVE_CONFIG)
        artifacts = {ADAPTIVE_CONFIG: native.config_json} if native.config_json else {}
        argv = launch(list(native.argv))
        diff = "" if not artifacts else f"--- /dev/null\n+++ b/{ADAPTIVE_CONFIG}\n" + "".join(
            f"+{line}\n" for line in native.config_json.splitlines())
        dplan = DeployPlan(host, state.version, strategy, threshold, [], diff, argv, baseline, artifacts,
                           list(native.warnings), patch_detail=state.detail,
                           effective_threshold=native.effective_threshold)
    dplan.noop = _already_deployed(dplan, state.release, context["info"])
    if base is not None:
        dplan.warnings.append(f"the launch argv builds on {base[1]}, keeping its own flags; --use-config-args "
                              f"launches the configured args instead")
    operator = context.get("operator")
    if operator:
        dplan.operator = dict(operator, argv_diff=sglang.argv_diff(operator.get("cmdline") or [], argv))
        how = ("the deploy takes it over only on the operator's word (the takeover prompt, or --adopt)"
               if operator.get("adoptable") else f"it runs as {operator.get('owner')}, so dynctl never takes it over")
        dplan.warnings.append(f"{dplan.operator_line()}: {how}")
    elif context.get("not_ours") and not dplan.noop:
        dplan.warnings.append(f"{context['not_ours']}: the deploy will be refused (exit 3) while it is there")
    return dplan


def _speculation_args(host: HostConfig, context: dict[str, Any], base: tuple[list[str], str] | None) -> list[str]:
    """The launch flags the native planner reads (steps, topk, algorithm): the base launch's, with the `--config`
    YAML it names merged in on the host as sglang merges it; a file that cannot be read is named (exit 3)."""
    which = "configured" if base is None else ("operator" if context.get("operator") else "adopted")
    args = list(host.args) if base is None else adoption.without_own_flags(base[0])
    found = (context.get("config_files") or {}).get(which)
    if found is None:
        return args
    if "error" in found:
        raise PreflightError(f"{host.name}: the launch's --config cannot be read on the host ({found['error']}); "
                             f"its speculation settings decide the adaptive config; nothing was changed")
    return adoption.without_own_flags(found["argv"])


def refuse_if_busy(agent: AgentClient) -> None:
    _refuse_busy(agent, agent.call("op_current")["holder"])


def _refuse_busy(agent: AgentClient, holder: dict[str, Any] | None) -> None:
    """One operation per host: name the one that runs instead of planning against its half-done work."""
    if holder:
        raise PreflightError(
            f"{agent.host.name}: host is busy: {holder.get('operation')} by {holder.get('who')} "
            f"(from {holder.get('client_host')}, worker pid {holder.get('pid')}) since {holder.get('started')}; "
            f"nothing was changed")


def _already_deployed(dplan: DeployPlan, release: dict[str, Any] | None, info: dict[str, Any] | None) -> str | None:
    if dplan.files or not release:
        return None
    if release.get("threshold") != dplan.threshold or release.get("strategy") != dplan.strategy:
        return None
    # native argv name a file inside the release directory, so only the patch argv compare as text
    if dplan.strategy == "patch" and release.get("launch_argv") != dplan.launch_argv:
        return None
    if info is None:
        return None
    if dplan.strategy == "patch":
        if sglang.threshold_in_force(info) != dplan.threshold:
            return None
    return (f"release {release.get('id')} with threshold {dplan.threshold} is already in force and the server "
            f"is serving; nothing to do")


@dataclass
class DeployOutcome:
    plan: DeployPlan
    result: dict[str, Any] | None = None  # the host's final word; None when nothing ran (a no-op, a dry run)


def deploy_threshold(agent: AgentClient, host: HostConfig, threshold: Any, on_event: events.EventSink = events.ignore,
                     confirm: Confirm = proceed, *, dry_run: bool = False, grace: float = 60.0,
                     ready_timeout: float = 900.0, soak: float = DEFAULT_SOAK_S,
                     adopt: Adopt = never_adopt, use_config_args: bool = False) -> DeployOutcome:
    """`dynctl deploy` and the TUI's `d`: plan, warn, stop at a dry run or at nothing to do, confirm, deploy.

    The operator's server on the port (not started by dynctl) is taken over only on the operator's word for
    it (`adopt`); without it the deploy is refused before anything changes (exit 3)."""
    plan = plan_deploy(agent, host, threshold, use_config_args)
    for warning in plan.warnings:
        on_event(events.Warning(warning))
    if dry_run:
        return DeployOutcome(plan)
    if plan.noop:
        on_event(events.Unchanged("deploy", plan.noop))
        return DeployOutcome(plan)
    plan.adopt = takeover(host.name, "deploy", plan.operator, adopt)
    running = (f", taking over pid {plan.operator['pid']} (not started by dynctl) and restarting it with the launch "
               f"argv above" if plan.adopt else ", restarting its server")
    confirm(f"Deploy threshold {plan.threshold} to {host.name} ({host.route}){running}?")
    return DeployOutcome(plan, deploy(agent, plan, on_event, grace=grace, ready_timeout=ready_timeout, soak=soak))


def deploy(agent: AgentClient, dplan: DeployPlan, on_event: events.EventSink = events.ignore,
           grace: float = 60.0, ready_timeout: float = 900.0, soak: float = DEFAULT_SOAK_S,
           staged: str | None = None) -> dict[str, Any]:
    """Run a plan on the host as one operation: validate, back up, switch, restart, verify, soak.

    staged: what the host's `deploy_stage` answered for this plan; its validation stands in for the deploy's
    own py_compile while the host's record of it still matches the files and the interpreter."""
    params = _deploy_params(dplan, grace, ready_timeout, soak)
    if staged:
        params["staged"] = staged
    return operations.execute(agent, "deploy", params, on_event)


def prepare(agent: AgentClient, dplan: DeployPlan, go_within: float, on_event: events.EventSink = events.ignore,
            grace: float = 60.0, ready_timeout: float = 900.0, soak: float = DEFAULT_SOAK_S) -> operations.Prepared:
    """Start the plan's deploy prepared: the host checks and validates it now, changing nothing, and switches
    only on the handle's `go()` (then the deploy runs as `deploy` does); without a go within `go_within`
    seconds, or after `cancel()`, it ends not started."""
    return operations.Prepared(agent, "deploy", _deploy_params(dplan, grace, ready_timeout, soak), go_within,
                               on_event)


def _deploy_params(dplan: DeployPlan, grace: float, ready_timeout: float, soak: float) -> dict[str, Any]:
    params = {
        "files": dplan.files, "sglang_version": dplan.sglang_version, "strategy": dplan.strategy,
        "threshold": dplan.threshold, "launch_argv": dplan.launch_argv, "baseline_argv": dplan.baseline_argv,
        "artifacts": dplan.artifacts, "effective_threshold": dplan.effective_threshold, "grace": grace,
        "ready_timeout": ready_timeout, "soak": soak,
    }
    if dplan.adopt is not None:
        params["adopt"] = dplan.adopt
    return params


def rollback(agent: AgentClient, host: HostConfig, to: str | None = None,
             on_event: events.EventSink = events.ignore, grace: float = 60.0,
             ready_timeout: float = 900.0, soak: float = DEFAULT_SOAK_S, confirm: Confirm = proceed,
             adopt: Adopt = never_adopt) -> dict[str, Any]:
    """`dynctl rollback` and the TUI's `r`: back to `to` (default: the previous release), restarted with the
    launch argv recorded in it (baseline: the adopted launch, else the configured one). The operator's server
    on the port is taken over only on the operator's word (`adopt`)."""
    refuse_if_busy(agent)
    state = find_server(agent)
    pinned = takeover(host.name, "rollback", operator_server(state.not_ours) if state.pid is None else None, adopt)
    running = f", taking over pid {pinned['pid']} (not started by dynctl)" if pinned else ", restarting its server"
    current = (state.in_force or {}).get("release")
    since = f" from release {current}" if current else " (no release is in force)"
    target = ("baseline (the adopted launch, else the configured one; no release)" if to == BASELINE
              else f"release {to}" if to else "the release before it")
    confirm(f"Roll {host.name} back{since} to {target}{running}?")
    params = {"baseline_argv": server_argv(host), "to": to, "grace": grace, "ready_timeout": ready_timeout,
              "soak": soak}
    if pinned is not None:
        params["adopt"] = pinned
    return operations.execute(agent, "rollback", params, on_event)


def set_threshold(agent: AgentClient, threshold: Any, on_event: events.EventSink = events.ignore,
                  confirm: Confirm = proceed) -> dict[str, Any]:
    """Change the threshold without a restart, then report the value actually in force."""
    value = parse_threshold(threshold)
    name = agent.host.name
    current = live_threshold(agent)
    now = f"from {current} " if current is not None else "(the server reports none now) "
    confirm(f"Set the live threshold of {name} {now}to {value}, without a restart (a restart goes back to the "
            f"release's value unless --keep-live-threshold)?")
    state = read_patch_state(agent)
    if state.strategy == "native":
        raise PreflightError(
            f"{name}: sglang {state.version} uses native adaptive speculation, whose config is fixed at "
            f"launch; a restart is needed: run `dynctl deploy --threshold {value}`")
    if state.status != "applied":
        raise PreflightError(f"{name}: the patch is not in force ({state.detail}); "
                             f"run `dynctl deploy --threshold {value}` first")
    answer = agent.call("set_threshold", threshold=value)  # raises unless every scheduler reads back `value`
    on_event(events.Finished("threshold", f"threshold {answer['threshold']} in force",
                             f"on {name} (read back from /server_info)"))
    return {"requested": value, "in_force": answer["threshold"]}


def list_releases(agent: AgentClient) -> list[dict[str, Any]]:
    return agent.call("releases")["releases"]


__all__ = ["DeployOutcome", "DeployPlan", "deploy", "deploy_threshold", "list_releases", "plan_deploy", "plan_patch",
           "prepare", "rollback", "set_threshold"]
