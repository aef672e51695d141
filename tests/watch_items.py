"""Deterministic `watch` items in the agent's exact shape, for TUI tests, snapshots and benchmarks.

The Prometheus text follows what sglang 0.5.9's multiprocess registry prints (gauges in
`mostrecent` mode carry model_name, engine_type, tp_rank, pp_rank, moe_ep_rank; checked against
prometheus_client's MultiProcessCollector output in tests/test_metrics.py).
"""

from __future__ import annotations

import time
from typing import Any

LABELS = 'engine_type="unified",model_name="glm-5",moe_ep_rank="0",pp_rank="0",tp_rank="{tp}"'


def metrics_text(running: int, queue: int = 0, threshold: int | None = 5, spec: bool | None = None,
                 tps: float = 0.0, accept: float = 2.5, usage: float = 0.1, disabled_steps: float = 0.0,
                 max_tokens: int = 800_000, tp_ranks: int = 1) -> str:
    """sglang-format /metrics text (only the sglang: lines the agent forwards)."""
    spec = (threshold is None or running <= threshold) if spec is None else spec
    gauges: dict[str, float] = {
        "sglang:num_running_reqs": running,
        "sglang:num_queue_reqs": queue,
        "sglang:num_used_tokens": int(usage * max_tokens),
        "sglang:token_usage": usage,
        "sglang:max_total_num_tokens": max_tokens,
        "sglang:gen_throughput": tps,
        "sglang:spec_accept_length": accept if spec else 1.0,
        "sglang:spec_accept_rate": (accept - 1) / 3 if spec else 0.0,
    }
    if threshold is not None:
        gauges["sglang:spec_enabled"] = 1.0 if spec else 0.0
        gauges["sglang:spec_disable_threshold"] = threshold
    lines = []
    for name, value in gauges.items():
        lines.append(f"# TYPE {name} gauge")
        for tp in range(tp_ranks):
            lines.append(f"{name}{{{LABELS.format(tp=tp)}}} {float(value)}")
    if threshold is not None:
        lines.append("# TYPE sglang:spec_disabled_steps_total counter")
        lines.append(f"sglang:spec_disabled_steps_total{{{LABELS.format(tp=0)}}} {float(disabled_steps)}")
    lines.append("# TYPE sglang:realtime_tokens_total counter")
    lines.append('sglang:realtime_tokens_total{engine_type="unified",mode="decode",model_name="glm-5",'
                 'moe_ep_rank="0",pp_rank="0",tp_rank="0"} 12345.0')
    return "\n".join(lines) + "\n"


def gpu_csv(count: int = 8, util: float = 87.0, used_mib: float = 120_000.0) -> str:
    return "".join(f"{i}, GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}, NVIDIA H200, {util - i:.0f}, {used_mib - i * 100:.0f}, 143771\n"
                   for i in range(count))


def log_stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def decode_line(t: float, running: int, tps: float, accept: float = 2.5) -> str:
    return (f"[{log_stamp(t)} TP0] Decode batch, #running-req: {running}, #token: {running * 900}, "
            f"token usage: 0.10, accept len: {accept:.2f}, accept rate: 0.50, cuda graph: True, "
            f"gen throughput (token/s): {tps:.2f}, #queue-req: 0")


def transition_line(t: float, enabled: bool, batch: int, threshold: int) -> str:
    if enabled:
        return f"[{log_stamp(t)} TP0] Speculation enabled: batch size {batch} <= threshold {threshold}"
    return f"[{log_stamp(t)} TP0] Speculation disabled: batch size {batch} > threshold {threshold}"


def item(t: float, seq: int, running: int, *, threshold: int | None = 5, tps: float | None = None,
         spec: bool | None = None, pid: int | None = 4242, started: float | None = None, gpus: int = 8,
         log: list[str] | None = None, marks: list[str] | None = None, version: str = "0.5.9",
         release: dict[str, Any] | None = None, http: bool = True, server_info: bool = True,
         loads: tuple[int, int] | None = None) -> dict[str, Any]:
    """One `watch` item at host time `t` (UTC, offset 0)."""
    spec_on = (threshold is None or running <= threshold) if spec is None else spec
    if tps is None:
        tps = running * (95.0 if spec_on else 70.0)
    alive = pid is not None
    out: dict[str, Any] = {
        "ok": True, "seq": seq, "t": t, "utc_offset": 0, "interval": 1.0, "port": 30000,
        "process": {"pid": pid, "alive": alive, "source": "pidfile" if alive else None,
                    "started": (started if started is not None else t - 7_380) if alive else None},
        "metrics": ({"ok": True, "text": metrics_text(running, threshold=threshold, spec=spec_on, tps=tps,
                                                       disabled_steps=seq * 3.0)} if http and alive
                    else {"ok": False, "error": "Connection refused"}),
        "gpus": {"ok": True, "csv": gpu_csv(gpus)} if gpus else {"ok": False, "error": "nvidia-smi not found on the server's PATH"},
        "log": {"path": "/root/.dynctl/server.log", "lines": list(log or []), "marks": list(marks or []),
                "decode": None, "dropped": 0, "reset": False},
        "release": release if release is not None else {"id": "20261129T120000-deploy", "strategy": "patch", "threshold": threshold},
        "lock": None,
        "sample_ms": 3.0,
    }
    if loads is not None:
        out["loads"] = {"ok": True, "loads": [{"dp_rank": 0, "num_running_reqs": loads[0], "num_waiting_reqs": loads[1],
                                               "token_usage": 0.1, "gen_throughput": tps}]}
    if server_info and http and alive:
        out["server_info"] = {"ok": True, "data": {
            "version": version, "speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
            "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
            "internal_state": {"speculative_disable_batch_threshold": threshold, "avg_spec_accept_length": 2.5}}}
    return out


def ramp(t0: float, seconds: int = 120, threshold: int = 5, peak: int = 16) -> list[dict[str, Any]]:
    """A load ramp 1 → peak → 1 over `seconds` one-second items, with transition lines where it crosses."""
    items, spec_prev = [], None
    half = seconds / 2
    for i in range(seconds):
        t = t0 + i
        running = max(1, round(1 + (peak - 1) * (1 - abs(i - half) / half)))
        spec = running <= threshold
        marks = []
        if spec_prev is not None and spec != spec_prev:
            marks.append(transition_line(t - 0.5, spec, running, threshold))
        spec_prev = spec
        tps = running * (95.0 if spec else 70.0)
        log = [decode_line(t, running, tps)] + marks
        items.append(item(t, i, running, threshold=threshold, tps=tps, log=log, marks=marks))
    return items
