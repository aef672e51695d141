"""Per-level statistics from the load generator's raw timings, named and defined as `vllm bench serve`.

Definitions (vLLM `calculate_metrics`, sglang `bench_serving.calculate_metrics`): TTFT = first streamed text
after the request was sent; ITL = gap between consecutive text chunks; TPOT = (E2EL - TTFT) / (tokens - 1)
per request; E2EL = until the stream ended. Latencies cover the requests that completed in the window.

Throughput: with --num-prompts, as vLLM: tokens of the completed requests over the time from the first
measured request's start to the last one's end. With --duration, the tokens that arrived inside the window
(requests still running at its end are cut and count only their tokens so far), so a closed loop is measured
at its steady state without a ramp-down tail.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from dynctl.base.parsers import MetricsFormatError
from dynctl.base.parsers.prometheus import parse_prometheus, pick_samples

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """numpy.percentile's default (linear) interpolation; 0.0 for no values, as vLLM reports."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def describe(name: str, values_ms: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pNN of one metric under vLLM's key names (`mean_ttft_ms`, `p99_ttft_ms`, ...)."""
    out = {
        f"mean_{name}_ms": statistics.fmean(values_ms) if values_ms else 0.0,
        f"median_{name}_ms": percentile(values_ms, 50),
        f"std_{name}_ms": statistics.pstdev(values_ms) if len(values_ms) > 1 else 0.0,
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = percentile(values_ms, p)
    return out


def summarize_level(raw: Mapping[str, Any], *, input_len: int, duration_mode: bool,
                    goodput: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The vLLM-shaped result of one level from the agent's `bench_level` answer."""
    w0, w1 = (float(x) for x in raw["window"])
    records = raw.get("records") or []
    done = [r for r in records if not r.get("a") and (not duration_mode or w0 <= _end(r) <= w1 + 1e-6)]
    if duration_mode:
        start, end = w0, w1
        total_output = sum(_tokens_between(r, w0, w1) for r in records)
    else:
        start = min((r["s"] for r in done), default=w0)
        end = max((_end(r) for r in done), default=w1)
        total_output = sum(int(r.get("n") or 0) for r in done)
    duration = max(end - start, 1e-9)

    ttfts = [r["t"][0] / 1e3 for r in done]
    e2els = [r["e"] / 1e3 for r in done]
    itls = [(b - a) / 1e3 for r in done for a, b in zip(r["t"], r["t"][1:])]
    tpots, all_tpots = [], []
    for r in done:
        n = int(r.get("n") or 0)
        tpot = (r["e"] - r["t"][0]) / 1e3 / (n - 1) if n > 1 else 0.0
        all_tpots.append(tpot)  # vLLM: 0 for a one-token answer, and it counts for goodput
        if n > 1:
            tpots.append(tpot)

    completed = len(done)
    level: dict[str, Any] = {
        "max_concurrency": int(raw["concurrency"]),
        "request_rate": "inf",
        "burstiness": 1.0,
        "duration": duration,
        "completed": completed,
        "failed": int(raw.get("failed") or 0),
        "total_input_tokens": completed * input_len,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "request_goodput": _goodput(goodput, ttfts, all_tpots, e2els) / duration if goodput else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (completed * input_len + total_output) / duration,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        level.update(describe(name, values))
    server = summarize_server(decode_samples(raw.get("samples") or []), w0, w1)
    level["accept_length"] = server.get("accept_length")
    level["server"] = server
    level["errors"] = dict(raw.get("errors") or {})
    level["warmup_requests"] = int(raw.get("warmup") or 0)
    level["warmup_failed"] = int(raw.get("warmup_failed") or 0)
    level["cut_at_window_end"] = sum(1 for r in records if r.get("a"))
    level["timed_out"] = bool(raw.get("timed_out"))
    level["loadgen"] = dict(raw.get("loadgen") or {})
    if raw.get("metrics_note"):
        server["note"] = raw["metrics_note"]
    return level


def _end(record: Mapping[str, Any]) -> float:
    return record["s"] + record["e"] / 1e6


def _tokens_between(record: Mapping[str, Any], w0: float, w1: float) -> int:
    """Tokens of one request whose chunk arrived inside [w0, w1] (a chunk may carry several tokens)."""
    total, prev = 0, 0
    for offset_us, cum in zip(record["t"], record.get("k") or range(1, len(record["t"]) + 1)):
        if w0 <= record["s"] + offset_us / 1e6 <= w1:
            total += cum - prev
        prev = cum
    return total


def _goodput(slo_ms: Mapping[str, float], ttfts: Sequence[float], tpots: Sequence[float],
             e2els: Sequence[float]) -> int:
    series = {"ttft": ttfts, "tpot": tpots, "e2el": e2els}
    chosen = [(series[name], limit) for name, limit in slo_ms.items()]
    return sum(1 for i in range(len(ttfts)) if all(values[i] <= limit for values, limit in chosen))


def counter_delta(values: Sequence[float]) -> float:
    """Increase of a counter over samples; a drop means the server restarted and counts from zero."""
    total = 0.0
    for a, b in zip(values, values[1:]):
        total += b - a if b >= a else b
    return total


# sample name -> key of a bench sample (counters per mode get "passes_<mode>" and "tokens_<mode>")
_SAMPLE_KEYS = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "queued",
    "sglang:gen_throughput": "gen_throughput",
    "sglang:spec_accept_length": "accept_length",
    "sglang:spec_enabled": "spec_enabled",
    "sglang:spec_disable_threshold": "threshold",
    "sglang:spec_disabled_steps_total": "disabled_steps",
    "sglang:generation_tokens_total": "generation_tokens",
}
_PER_MODE = {"sglang:cuda_graph_passes_total": "passes_", "sglang:realtime_tokens_total": "tokens_"}


def read_sample(text: str) -> dict[str, float]:
    """The values bench needs from one /metrics text the agent sampled: summed over DP ranks (one TP rank
    each, as everywhere), decode steps and tokens per CUDA-graph mode; series without a value left out."""
    out: dict[str, float] = {}
    try:
        by_name = parse_prometheus(text)
    except MetricsFormatError:
        return out
    for name, samples in by_name.items():
        key = _SAMPLE_KEYS.get(name)
        if key is None and name not in _PER_MODE:
            continue
        for sample in pick_samples(samples):
            value = float(sample.value)
            if not math.isfinite(value):  # NaN: "no value yet"
                continue
            k = key or _PER_MODE[name] + sample.labels.get("mode", "unknown")
            out[k] = out.get(k, 0.0) + value
    return out


def decode_samples(raw: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The level's samples as the agent sent them ({"t", "text", "edge"?}) -> read_sample values with t/edge."""
    out = []
    for s in raw:
        sample: dict[str, Any] = read_sample(s.get("text") or "")
        sample["t"] = s["t"]
        if s.get("edge"):
            sample["edge"] = 1
        out.append(sample)
    return out


def summarize_server(samples: Sequence[Mapping[str, Any]], w0: float, w1: float) -> dict[str, Any]:
    """What the server itself reported during the window: batch size, speculation share, accept length."""
    # Edge samples are scraped right at the window's ends: exact for counters, but a gauge read as the
    # load stops says little, so gauges come from the periodic samples only.
    inside = sorted((s for s in samples if s.get("edge") or w0 <= s["t"] <= w1), key=lambda s: s["t"])
    periodic = [s for s in inside if not s.get("edge")]
    out: dict[str, Any] = {"samples": len(periodic)}

    def mean_of(key: str) -> float | None:
        vals = [s[key] for s in periodic if key in s]
        return statistics.fmean(vals) if vals else None

    out["mean_queue"] = mean_of("queued")
    out["mean_gen_throughput"] = mean_of("gen_throughput")
    out["threshold"] = inside[-1].get("threshold") if inside else None
    steps_by_mode = {k: counter_delta([s.get(k, 0.0) for s in inside])
                     for k in sorted({k for s in inside for k in s if k.startswith("passes_")})}
    steps = sum(steps_by_mode.values())
    out["decode_steps"] = steps if steps_by_mode else None
    share, source = None, None
    if steps > 0 and any("disabled_steps" in s for s in inside):
        share = 1.0 - counter_delta([s.get("disabled_steps", 0.0) for s in inside]) / steps
        source = "sglang:spec_disabled_steps_total"
    elif any("spec_enabled" in s for s in periodic):
        share = mean_of("spec_enabled")
        source = "sglang:spec_enabled"
    elif steps > 0 and "passes_decode_none" in steps_by_mode and "accept_length" in {k for s in inside for k in s}:
        # unpatched EAGLE server: steps without a CUDA graph are the nearest sign of no speculation
        share = 1.0 - steps_by_mode["passes_decode_none"] / steps
        source = "sglang:cuda_graph_passes_total"
    out["spec_on_share"] = max(0.0, min(1.0, share)) if share is not None else None
    out["spec_on_source"] = source
    accept = [s["accept_length"] for s in periodic if "accept_length" in s and s["accept_length"] > 0]
    out["accept_length"] = statistics.fmean(accept) if accept else None
    # The batch of every decode step, from exact per-step counters: decode tokens / steps / tokens per
    # request per step. The num_running_reqs gauge moves only on log ticks (every 40 steps by default).
    decode_tokens = counter_delta([s.get("tokens_decode", 0.0) for s in inside])
    if steps > 0 and decode_tokens > 0:
        per_request = 1.0 + (out["spec_on_share"] or 0.0) * ((out["accept_length"] or 1.0) - 1.0)
        out["mean_batch_size"] = decode_tokens / steps / per_request
        out["batch_source"] = "sglang:realtime_tokens_total{mode=decode} per decode step"
    else:
        out["mean_batch_size"] = mean_of("running")
        out["batch_source"] = "sglang:num_running_reqs" if out["mean_batch_size"] is not None else None
    return out
