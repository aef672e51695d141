"""`dynctl patch status|diff|apply|revert`: the patch alone, without touching the server process."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.markup import escape

from dynctl.base import sglang
from dynctl.cli.common import ConfigOpt, HostOpt, JsonOpt, YesOpt, confirm, console, handle_errors, open_host
from dynctl.patching import parse_threshold
from dynctl.patching.host import PatchState, apply_plan, plan_for_apply, read_patch_state, revert

app = typer.Typer(help="The speculation patch alone, without touching the server process.", no_args_is_help=True)

_STATUS_STYLE = {"applied": "green", "not applied": "yellow", "native": "cyan",
                 "modified": "red", "refused": "red", "unsupported": "red"}


def _print_json(obj: Any) -> None:
    console.print_json(json.dumps(sglang.redact(obj), default=str))


def _show_state(name: str, state: PatchState) -> None:
    style = _STATUS_STYLE.get(state.status, "white")
    where = escape(state.package_dir or "?")
    console.print(f"[bold]{escape(name)}[/]  sglang {escape(state.version or '?')} at {where}")
    console.print(f"  python    {escape(state.python)}")
    console.print(f"  strategy  {state.strategy}")
    console.print(f"  patch     [{style}]{state.status}[/]: {escape(state.detail)}")
    for path, info in sorted(state.files.items()):
        if info is None:
            console.print(f"    {path:45} absent")
        else:
            link = f"  (symlink: {escape(info['symlink'])})" if info.get("symlink") else ""
            console.print(f"    {path:45} {(info.get('sha256') or '-')[:16]}{link}")
    console.print(f"  release   {state.current or 'none in force'}")
    if state.incomplete:
        console.print(f"  [red]interrupted release {', '.join(state.incomplete)}[/]: `dynctl rollback` reverts it "
                      f"and restarts what ran before it (`dynctl patch revert --release {state.incomplete[0]}` "
                      f"reverts the files alone)")


@app.command("status")
@handle_errors
def status(host: str = HostOpt, config: str = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """sglang on the host, its strategy, and whether the patch is applied and intact (sha256)."""
    session = open_host(host, config)
    state = read_patch_state(session.agent)
    if as_json:
        _print_json(dict(state.to_json(), host=session.host.name))
    else:
        _show_state(session.host.name, state)


@app.command("diff")
@handle_errors
def diff(host: str = HostOpt, config: str = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """The unified diff the patch would apply to the host's sglang (changes nothing)."""
    session = open_host(host, config)
    state = read_patch_state(session.agent)
    if state.applied:
        if as_json:
            _print_json({"status": "applied", "detail": state.detail, "diff": ""})
        else:
            console.print(f"{escape(state.detail)}: nothing to change", style="green")
        return
    plan = plan_for_apply(state, session.host.name)
    if as_json:
        _print_json({"status": "not applied", "detail": plan.message, "diff": plan.diff(),
                     "files": [{"path": c.path, "sha256_before": c.sha256_before, "sha256_after": c.sha256_after}
                               for c in plan.changes]})
    else:
        sys.stdout.write(plan.diff())
        sys.stdout.flush()


@app.command("apply")
@handle_errors
def apply(
    host: str = HostOpt,
    config: str = ConfigOpt,
    threshold: str = typer.Option(None, "--threshold",
                                  help="Record this threshold in the release (-1: never disable)."),
    as_json: bool = JsonOpt,
    yes: bool = YesOpt,
) -> None:
    """Patch the host's sglang as one transaction (compile-checked, backed up); restarts nothing."""
    recorded = None if threshold is None else parse_threshold(threshold, "--threshold")
    session = open_host(host, config)
    state = read_patch_state(session.agent)
    plan = plan_for_apply(state, session.host.name)
    if state.applied:
        if as_json:
            _print_json({"changed": False, "detail": plan.message, "release": state.current})
        else:
            console.print(f"{escape(plan.message)}: nothing changed", style="green")
        return
    confirm(f"Patch sglang {plan.version} on {session.host.name} ({len(plan.changes)} files)?", yes)
    result = apply_plan(session.agent, plan, threshold=recorded)
    if as_json:
        _print_json(dict(result, changed=True))
        return
    console.print(f"[green]applied[/] release {result['release']} on {escape(session.host.name)}")
    for entry in result["manifest"]["files"]:
        console.print(f"  {entry['path']:45} {(entry['sha256_before'] or 'new')[:12]} → {entry['sha256_after'][:12]}")
    check = result.get("import_check") or {}
    if check.get("ran"):
        console.print(f"  import check: {escape(check['detail'])}")
    else:
        console.print(f"  [yellow]{escape(check.get('detail') or 'import check did not run')}[/]")
    console.print("  the running server (if any) was not restarted")


@app.command("revert")
@handle_errors
def revert_cmd(
    host: str = HostOpt,
    config: str = ConfigOpt,
    release: str = typer.Option(None, "--release", help="Release id (default: the one in force)."),
    every: bool = typer.Option(False, "--all", help="Revert every applied release, newest first (back to pristine)."),
    as_json: bool = JsonOpt,
    yes: bool = YesOpt,
) -> None:
    """Restore the original files of a release byte for byte (sha256-checked); restarts nothing."""
    session = open_host(host, config)
    what = "every applied release" if every else f"release {release}" if release else "the release in force"
    confirm(f"Revert {what} on {session.host.name}?", yes)
    result = revert(session.agent, release, every)
    if as_json:
        _print_json(result)
        return
    if not result["reverted"]:
        console.print("nothing to revert", style="green")
    for item in result["reverted"]:
        if item.get("already"):
            console.print(f"release {item['release']} was already reverted: nothing changed", style="green")
        else:
            console.print(f"[green]reverted[/] release {item['release']} ({len(item['files'])} files restored)")
    console.print(f"  in force now: {result.get('current') or 'no release (original files)'}")
