"""The simulated server's HTTP API against the shapes sglang 0.5.9 returns, and its behaviour under bad input.

One server (patched 0.5.9 tree, EAGLE3, threshold 4, TP 2, metrics on) serves the whole module.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import resource
import socket
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sim_harness import SPEC_ARGS, Sim, wait_for

pytestmark = pytest.mark.slow

THRESHOLD = 4


@pytest.fixture(scope="module")
def server(patched_site_059: Path, tmp_path_factory: pytest.TempPathFactory):
    argv = ["--time-scale", "50", "--sim-load-seconds", "2", "--model-path", "/models/sim-test", "--tp", "2",
            *SPEC_ARGS, "--max-running-requests", "64", "--enable-metrics", "--decode-log-interval", "5",
            "--speculative-disable-batch-threshold", str(THRESHOLD)]
    sim = Sim(patched_site_059, argv, tmp_path_factory.mktemp("sim-server"), env={"SGLANG_ENABLE_SPEC_V2": "1"})
    try:
        yield sim.wait_ready()
    finally:
        sim.stop()


@pytest.fixture
def client(server: Sim):
    with server.client() as c:
        yield c


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking sglang's framing (`data: ...` + blank line)."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    chunks = text.split("\n\n")
    assert chunks[-1] == ""
    assert all(c.startswith("data: ") for c in chunks[:-1]), chunks[:3]
    return [c[len("data: "):] for c in chunks[:-1]]


# ----------------------------------------------------------------------------------------- native API

def test_health_endpoints_answer_200_once_ready(client):
    for path in ("/health", "/health_generate"):
        r = client.get(path)
        assert r.status_code == 200 and r.content == b""
        assert r.headers["server"] == "uvicorn"


def test_model_info_has_sglang_keys_and_says_simulated(client):
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version",
                "has_image_understanding", "has_audio_understanding", "model_type", "architectures"} <= set(info)
        assert info["model_path"] == "/models/sim-test" and info["is_generation"] is True
        assert info["simulated"] is True and info["model_type"] == "simulated"


def test_server_info_carries_args_scheduler_info_internal_states_and_version(client, server):
    info = client.get("/server_info").json()
    assert info["version"] == "0.5.9"
    assert info["speculative_algorithm"] == "EAGLE3" and info["tp_size"] == 2
    assert info["speculative_disable_batch_threshold"] == THRESHOLD
    assert info["disable_overlap_schedule"] is False  # spec v2 via SGLANG_ENABLE_SPEC_V2=1
    assert info["status"] == "ready" and info["max_total_num_tokens"] > 0 and "max_req_input_len" in info
    [state] = info["internal_states"]
    assert state["speculative_disable_batch_threshold"] == THRESHOLD
    assert set(state["memory_usage"]) == {"weight", "kvcache", "token_capacity", "graph"}
    assert state["effective_max_running_requests_per_dp"] == 64
    assert "last_gen_throughput" in state
    client.get("/get_server_info")
    wait_for(lambda: "Endpoint '/get_server_info' is deprecated" in server.log, 5, "the deprecation warning")


def test_generate_returns_text_ids_and_meta_info(client):
    r = client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 12}})
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert len(out["output_ids"]) == 12 and out["text"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["completion_tokens"] == 12 and meta["prompt_tokens"] >= 1
    assert {"id", "weight_version", "cached_tokens", "e2e_latency", "spec_verify_ct", "spec_accept_length"} <= set(meta)


def test_generate_batch_returns_one_output_per_prompt(client):
    r = client.post("/generate", json={"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200
    outs = r.json()
    assert isinstance(outs, list) and [len(o["output_ids"]) for o in outs] == [3, 3, 3]


def test_generate_streams_cumulative_outputs_as_sse(client):
    r = client.post("/generate", json={"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 20}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert len(events) >= 2
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == sorted(lengths) and lengths[-1] == 20  # cumulative, as with stream_output off
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_stream_interval_sends_a_running_request_every_kth_token_and_always_the_last(patched_site_059, start_sim):
    """--stream-interval 4, as sglang's output streamer: a stream gets the first token at once, then the
    outputs of length 5, 9, ..., and the finished one; interval 1 (the module's server) sends every step."""
    argv = ["--time-scale", "1", "--sim-load-seconds", "0.2", "--model-path", "/models/sim-test",
            "--stream-interval", "4"]
    server = start_sim(patched_site_059, argv).wait_ready()
    with server.client() as c:
        r = c.post("/generate", json={"text": "Hi", "stream": True,
                                      "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}})
    lengths = [len(json.loads(e)["output_ids"]) for e in sse_events(r.text)[:-1]]
    assert lengths[0] == 1 and lengths[-1] == 10 and set(lengths) <= {1, 5, 9, 10}, lengths


def test_openai_completions_non_streaming_shape(client):
    r = client.post("/v1/completions", json={"model": "m", "prompt": "Say", "max_tokens": 7})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "m" and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["text"]
    assert body["usage"]["completion_tokens"] == 7
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 7
    assert body["metadata"] == {"weight_version": "default"}


def test_openai_completions_streaming_deltas_and_usage(client):
    r = client.post("/v1/completions", json={"model": "m", "prompt": "Say", "max_tokens": 9, "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = [json.loads(e) for e in sse_events(r.text)[:-1]]
    *chunks, usage = events
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    full = client.post("/generate", json={"text": "Say", "sampling_params": {"max_new_tokens": 9}}).json()["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
    assert "prompt_tokens_details" not in usage["usage"]  # exclude_none, as sglang dumps the final chunk


def test_v1_models_lists_the_served_model(client):
    [card] = client.get("/v1/models").json()["data"]
    assert card["id"] == "/models/sim-test" and card["object"] == "model"


def test_v1_loads_reports_the_batch_right_now_as_sglang_does(patched_site_059, start_sim):
    """What a gateway (smg) and dynctl's watch read: Scheduler.get_loads per DP rank, plus the aggregate.

    On a server of its own at the measured speed: at the module's 50x a request of 4,000 tokens ends about
    0.2 s after it starts (9 s at 1x), sooner than a loaded machine's client reads its first chunk and asks
    again, so the batch read "right now" was sometimes already empty; here it decodes for seconds."""
    argv = ["--time-scale", "1", "--sim-load-seconds", "0.2", "--model-path", "/models/sim-test", "--tp", "2",
            *SPEC_ARGS, "--max-running-requests", "64", "--enable-metrics",
            "--speculative-disable-batch-threshold", str(THRESHOLD)]
    server = start_sim(patched_site_059, argv, env={"SGLANG_ENABLE_SPEC_V2": "1"}).wait_ready()
    with server.client() as client:
        check_loads(server, client)


def check_loads(server, client):
    idle = client.get("/v1/loads").json()
    assert set(idle) == {"timestamp", "version", "dp_rank_count", "loads", "aggregate"}
    [rank] = idle["loads"]
    assert rank["dp_rank"] == 0 and rank["max_running_requests"] == 64
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens", "token_usage",
            "gen_throughput", "cache_hit_rate", "utilization", "num_total_reqs", "queues", "disaggregation"} <= set(rank)
    with httpx.Client(base_url=server.url, timeout=60) as other:
        with other.stream("POST", "/generate", json={"text": "x", "stream": True,
                                                      "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}) as r:
            next(r.iter_lines())
            # the first chunk can leave before the scheduler files the request as running: poll, the stream open
            deadline = time.monotonic() + 10
            while True:
                busy = client.get("/v1/loads", params={"include": "core"}).json()
                if busy["loads"][0]["num_running_reqs"] or time.monotonic() > deadline:
                    break
    [rank] = busy["loads"]
    assert rank["num_running_reqs"] == 1 and busy["aggregate"]["total_reqs"] == 1, (busy, server.log[-3000:])
    assert "queues" not in rank and "disaggregation" not in rank  # only the sections asked for
    bad = client.get("/v1/loads", params={"include": "core,bogus"})
    assert bad.status_code == 400 and "bogus" in bad.json()["detail"]


def test_metrics_parse_with_sglang_names_types_and_labels(client):
    client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 30}})
    text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expect = {
        "sglang:num_running_reqs": "gauge", "sglang:num_queue_reqs": "gauge", "sglang:token_usage": "gauge",
        "sglang:gen_throughput": "gauge", "sglang:spec_accept_length": "gauge", "sglang:spec_accept_rate": "gauge",
        "sglang:cuda_graph_passes": "counter", "sglang:realtime_tokens": "counter",
        "sglang:prompt_tokens": "counter", "sglang:generation_tokens": "counter", "sglang:num_requests": "counter",
        "sglang:time_to_first_token_seconds": "histogram", "sglang:inter_token_latency_seconds": "histogram",
        "sglang:e2e_request_latency_seconds": "histogram",
        # the patch's own
        "sglang:spec_enabled": "gauge", "sglang:spec_disable_threshold": "gauge",
        "sglang:spec_disabled_steps": "counter",
    }
    for name, kind in expect.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, (name, families[name].type)
    sample = families["sglang:num_running_reqs"].samples[0]
    assert set(sample.labels) == {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}
    assert sample.labels["engine_type"] == "unified" and sample.labels["tp_rank"] == "0"
    modes = {s.labels["mode"] for s in families["sglang:cuda_graph_passes"].samples}
    assert modes == {"decode_cuda_graph"}  # single request: batch 1 <= threshold, speculating on the graph
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)
    assert families["sglang:spec_disable_threshold"].samples[0].value == THRESHOLD


# ----------------------------------------------------------------------------------------- control

def test_set_internal_state_changes_the_threshold_and_reads_back(client):
    try:
        r = client.post("/set_internal_state", json={"server_args": {"speculative_disable_batch_threshold": 9}})
        assert r.status_code == 200 and r.json() == [True]
        info = client.get("/server_info").json()
        assert info["internal_states"][0]["speculative_disable_batch_threshold"] == 9
        assert info["speculative_disable_batch_threshold"] == THRESHOLD  # top level: the launch-time copy
    finally:
        client.put("/set_internal_state", json={"server_args": {"speculative_disable_batch_threshold": THRESHOLD}})


@pytest.mark.parametrize("update", [{"speculative_disable_batch_threshold": -5},
                                    {"speculative_disable_batch_threshold": "big"},
                                    {"max_running_requests": 1}])
def test_set_internal_state_refusals_still_say_updated_true(client, server, update):
    r = client.post("/set_internal_state", json={"server_args": update})
    assert r.status_code == 200 and r.json() == [True]  # scheduler.py:2711-2714
    state = client.get("/server_info").json()["internal_states"][0]
    key, value = next(iter(update.items()))
    assert state[key] != value
    wait_for(lambda: f"Updating {key}" in server.log, 5, "the refusal warning")


def test_flush_cache_when_idle(client):
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")


# ----------------------------------------------------------------------------------------- log lines

def _sglang_decode_pattern(site: Path) -> re.Pattern:
    """sglang's own decode-line regex (srt/debug_utils/log_parser.py _PATTERN_DECODE), read from the tree.

    That pattern ends in "#queue-req: N," — a field order older than 0.5.9, whose log_decode_stats
    (scheduler_metrics_mixin.py:398-402) prints #queue-req last. The trailing comma is made optional.
    """
    module = ast.parse((site / "sglang/srt/debug_utils/log_parser.py").read_text())
    node = next(n for n in module.body if isinstance(n, ast.Assign) and n.targets[0].id == "_PATTERN_DECODE")
    pattern = ast.literal_eval(node.value)
    assert pattern.endswith(r"#queue-req:\s*(?P<queue_req>\d+),")
    return re.compile(pattern[:-1] + ",?")


def test_log_lines_follow_sglang_formats(client, server, patched_site_059):
    # Push a batch over the threshold and back, so decode lines and both transitions are logged. At this
    # time scale a step lasts about 0.1 ms of wall time: the answers are long enough (~0.5 s) to overlap
    # however slowly the burst's connections open, and the first outlasts the others.
    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            await asyncio.gather(*(ac.post("/generate", json={"text": "t", "sampling_params": {
                "max_new_tokens": 20000 if i == 0 else 5000}}) for i in range(THRESHOLD + 3)))
    asyncio.run(burst())
    client.get("/health")
    log = server.log
    pattern = _sglang_decode_pattern(patched_site_059)
    decode = [line for line in log.splitlines() if "Decode batch" in line]
    assert decode, log[-2000:]
    for line in decode:
        m = pattern.match(line)
        assert m, line
        assert m.group("tp_rank") == "0"  # TP 2: the TP0 scheduler logs
    assert any(re.search(r"accept len: \d+\.\d\d, accept rate: \d+\.\d\d, cuda graph: (True|False), "
                         r"gen throughput \(token/s\): \d+\.\d\d, #queue-req: \d+$", line) for line in decode)
    prefill = [line for line in log.splitlines() if "Prefill batch" in line]
    assert prefill and all(re.search(
        r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP0\] Prefill batch, #new-seq: \d+, #new-token: \d+, #cached-token: \d+, "
        r"token usage: \d+\.\d\d, #running-req: \d+, #queue-req: \d+, input throughput \(token/s\): \d+\.\d\d, "
        r"cuda graph: (True|False)$", line) for line in prefill)
    assert re.search(rf"TP0\] Speculation disabled: batch size \d+ > threshold {THRESHOLD}\n", log)
    assert re.search(rf"TP0\] Speculation enabled: batch size \d+ <= threshold {THRESHOLD}\n", log)
    for line in ("Load weight begin.", "KV Cache is allocated. #tokens:", "max_total_num_tokens=",
                 "Uvicorn running on http://127.0.0.1:", "The server is fired up and ready to roll!", "SIMULATED"):
        assert line in log
    assert re.search(r'\] INFO:     127\.0\.0\.1:\d+ - "GET /health HTTP/1\.1" 200 OK', log)
    for rank in (0, 1):
        assert f" TP{rank}] Load weight end." in log


# ----------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/set_internal_state"])
def test_malformed_json_is_a_400_and_the_server_carries_on(client, path):
    r = client.post(path, content=b'{"text": "unterminated', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON decode error" in r.json()["message"]
    r = client.post(path, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert client.get("/model_info").status_code == 200


def test_flush_cache_takes_no_body_so_garbage_is_ignored(client):
    r = client.post("/flush_cache", content=b'{"broken', headers={"content-type": "application/json"})
    assert r.status_code == 200  # FastAPI reads no body for an endpoint without body parameters


def test_negative_token_counts_are_refused_like_sglang(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": -3})
    assert r.status_code == 400 and "max_tokens must be positive" in r.json()["message"]
    r = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": -1}})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "max_new_tokens must be at least 0, got -1."}}
    r = client.post("/generate", json={"sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "Either text, input_ids or input_embeds" in r.json()["error"]["message"]


def test_completions_needs_a_json_content_type(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "Unsupported Media Type" in r.json()["message"]


def test_a_10mb_prompt_is_refused_for_length_and_the_server_carries_on(client):
    prompt = "word " * (2 * 1024 * 1024)
    r = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400
    assert "is longer than the model's context length (131072 tokens)" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400
    assert client.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_a_thousand_simultaneous_connections(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096 <= hard or hard == resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))  # this client needs 1000 sockets
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 1100, "raise `ulimit -n` to run this test"
    port = server.port
    socks = []
    try:
        for _ in range(1000):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            socks.append(s)
        request = b"GET /model_info HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        for s in socks:
            s.sendall(request)
        ok = 0
        for s in socks:
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            ok += data.startswith(b"HTTP/1.1 200 OK")
        assert ok == 1000
    finally:
        for s in socks:
            s.close()
    with server.client() as c:
        assert c.post("/generate", json={"text": "after", "sampling_params": {"max_new_tokens": 3}}).status_code == 200


def test_client_disconnect_mid_stream_aborts_the_request_and_the_server_carries_on(server, client):
    def aborted() -> float:
        text = client.get("/metrics").text
        return next(s.value for f in text_string_to_metric_families(text) if f.name == "sglang:num_aborted_requests"
                    for s in f.samples if s.name.endswith("_total"))

    before = aborted()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        body = json.dumps({"text": "long", "stream": True, "sampling_params": {"max_new_tokens": 60000}}).encode()
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        first = s.recv(4096)
        assert first.startswith(b"HTTP/1.1 200 OK")
    wait_for(lambda: aborted() == before + 1, 10, "the abort to be counted")
    r = client.post("/generate", json={"text": "next", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4


def test_flush_cache_refuses_while_requests_run(server, client):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        body = json.dumps({"text": "busy", "stream": True, "sampling_params": {"max_new_tokens": 60000}}).encode()
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        assert s.recv(4096).startswith(b"HTTP/1.1 200 OK")
        r = client.post("/flush_cache")
        assert r.status_code == 400
    deadline = time.monotonic() + 10
    while client.post("/flush_cache").status_code != 200:
        assert time.monotonic() < deadline, "the aborted request never left the scheduler"
        time.sleep(0.02)
