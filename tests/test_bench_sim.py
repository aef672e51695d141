"""`dynctl bench` against the simulated SGLang host: the GPU table's numbers, the crossover, the generator's cost.

The simulator runs at --time-scale 1, the speed of the H200 its table was measured on (sglang 0.5.12.post1,
2026-11-30), and the sweeps ask for what the GPU run's did: prompts of 65 tokens and 128 new tokens. The
expected tok/s are that table's, copied (dynctl/sim/gpu_table.json, sweeps nospec, eagle3 and skip-t0).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_cli import make_app, write_config
from sim_harness import SPEC_ARGS, Sim
from typer.testing import CliRunner

pytestmark = [pytest.mark.slow, pytest.mark.alone]


SIM_LAUNCH = ["{python}", "-m", "dynctl.sim"]  # the servers these tests start, as dynctl would

TIME_SCALE = 1.0
GPU_RUN = (65, 128)  # prompt tokens, new tokens
# bench starts a level's streams together, so plain-decoding streams of one length run in lockstep on the
# simulator and their HTTP round trips idle it at once: measured here 4.6 % below the table at 256 (nospec),
# within 1 % elsewhere.
TOLERANCE = 0.12
# The servers stream every 8th token. At 256 streams and one token a chunk the simulator and the load generator
# (75 % of a core) share two cores with 21,000 chunks a second, and a busy machine measured plain decoding
# 10-17 % below the table; every 8th token takes the generator to 17 % of a core and measures the same tok/s
# run after run. tok/s and the servers' counters do not depend on it.
STREAM_INTERVAL = "8"


def start(site: Path, workdir: Path, *extra: str) -> Sim:
    argv = ["--time-scale", str(TIME_SCALE), "--sim-load-seconds", "0", "--model-path", "/models/sim-bench",
            "--enable-metrics", "--max-running-requests", "256", "--stream-interval", STREAM_INTERVAL, *extra]
    return Sim(site, argv, workdir, env={"SGLANG_ENABLE_SPEC_V2": "1"}).wait_ready(60)


@pytest.fixture(scope="module")
def plain_sim(patched_site_059, tmp_path_factory):  # noqa: F811 - the fixture
    sim = start(patched_site_059, tmp_path_factory.mktemp("plain"))
    try:
        yield sim
    finally:
        sim.stop()


@pytest.fixture(scope="module")
def eagle_sim(patched_site_059, tmp_path_factory):  # noqa: F811 - the fixture
    sim = start(patched_site_059, tmp_path_factory.mktemp("eagle"), *SPEC_ARGS,
                "--speculative-disable-batch-threshold", "5")
    try:
        yield sim
    finally:
        sim.stop()


def bench(tmp_path: Path, port: int, *args: str, lengths: tuple[int, int] = GPU_RUN) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(make_app(), [
        "bench", "--config", str(write_config(tmp_path, port, launch=SIM_LAUNCH)), "--input-len", str(lengths[0]),
        "--output-len", str(lengths[1]), "--json", str(out), "--no-chart", *args])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def tok_s(doc: dict) -> float:
    [level] = doc["runs"][0]["levels"]
    return level["output_throughput"] / TIME_SCALE


def test_sweep_matches_the_gpu_table_at_1_and_256(plain_sim, eagle_sim, tmp_path):
    one = ("--concurrency", "1", "--duration", "3")
    many = ("--concurrency", "256", "--duration", "3")
    plain_1 = bench(tmp_path / "p1", plain_sim.port, *one)
    plain_256 = bench(tmp_path / "p256", plain_sim.port, *many)
    eagle_1 = bench(tmp_path / "e1", eagle_sim.port, *one, "--threshold", "-1")
    eagle_256 = bench(tmp_path / "e256", eagle_sim.port, *many, "--threshold", "-1")
    assert tok_s(plain_1) == pytest.approx(247.4, rel=TOLERANCE)
    assert tok_s(plain_256) == pytest.approx(21565.3, rel=TOLERANCE)
    assert tok_s(eagle_1) == pytest.approx(439.6, rel=TOLERANCE)
    assert tok_s(eagle_256) == pytest.approx(11659.4, rel=TOLERANCE)
    assert tok_s(eagle_1) > tok_s(plain_1) and tok_s(eagle_256) < tok_s(plain_256) * 0.6  # the GPU's finding
    for doc in (plain_256, eagle_256):
        [top] = doc["runs"][0]["levels"]
        # the decode batch runs a little below C: finished requests wait for their successors' prefill
        assert top["failed"] == 0 and 256 * 0.85 < top["server"]["mean_batch_size"] <= 256 * 1.01
        # the generator is not the bottleneck: below the 80 % of a core where bench warns about it
        assert top["loadgen"]["cpu_percent"] < 80
    [spec_top] = eagle_256["runs"][0]["levels"]
    # speculating at every step with the table's accept length (2.97)
    assert spec_top["server"]["spec_on_share"] == 1.0 and spec_top["accept_length"] == pytest.approx(2.97, abs=0.2)


def test_compare_recommends_the_threshold_the_gpu_run_recommended(eagle_sim, tmp_path):
    """On the H200, EAGLE-3 beat the patched server's disabled steps at 8 streams (1922 vs 1764 tok/s) and lost
    at 16 (3225 vs 3461): the run recommended threshold 8, and so must bench on its simulation."""
    doc = bench(tmp_path, eagle_sim.port, "--concurrency", "4,8,16", "--duration", "2", "--compare")
    rec = doc["recommendation"]
    assert rec["threshold"] == 8, rec
    assert rec["crossover"] == {"last_spec_win": 8, "first_no_spec_win": 16}
    spec_share = {r["mode"]: [lv["server"]["spec_on_share"] for lv in r["levels"]] for r in doc["runs"]}
    assert spec_share == {"no-spec": [0.0] * 3, "always-spec": [1.0] * 3}
    assert doc["threshold_before"] == 5
    info = eagle_sim.client().get("/server_info").json()
    assert info["internal_states"][0]["speculative_disable_batch_threshold"] == 5  # put back
