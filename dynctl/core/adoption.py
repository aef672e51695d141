"""Servers as the operator launched them: `dynctl adopt`, and that launch as the base of every later start. UI-free.

An adopted launch keeps the operator's own flags (memory fraction, context length, max running requests, the
model path); dynctl only sets the flags it owns. The configured `args` replace it only when asked.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from dynctl.base import events, sglang
from dynctl.agent.client import AgentClient
from dynctl.base.errors import PreflightError
from dynctl.base.events import EventSink
from dynctl.core.lifecycle import Confirm, find_server, operator_server

# dynctl's own speculation flags, with the number of values each takes: a new deploy sets them anew
_OWN_SPECULATION_FLAGS = {sglang.THRESHOLD_FLAG: 1, sglang.ADAPTIVE_CONFIG_FLAG: 1, sglang.ADAPTIVE_FLAG: 0}
METRICS_FLAG = "--enable-metrics"


def without_own_flags(argv: Sequence[str]) -> list[str]:
    """`argv` without the threshold and adaptive-speculation flags dynctl sets itself (`--flag v` and `--flag=v`)."""
    return sglang.without_flags(argv, _OWN_SPECULATION_FLAGS)


def adopted_launch(argv: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """The operator's launch with dynctl's flags: their threshold/adaptive flags out, `extra` in, metrics on."""
    out = without_own_flags(argv) + list(extra)
    if METRICS_FLAG not in out:
        out.append(METRICS_FLAG)
    return out


def split_launch(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(launch, args) of a running server's argv as the config writes them: the launcher (`python -m
    sglang.launch_server`, the `sglang serve` script, else the program) and its flags without dynctl's own."""
    argv = list(argv)
    if "-m" in argv[:4] and argv.index("-m") + 1 < len(argv):
        at = argv.index("-m") + 2
        launch = argv[:at]
    elif len(argv) > 2 and os.path.basename(argv[1]) == "sglang" and argv[2] == "serve":
        launch, at = argv[1:3], 3  # the console script behind its shebang: exec the script
    elif len(argv) > 1 and os.path.basename(argv[0]) == "sglang" and argv[1] == "serve":
        launch, at = argv[:2], 2
    else:
        launch, at = argv[:1], 1
    return launch, sglang.without_flags(argv[at:], sglang.OWN_LAUNCH_FLAGS)


def launch_base(context: dict[str, Any]) -> tuple[list[str], str] | None:
    """The operator's launch a deploy builds on, and whose it is: the server on the port that is being taken over,
    else the adopted baseline; None when neither exists (the configured launch is the base)."""
    operator = context.get("operator")
    if operator and operator.get("cmdline"):
        return list(operator["cmdline"]), f"the launch of pid {operator['pid']}, not started by dynctl"
    adopted = context.get("adopted")
    if adopted and adopted.get("argv"):
        return list(adopted["argv"]), f"the adopted launch of pid {adopted.get('pid')}"
    return None


def adopt(agent: AgentClient, on_event: EventSink = events.ignore, confirm: Confirm = lambda q: None) -> dict[str, Any]:
    """`dynctl adopt`: the operator's server on the port becomes the baseline release and dynctl's server, and
    keeps running. Nothing is stopped or restarted; a server dynctl already manages is left as it is."""
    name = agent.host.name
    state = find_server(agent)
    if state.pid is not None:
        how = "adopted" if state.source == "adopted" else "started by dynctl"
        on_event(events.Unchanged("adopt", f"pid {state.pid} on {name} is already dynctl's server ({how}); "
                                           f"nothing to adopt"))
        return {"adopted": False, "pid": state.pid, "source": state.source}
    operator = operator_server(state.not_ours)
    if operator is None:
        found = state.not_ours
        why = f"; {found['text']} -- {found.get('hint', '')}" if found else ""
        raise PreflightError(f"{name}: adopt: no sglang server listens on port {state.port}{why}; nothing was changed")
    pid = operator["pid"]
    if not operator.get("adoptable"):
        raise PreflightError(f"{name}: adopt refused: pid {pid} runs as {operator.get('owner')}: dynctl never takes "
                             f"over another user's server; nothing was changed")
    confirm(f"Adopt pid {pid} on {name}, which was not started by dynctl? It runs "
            f"{events.one_line(operator.get('cmdline'), 200)}. Its argv, environment (stored 0600, values never "
            f"shown) and cwd become the baseline release; it keeps running, and from now on stop, restart and deploy "
            f"treat it as dynctl's server (argv against the configured launch: {operator.get('argv_diff') or '?'})")
    on_event(events.StepStarted("adopt", f"pid {pid}: reading its argv, environment and cwd"))
    result = agent.call("server_adopt", adopt={"pid": pid, "start": operator["start"]})
    log = result.get("log") or "none dynctl can read (it writes to a terminal)"
    on_event(events.Finished("adopt", "adopted", f"pid {pid} on {name}: its launch is the baseline release "
                                                 f"(cwd {result.get('cwd')}, {len(result.get('env_keys') or [])} "
                                                 f"environment variables, log {log})"))
    return result
