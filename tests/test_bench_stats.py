"""Bench statistics, parsing, recommendation and outputs, on hand-made timings with known answers."""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from dynctl.bench.chart import chart_series, crossover_x, terminal_chart, write_png
from dynctl.bench.plan import BenchPlan, Mode, parse_concurrency, parse_goodput, plan_modes
from dynctl.bench.recommend import recommend
from dynctl.bench.report import comparison_rows, level_cells, level_headers, write_json
from dynctl.bench.runner import BenchResult, ModeRun
from dynctl.bench.stats import (counter_delta, decode_samples, describe, percentile, read_sample, summarize_level,
                                 summarize_server)
from dynctl.base.errors import UsageError


def test_percentile_is_numpys_linear_interpolation():
    # numpy.percentile([1, 2, 3, 4], [50, 90, 99]) == [2.5, 3.7, 3.97]; [10] -> 10; [] -> 0 as vLLM's `or 0`
    assert [round(percentile([4, 1, 3, 2], p), 6) for p in (50, 90, 99)] == [2.5, 3.7, 3.97]
    assert percentile([10.0], 99) == 10.0 and percentile([], 50) == 0.0
    d = describe("ttft", [1, 2, 3, 4])
    assert d["mean_ttft_ms"] == 2.5 and d["median_ttft_ms"] == 2.5 and d["p99_ttft_ms"] == pytest.approx(3.97)
    assert d["std_ttft_ms"] == pytest.approx(1.118034, rel=1e-6)  # numpy.std: population


def _rec(start, chunks_ms, end_ms, n=None, cum=None, cut=False):
    r = {"s": start, "t": [int(c * 1000) for c in chunks_ms], "e": int(end_ms * 1000),
         "n": n if n is not None else len(chunks_ms)}
    r["k"] = cum if cum is not None else list(range(1, len(chunks_ms) + 1))
    if cut:
        r["a"] = 1
    return r


def test_num_prompts_level_follows_vllm_definitions():
    records = [
        _rec(0.0, [100, 120, 150, 200], 210),  # ttft 100, itl 20 30 50, tpot (210-100)/3
        _rec(0.5, [50, 60], 70),  # ttft 50, itl 10, tpot 20
    ]
    raw = {"concurrency": 2, "window": [0.0, 0.57], "records": records, "failed": 1,
           "errors": {"HTTP 500: boom": 1}, "samples": []}
    lv = summarize_level(raw, input_len=10, duration_mode=False, goodput={"ttft": 60})
    assert lv["completed"] == 2 and lv["failed"] == 1
    assert lv["duration"] == pytest.approx(0.57)  # first start 0.0 .. last end 0.5 + 0.07
    assert lv["total_output_tokens"] == 6 and lv["output_throughput"] == pytest.approx(6 / 0.57)
    assert lv["total_input_tokens"] == 20 and lv["total_token_throughput"] == pytest.approx(26 / 0.57)
    assert lv["request_throughput"] == pytest.approx(2 / 0.57)
    assert lv["mean_ttft_ms"] == pytest.approx(75) and lv["median_ttft_ms"] == pytest.approx(75)
    assert lv["mean_tpot_ms"] == pytest.approx(((110 / 3) + 20) / 2)
    assert lv["mean_itl_ms"] == pytest.approx(27.5) and lv["median_itl_ms"] == pytest.approx(25)  # 10 20 30 50
    assert lv["mean_e2el_ms"] == pytest.approx(140) and lv["p99_e2el_ms"] == pytest.approx(70 + 140 * 0.99)
    assert lv["request_goodput"] == pytest.approx(1 / 0.57)  # only the 50 ms TTFT meets ttft:60
    for key in ("max_concurrency", "p90_ttft_ms", "p99_tpot_ms", "median_itl_ms", "std_e2el_ms"):
        assert key in lv


def test_duration_level_counts_tokens_inside_the_window_only():
    records = [
        _rec(0.0, [500, 1500], 1600, n=4, cum=[2, 4]),  # 2 tokens at 0.5 s (before w0), 2 at 1.5 s
        _rec(1.2, [300, 600, 900], 950, n=6, cum=[2, 4, 6]),  # ends at 2.15, all inside
        _rec(2.5, [100, 400], 450, n=4, cum=[2, 4], cut=True),  # cut at the window end: 2 inside (2.6)
    ]
    raw = {"concurrency": 2, "window": [1.0, 3.0], "records": records, "samples": []}
    lv = summarize_level(raw, input_len=8, duration_mode=True)
    assert lv["duration"] == pytest.approx(2.0)
    assert lv["total_output_tokens"] == 2 + 6 + 4  # the cut request's chunk at 2.9 is inside too
    assert lv["output_throughput"] == pytest.approx(12 / 2.0)
    assert lv["completed"] == 2 and lv["cut_at_window_end"] == 1
    assert lv["request_goodput"] is None


def test_counters_survive_a_server_restart():
    assert counter_delta([10, 15, 20]) == 10
    assert counter_delta([100, 110, 3, 8]) == 10 + 3 + 5  # restart: it counted 3 after coming back


def test_server_view_prefers_the_patch_counter():
    samples = [
        {"t": 0.5, "running": 4, "passes_decode_cuda_graph": 100, "passes_decode_none": 0, "disabled_steps": 0,
         "spec_enabled": 1, "accept_length": 2.5},
        {"t": 1.0, "running": 6, "passes_decode_cuda_graph": 130, "passes_decode_none": 10, "disabled_steps": 10,
         "spec_enabled": 0, "accept_length": 2.0},
        {"t": 1.5, "running": 8, "passes_decode_cuda_graph": 150, "passes_decode_none": 50, "disabled_steps": 50,
         "spec_enabled": 0, "accept_length": 0.0},
        {"t": 9.0, "running": 100},  # outside the window
    ]
    s = summarize_server(samples, 0.0, 2.0)
    assert s["mean_batch_size"] == 6 and s["decode_steps"] == 100
    assert s["spec_on_share"] == pytest.approx(0.5) and s["spec_on_source"] == "sglang:spec_disabled_steps_total"
    assert s["accept_length"] == pytest.approx(2.25)  # 0.0 means "no speculative step in the interval"
    no_patch = [{k: v for k, v in x.items() if k not in ("disabled_steps", "spec_enabled")} for x in samples]
    s2 = summarize_server(no_patch, 0.0, 2.0)
    assert s2["spec_on_source"] == "sglang:cuda_graph_passes_total" and s2["spec_on_share"] == pytest.approx(0.5)
    assert summarize_server([], 0, 1)["spec_on_share"] is None


def test_a_sample_the_agent_sent_is_read_as_every_metrics_text():
    """Raw /metrics text from the host: TP ranks repeat their DP rank's batch (one counts), DP ranks add up,
    decode steps and tokens are kept per CUDA-graph mode, and a NaN gauge is no value."""
    text = "\n".join([
        "# TYPE sglang:num_running_reqs gauge",
        'sglang:num_running_reqs{dp_rank="0",tp_rank="0"} 3.0',
        'sglang:num_running_reqs{dp_rank="0",tp_rank="1"} 3.0',
        'sglang:num_running_reqs{dp_rank="1",tp_rank="0"} 4.0',
        "# TYPE sglang:spec_accept_length gauge",
        "sglang:spec_accept_length NaN",
        "# TYPE sglang:cuda_graph_passes_total counter",
        'sglang:cuda_graph_passes_total{mode="decode_cuda_graph"} 120.0',
        'sglang:cuda_graph_passes_total{mode="decode_none"} 7.0',
        "# TYPE sglang:spec_disabled_steps_total counter",
        "sglang:spec_disabled_steps_total 7.0",
    ]) + "\n"
    assert read_sample(text) == {"running": 7.0, "passes_decode_cuda_graph": 120.0, "passes_decode_none": 7.0,
                                 "disabled_steps": 7.0}
    assert decode_samples([{"t": 1.5, "text": text, "edge": 1}])[0]["edge"] == 1
    assert read_sample("not prometheus {") == {}


@pytest.mark.parametrize("text, fragment", [
    ("0", "item 1 '0' must be between 1"),
    ("1,,4", "item 2 is empty"),
    ("abc", "item 1 'abc' is not a positive integer"),
    ("1,2,-4", "item 3 '-4' is not a positive integer"),
    ("2,2", "item 2 '2' is given twice"),
    ("", "empty list"),
])
def test_bad_concurrency_names_the_item(text, fragment):
    with pytest.raises(UsageError, match="--concurrency") as info:
        parse_concurrency(text)
    assert fragment in str(info.value)


def test_goodput_and_modes():
    assert parse_goodput(["ttft:200", "tpot:50"]) == {"ttft": 200.0, "tpot": 50.0}
    assert parse_goodput(["ttft:200,e2el:1e3"]) == {"ttft": 200.0, "e2el": 1000.0}
    for bad in ("ttft", "foo:1", "tpot:x", "ttft:-1"):
        with pytest.raises(UsageError, match="--goodput"):
            parse_goodput([bad])
    assert plan_modes(True, [5, 0]) == (Mode.no_spec(), Mode.always_spec(), Mode.at(5))
    assert plan_modes(False, []) == (Mode.as_deployed(),)
    assert plan_modes(False, [3]) == (Mode.at(3),)
    with pytest.raises(UsageError, match="--threshold -2"):
        plan_modes(True, [-2])
    with pytest.raises(UsageError, match="either --duration or --num-prompts"):
        BenchPlan(duration=5, num_prompts=10)
    assert BenchPlan(warmup=None).warmup_for(8) == 8 and BenchPlan(warmup=2).warmup_for(8) == 2


def _run(mode, values, threshold=None):
    levels = [{"max_concurrency": c, "output_throughput": v, "median_ttft_ms": 1.0, "p99_ttft_ms": 2.0,
               "median_tpot_ms": 1.0, "p99_itl_ms": 1.0, "median_e2el_ms": 3.0, "p99_e2el_ms": 4.0, "failed": 0,
               "request_throughput": 1.0, "server": {}, "accept_length": None} for c, v in values.items()]
    return ModeRun(mode, mode.threshold if threshold is None else threshold, levels)


# The H200 run the demo host's table comes from (benchmarks/gpu/results/0.5.12.post1.json, sweeps nospec,
# eagle3 and skip-t8): EAGLE-3 ahead up to 8 streams, behind from 16 on; the run recommended threshold 8.
NOSPEC = {1: 247.4, 2: 487.7, 4: 949.6, 8: 1859.7, 16: 3564.7, 256: 21565.3}
SPEC = {1: 439.6, 2: 772.8, 4: 1495.2, 8: 1922.5, 16: 3224.5, 256: 11659.4}
THRESHOLD_8 = {1: 450.2, 2: 837.2, 4: 1501.4, 8: 2430.6, 16: 3378.8}


def test_recommendation_sits_at_the_crossover_with_margins():
    rec = recommend([_run(Mode.no_spec(), NOSPEC), _run(Mode.always_spec(), SPEC), _run(Mode.at(8), THRESHOLD_8)])
    assert rec["threshold"] == 8 and rec["flag"] == "--speculative-disable-batch-threshold 8"
    assert rec["crossover"] == {"last_spec_win": 8, "first_no_spec_win": 16}
    by = {r["max_concurrency"]: r for r in rec["levels"]}
    assert by[1]["speculation"] and by[1]["margin_vs_no_spec_pct"] == pytest.approx((439.6 / 247.4 - 1) * 100)
    assert not by[256]["speculation"]
    assert by[256]["margin_vs_always_spec_pct"] == pytest.approx((21565.3 / 11659.4 - 1) * 100)
    assert by[16]["measured_output_throughput"] == 3378.8  # threshold 8 was measured: its real margin is shown
    assert rec["notes"] == []


def test_recommendation_edges():
    always = recommend([_run(Mode.no_spec(), {1: 10, 2: 20}), _run(Mode.always_spec(), {1: 20, 2: 30})])
    assert always["threshold"] == 2 and "no crossover" in always["notes"][0]
    never = recommend([_run(Mode.no_spec(), {1: 10, 2: 20}), _run(Mode.always_spec(), {1: 9, 2: 30})])
    assert never["threshold"] == 0 and any("won again" in n for n in never["notes"])
    tie = recommend([_run(Mode.no_spec(), {1: 100, 2: 200}), _run(Mode.always_spec(), {1: 100.5, 2: 150})])
    assert tie["threshold"] == 0  # half a percent is noise, not a reason to speculate
    assert recommend([_run(Mode.no_spec(), {1: 1})]) is None


def _result(runs, rec=None):
    res = BenchResult(host="h", simulated=True, plan=BenchPlan(concurrency=(1, 2), duration=1.0), started="now",
                      probe={"model": "m", "threshold": 5})
    res.runs = runs
    res.recommendation = rec
    return res


def test_json_document_and_tables(tmp_path):
    runs = [_run(Mode.no_spec(), {1: 10.0, 2: 20.0}), _run(Mode.always_spec(), {1: 12.0, 2: 15.0})]
    res = _result(runs, recommend(runs))
    path = write_json(res, tmp_path / "out" / "bench.json")
    doc = json.loads(path.read_text())
    assert doc["simulated"] is True and doc["threshold_before"] == 5 and doc["recommendation"]["threshold"] == 1
    assert [r["mode"] for r in doc["runs"]] == ["no-spec", "always-spec"]
    assert doc["runs"][0]["levels"][1]["output_throughput"] == 20.0
    assert not list((tmp_path / "out").glob(".bench.json.*"))  # no temp file left behind
    headers, rows = comparison_rows(res)
    assert headers == ["conc", "no-spec", "always-spec"] and rows[0] == ["1", "10.0", "12.0 *"]
    assert len(level_cells(runs[0].levels[0], goodput=True)) == len(level_headers(goodput=True))
    with pytest.raises(UsageError, match="is a directory"):
        write_json(res, tmp_path)


def _png_pixels(path):
    """Decode our own 8-bit RGB PNG with zlib (no Pillow in the check)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            w, h, depth, color = struct.unpack(">IIBB", body[:10])
            assert (depth, color) == (8, 2)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = w * 3
    rows, prev = [], bytearray(stride)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - 3] if i >= 3 else 0
            b, c = prev[i], prev[i - 3] if i >= 3 else 0
            p = a + b - c
            pred = {0: 0, 1: a, 2: b, 3: (a + b) // 2,
                    4: min((a, b, c), key=lambda v: (abs(p - v), (a, b, c).index(v)))}[f]
            line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return w, h, {tuple(r[i:i + 3]) for r in rows for i in range(0, stride, 3)}


def test_png_chart_draws_every_mode(tmp_path):
    runs = [_run(Mode.no_spec(), NOSPEC), _run(Mode.always_spec(), SPEC)]
    rec = recommend(runs)
    path = write_png(chart_series(runs), tmp_path / "c.png", title="t", crossover=crossover_x(rec))
    w, h, colors = _png_pixels(path)
    assert (w, h) == (960, 560)
    assert (31, 119, 180) in colors and (214, 39, 40) in colors  # the two mode lines
    assert crossover_x(rec) == (pytest.approx(128 ** 0.5), "crossover: threshold 8")
    with pytest.raises(UsageError, match="nothing was measured"):
        write_png([], tmp_path / "none.png", title="t")


def test_terminal_chart_has_the_legend_and_axis():
    runs = [_run(Mode.no_spec(), NOSPEC), _run(Mode.always_spec(), SPEC)]
    text = terminal_chart(chart_series(runs), width=70, height=15, title="tok/s", color=False)
    assert "no-spec" in text and "always-spec" in text and "256" in text and "\x1b[" not in text
