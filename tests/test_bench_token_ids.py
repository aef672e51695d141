"""`dynctl bench` against a server without a tokenizer (`--skip-tokenizer-init`), as benchmark hosts run.

Such a server refuses text prompts, so the load generator sends token ids to sglang's native /generate
and counts tokens from its streamed meta_info; the simulated host refuses text exactly as sglang does.
"""

from __future__ import annotations

import json

import httpx
import pytest
from test_bench_cli import make_app, write_config
from sim_harness import Sim
from typer.testing import CliRunner

SIM_LAUNCH = ["{python}", "-m", "dynctl.sim"]  # the servers these tests start, as dynctl would


@pytest.fixture(scope="module")
def tokenless_sim(patched_site_059, tmp_path_factory):  # noqa: F811 - the fixture
    argv = ["--time-scale", "10", "--sim-load-seconds", "0", "--model-path", "/models/sim-tokenless",
            "--enable-metrics", "--skip-tokenizer-init"]
    sim = Sim(patched_site_059, argv, tmp_path_factory.mktemp("tokenless")).wait_ready(60)
    try:
        yield sim
    finally:
        sim.stop()


@pytest.mark.slow
def test_bench_sends_token_ids_to_a_server_without_a_tokenizer(tokenless_sim, tmp_path):
    # the server really takes no text: what a completions-based generator would have sent fails
    refused = httpx.post(f"{tokenless_sim.url}/generate", json={"text": "hello", "sampling_params": {}})
    assert refused.status_code == 400 and "skip_tokenizer_init=True" in refused.text
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(make_app(), [
        "bench", "--config", str(write_config(tmp_path, tokenless_sim.port, launch=SIM_LAUNCH)), "--concurrency", "1,4",
        "--duration", "1.5", "--input-len", "16", "--output-len", "24", "--json", str(out), "--no-chart"])
    assert result.exit_code == 0, result.output
    levels = json.loads(out.read_text())["runs"][0]["levels"]
    assert [lv["max_concurrency"] for lv in levels] == [1, 4]
    for lv in levels:
        assert lv["failed"] == 0 and lv["completed"] > 0
        # every completed request ran to its full length (requests cut at the window end add their part)
        assert lv["total_output_tokens"] >= 24 * lv["completed"]
        assert lv["output_throughput"] > 0 and lv["mean_ttft_ms"] > 0
