"""`dynctl deploy|rollback|releases|threshold`."""

from __future__ import annotations

import json
import shlex
import time

import typer
from rich.markup import escape
from rich.syntax import Syntax

from dynctl.core import deploy as core
from dynctl.base import sglang
from dynctl.cli import fleet as fleet_cli
from dynctl.cli.common import (
    AdoptOpt,
    ConfigOpt,
    HostOpt,
    JsonOpt,
    NumbersCommand,
    VerboseOpt,
    YesOpt,
    adopt_word,
    confirm,
    console,
    handle_errors,
    open_host,
    seconds_option,
)
from dynctl.cli.lifecycle import GraceOpt, ReadyTimeoutOpt
from dynctl.cli.progress import EventPrinter
from dynctl.cli.tables import print_table
from dynctl.patching import parse_threshold

SoakOpt = seconds_option(core.DEFAULT_SOAK_S, "--soak", 0, core.MAX_SOAK_S,
                         "Seconds to keep watching the new server after it is ready; a crash in that time "
                         "fails the operation (a deploy rolls back). 0: no soak.")


def register(app: typer.Typer) -> None:
    app.command("deploy")(deploy)
    app.command("rollback")(rollback)
    app.command("releases")(releases)
    app.command("threshold", cls=NumbersCommand)(threshold)


@handle_errors
def deploy(
    threshold: str = typer.Option(..., "--threshold", "-t", help="Speculate only while at most N requests run (-1: always)."),
    host: str = HostOpt,
    config: str = ConfigOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the diff and the launch argv; change nothing."),
    yes: bool = YesOpt,
    adopt: bool = AdoptOpt,
    use_config_args: bool = typer.Option(False, "--use-config-args",
                                         help="Launch the configured launch and args, not the operator's own launch "
                                              "of the adopted (or taken-over) server."),
    grace: float = GraceOpt,
    ready_timeout: float = ReadyTimeoutOpt,
    soak: float = SoakOpt,
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
    hosts: str = fleet_cli.HostsOpt,
    max_unavailable: int = fleet_cli.MaxUnavailableOpt,
    canary: int = fleet_cli.CanaryOpt,
    drain: float = fleet_cli.DrainOpt,
) -> None:
    """Inspect, validate with the server's own interpreter, back up, switch, restart, health-gate, soak; roll back on failure."""
    parse_threshold(threshold, "--threshold")  # a typo is named before any host is contacted
    if found := fleet_cli.target(host, hosts, config):
        return fleet_cli.rolling("deploy", threshold, found, yes=yes, dry_run=dry_run, grace=grace,
                                 ready_timeout=ready_timeout, soak=soak, drain=drain, max_unavailable=max_unavailable,
                                 canary=canary, as_json=as_json, verbose=verbose)
    session = open_host(host, config)
    t0 = time.monotonic()
    done = core.deploy_threshold(session.agent, session.host, threshold, EventPrinter(quiet=as_json, verbose=verbose),
                                 lambda question: confirm(question, yes), dry_run=dry_run, grace=grace,
                                 ready_timeout=ready_timeout, soak=soak, adopt=adopt_word(adopt, yes),
                                 use_config_args=use_config_args)
    plan = done.plan
    if dry_run:
        _print_plan(session.host.name, plan, as_json)
    elif as_json and done.result is None:
        console.print_json(json.dumps({"changed": False, "message": plan.noop}))
    elif as_json:
        elapsed = time.monotonic() - t0
        result = dict(done.result, elapsed=elapsed, round_trips=session.agent.round_trips)
        console.print_json(json.dumps(sglang.redact(result), default=str))


def _print_plan(host: str, plan: core.DeployPlan, as_json: bool) -> None:
    if as_json:
        console.print_json(json.dumps(sglang.redact(dict(plan.to_json(), diff=plan.diff))))
        return
    console.print(f"[bold]{host}[/]: sglang {plan.sglang_version}, strategy {plan.strategy}; "
                  f"{escape(plan.patch_detail)}")
    if plan.diff:
        console.print(Syntax(plan.diff, "diff", theme="ansi_dark", word_wrap=True))
    if plan.threshold_in_effect != plan.threshold:
        console.print(f"[bold]threshold:[/] {plan.threshold} requested, {plan.threshold_in_effect} in effect "
                      f"(sglang's CUDA-graph padding)")
    console.print("[bold]launch argv:[/] " + escape(shlex.join(sglang.redact_argv(plan.launch_argv))), soft_wrap=True)
    if plan.operator:
        how = ("a deploy takes it over only with --adopt or at the takeover prompt" if plan.operator.get("adoptable")
               else f"it runs as {plan.operator.get('owner')}: dynctl never takes it over")
        console.print(f"[bold yellow]the operator's server:[/] {escape(plan.operator_line() or '')}; {escape(how)}",
                      soft_wrap=True)
    if plan.noop:
        console.print(f"[green]{escape(plan.noop)}[/]")
    console.print("[dim]dry run: nothing was changed[/]")


def _release_threshold(manifest: dict) -> str:
    """The threshold a release asked for, and what the server enforces where that differs."""
    asked, effective = manifest.get("threshold"), manifest.get("effective_threshold")
    return str(asked) if effective is None or effective == asked else f"{asked} (in effect {effective})"


@handle_errors
def rollback(
    host: str = HostOpt,
    config: str = ConfigOpt,
    to: str = typer.Option(None, "--to", help="Release to return to: its id or a unique prefix of it (as `dynctl "
                                              "releases` shows), 'previous' (the default), 'latest' (the one in "
                                              "force) or 'baseline' (no release)."),
    yes: bool = YesOpt,
    adopt: bool = AdoptOpt,
    grace: float = GraceOpt,
    ready_timeout: float = ReadyTimeoutOpt,
    soak: float = SoakOpt,
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
    hosts: str = fleet_cli.HostsOpt,
    max_unavailable: int = fleet_cli.MaxUnavailableOpt,
    canary: int = fleet_cli.CanaryOpt,
    drain: float = fleet_cli.DrainOpt,
) -> None:
    """Back to the previous release (or --to R) and restart with its recorded launch arguments."""
    if found := fleet_cli.target(host, hosts, config):
        return fleet_cli.rolling("rollback", to, found, yes=yes, dry_run=False, grace=grace,
                                 ready_timeout=ready_timeout, soak=soak, drain=drain, max_unavailable=max_unavailable,
                                 canary=canary, as_json=as_json, verbose=verbose)
    session = open_host(host, config)
    result = core.rollback(session.agent, session.host, to, EventPrinter(quiet=as_json, verbose=verbose), grace=grace,
                           ready_timeout=ready_timeout, soak=soak, confirm=lambda question: confirm(question, yes),
                           adopt=adopt_word(adopt, yes))
    if as_json:
        console.print_json(json.dumps(sglang.redact(result), default=str))


@handle_errors
def releases(
    host: str = HostOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
    hosts: str = fleet_cli.HostsOpt,
    concurrency: int = fleet_cli.ConcurrencyOpt,
) -> None:
    """The release history on the host: id, time, who, sglang version, threshold, files, state."""
    if found := fleet_cli.target(host, hosts, config):
        return fleet_cli.releases(found, as_json, concurrency)
    session = open_host(host, config)
    items = core.list_releases(session.agent)
    if as_json:
        console.print_json(json.dumps(sglang.redact(items), default=str))
        return
    if not items:
        console.print(f"no releases on {session.host.name} yet")
        return
    rows = [(m["id"], str(m.get("created", ""))[:19], m.get("who") or "", m.get("sglang_version") or "",
             m.get("strategy") or "", _release_threshold(m), len(m.get("files") or []), m.get("state") or "")
            for m in items]
    # the id is what `rollback --to` takes: never cut it, whatever the terminal's width
    print_table(console, ("release", "created", "who", "sglang", "strategy", "threshold", "files", "state"), rows,
                no_wrap=("release",))


@handle_errors
def threshold(
    value: str = typer.Argument(..., help="New threshold N (-1: never disable speculation)."),
    host: str = HostOpt,
    config: str = ConfigOpt,
    yes: bool = YesOpt,
    as_json: bool = JsonOpt,
    hosts: str = fleet_cli.HostsOpt,
    concurrency: int = fleet_cli.ConcurrencyOpt,
) -> None:
    """Change the threshold of the running server without a restart, and report the value in force."""
    number = parse_threshold(value, "threshold")  # a typo is named before any host is contacted
    if found := fleet_cli.target(host, hosts, config):
        return fleet_cli.threshold(value, found, yes, as_json, concurrency)
    session = open_host(host, config)
    answer = core.set_threshold(session.agent, number, EventPrinter(quiet=as_json),
                                lambda question: confirm(question, yes))
    if as_json:
        console.print_json(json.dumps(answer))
