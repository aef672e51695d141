"""The server part of `dynctl status`: one `watch` sample of the host, read as the TUI reads it (UI-free)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from dynctl.agent.client import AgentClient
from dynctl.base.errors import OperationFailed
from dynctl.patching.host import read_patch_state
from dynctl.live.snapshot import HostSnapshot, build_snapshot

# How long a status waits for /server_info, the threshold's read-back, to answer once: sglang asks the
# scheduler, which answers between two steps, so a loaded server can take longer than a live view's sample.
INFO_WAIT_S = 5.0


def sample_server(agent: AgentClient, simulated: bool = False) -> HostSnapshot:
    """One snapshot: server state, threshold, batch, speculation, tok/s, accept length, GPUs, log tail."""
    snap = None
    # the first sample may come before the host's nvidia-smi answered, and tok/s is a counter's rate, which
    # needs two readings MIN_RATE_SPAN_S apart: a few short intervals give both
    # and /server_info, the threshold's read-back, gets INFO_WAIT_S to answer once
    for item in agent.stream("watch", interval=0.35, max_items=5, log_lines=5, info_timeout=INFO_WAIT_S):
        snap = build_snapshot(item, agent.host.name, snap, simulated=simulated)
        tok_s = snap.readings.get("gen_throughput")
        rate_pending = bool(snap.counter_window) and (tok_s is None or tok_s.source != "counter")
        if not (snap.gpu_error or "").startswith("waiting for") and not rate_pending:
            return snap
    if snap is None:
        raise OperationFailed(f"{agent.host.name}: the watch stream ended without a sample")
    return snap


def server_section(agent: AgentClient, simulated: bool = False) -> dict[str, Any]:
    snap = sample_server(agent, simulated)
    patch = read_patch_state(agent)
    data = {
        "state": snap.state, "pid": snap.pid, "uptime_s": snap.uptime_s, "release": snap.release,
        "operation": snap.operation, "threshold": snap.threshold,
        "release_threshold": snap.release_threshold, "batch_size": snap.running_reqs,
        "queue": snap.queue_reqs, "speculation": snap.speculation,
        "last_switch": asdict(snap.last_switch) if snap.last_switch else None,
        "gen_throughput": snap.gen_throughput, "accept_length": snap.accept_length,
        "token_usage": snap.token_usage, "spec_warning": snap.spec_warning, "metrics_error": snap.metrics_error,
        "gpus": [asdict(g) for g in snap.gpus], "gpu_error": snap.gpu_error,
        "not_ours": snap.not_ours, "leftovers": list(snap.leftovers),
        # where each live number came from and how old it was: a gauge minutes old is not live
        "sources": {name: reading.to_dict() for name, reading in snap.readings.items()},
        "sampled_at": snap.time,
    }
    return {"server": data, "patch": {"status": patch.status, "detail": patch.detail, "strategy": patch.strategy,
                                      "current_release": patch.current,
                                      "files": {p: (f or {}).get("sha256") for p, f in patch.files.items()}}}
