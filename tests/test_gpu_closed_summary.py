"""closed_summary.py turns a profile call's closed-loop rows and the servers' metrics before and after
each level into tok/s per mode (second servers pooled with `--same`) and what the prefills cost: the
prefill passes by CUDA-graph mode, the prefill_forward stage per request and the time to first token,
each the end-minus-start delta of the servers' own counters, counted once per server and level however
many rounds it ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_gpu_steady_summary import run_summary

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "closed_summary.py"
M = 'model_name="/m/target",tp_rank="0"'


def _metrics(prefill_mode, passes, stage_s, stage_n, ttft_s, ttft_n):
    return "\n".join([
        "# HELP sglang:cuda_graph_passes_total Total number of forward passes categorized by CUDA graph.",
        "# TYPE sglang:cuda_graph_passes_total counter",
        f'sglang:cuda_graph_passes_total{{{M},mode="{prefill_mode}"}} {passes}',
        f'sglang:cuda_graph_passes_total{{{M},mode="decode_cuda_graph"}} {passes * 40}',
        f'sglang:per_stage_req_latency_seconds_sum{{{M},stage="prefill_forward"}} {stage_s}',
        f'sglang:per_stage_req_latency_seconds_count{{{M},stage="prefill_forward"}} {stage_n}',
        f'sglang:per_stage_req_latency_seconds_sum{{{M},stage="request_process"}} 9.0',
        f'sglang:per_stage_req_latency_seconds_count{{{M},stage="request_process"}} {stage_n}',
        f"sglang:time_to_first_token_seconds_sum{{{M}}} {ttft_s}",
        f"sglang:time_to_first_token_seconds_count{{{M}}} {ttft_n}",
        f'sglang:spec_enabled{{{M}}} NaN',
        "",
    ])


def _server(run, label, prefill_mode, tok_s, start, end):
    """One server's closed loop at c16 in two rounds, and its counters before and after the level."""
    (run / f"closed-{label}.json").write_text(json.dumps(
        [{"concurrency": 16, "tok_s": t, "round": i, "label": label} for i, t in enumerate(tok_s)]))
    (run / f"closed-{label}-c16-metrics-start.txt").write_text(_metrics(prefill_mode, *start))
    (run / f"closed-{label}-c16-metrics-end.txt").write_text(_metrics(prefill_mode, *end))


def _run(tmp_path, *args):
    return run_summary(SCRIPT, tmp_path, *args)


def test_closed_loop_tok_s_and_prefill_counters_per_mode(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # (passes, prefill_forward s, its requests, ttft s, its requests) before and after the level
    _server(run, "nospec", "prefill_cuda_graph", [8000, 9000], (5, 1.0, 10, 2.0, 10), (15, 1.5, 30, 4.0, 30))
    _server(run, "nospec2", "prefill_cuda_graph", [8500, 8500], (0, 0.0, 0, 0.0, 0), (10, 0.3, 10, 1.0, 10))
    _server(run, "t0", "prefill_none", [7000, 8000], (3, 0.5, 10, 1.0, 10), (8, 1.7, 30, 4.6, 30))
    _server(run, "patched2", "prefill_none", [7500, 7500], (0, 0.0, 0, 0.0, 0), (6, 0.6, 10, 1.4, 10))
    out = _run(tmp_path, "--same", "nospec2:no_spec", "--same", "patched2:threshold_0")
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    assert summary["levels"] == [16]
    assert summary["tok_s"] == {"no_spec": [8500.0], "threshold_0": [7500.0]}
    assert summary["tok_s_spread_pct"] == {"no_spec": [round(100 * 1000 / 8500, 1)],
                                           "threshold_0": [round(100 * 1000 / 7500, 1)]}
    assert summary["tok_s_ratio_vs_no_spec"]["threshold_0"] == [round(7500 / 8500, 3)]
    # each server's delta once, not once per round: 10 + 10 passes, (0.5 + 0.3) s over (20 + 10) requests
    assert summary["prefill_passes"] == {"no_spec": [{"prefill_cuda_graph": 20}],
                                         "threshold_0": [{"prefill_none": 11}]}
    assert summary["prefill_forward_ms_per_req"] == {"no_spec": [round(1e3 * 0.8 / 30, 2)],
                                                     "threshold_0": [round(1e3 * 1.8 / 30, 2)]}
    assert summary["ttft_ms"] == {"no_spec": [round(1e3 * 3.0 / 30, 1)], "threshold_0": [round(1e3 * 5.0 / 30, 1)]}


def test_a_label_no_call_measured_is_refused_by_name(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _server(run, "nospec", "prefill_cuda_graph", [8000], (0, 0.0, 0, 0.0, 0), (1, 0.1, 1, 0.1, 1))
    refused = _run(tmp_path, "--same", "nospec3:no_spec")
    assert refused.returncode == 2
    assert "--same nospec3:no_spec: no rows labelled nospec3" in refused.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    none = subprocess.run([sys.executable, str(SCRIPT), str(empty), "--version", "0.5.14", "--model", "params_b=1.2",
                           "--out", str(tmp_path / "o.json")], capture_output=True, text=True)
    assert none.returncode == 2
    assert "no closed-<label>.json in" in none.stderr
