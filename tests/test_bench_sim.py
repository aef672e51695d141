"""`dynctl bench` against the simulated SGLang host: calibration, crossover, and the generator's own cost.

The simulator runs --time-scale faster than the calibrated box, so every tok/s it serves is time_scale times
the calibrated figure (dynctl/sim/options.py); the expectations come from its cost model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_cli import make_app, write_config
from test_sim_harness import SPEC_ARGS, Sim, patched_site_059  # noqa: F401 - fixture
from typer.testing import CliRunner

from dynctl.sim.costmodel import (
    PLAIN,
    SEED_EAGLE3_TOK_S,
    SEED_NOSPEC_TOK_S,
    SKIP,
    SPECULATE,
    Hardware,
    steady_throughput,
)

TIME_SCALE = 10.0


def start(site: Path, workdir: Path, *extra: str) -> Sim:
    argv = ["--time-scale", str(TIME_SCALE), "--sim-load-seconds", "0", "--model-path", "/models/sim-bench",
            "--enable-metrics", "--max-running-requests", "256", *extra]
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


def bench(tmp_path: Path, port: int, *args: str, lengths: tuple[int, int] = (32, 32)) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(make_app(), [
        "bench", "--config", str(write_config(tmp_path, port)), "--input-len", str(lengths[0]),
        "--output-len", str(lengths[1]), "--json", str(out), "--no-chart", *args])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def tok_s(doc: dict) -> float:
    [level] = doc["runs"][0]["levels"]
    return level["output_throughput"] / TIME_SCALE


def test_sweep_matches_the_calibration_at_1_and_250(plain_sim, eagle_sim, tmp_path):
    """Long answers at concurrency 1 keep per-request costs (prefill, a speculative step's overshoot) small;
    at 250 the batch amortises them and short answers keep the level short."""
    hw = Hardware()
    one = ("--concurrency", "1", "--duration", "2")
    many = ("--concurrency", "250", "--duration", "2")
    plain_1 = bench(tmp_path / "p1", plain_sim.port, *one, lengths=(32, 128))
    plain_250 = bench(tmp_path / "p250", plain_sim.port, *many)
    eagle_1 = bench(tmp_path / "e1", eagle_sim.port, *one, "--threshold", "-1", lengths=(32, 128))
    eagle_250 = bench(tmp_path / "e250", eagle_sim.port, *many, "--threshold", "-1")
    assert tok_s(plain_250) == pytest.approx(SEED_NOSPEC_TOK_S, rel=0.10)
    assert tok_s(eagle_250) == pytest.approx(SEED_EAGLE3_TOK_S, rel=0.10)
    assert tok_s(plain_1) == pytest.approx(steady_throughput(hw, 1, PLAIN), rel=0.10)
    assert tok_s(eagle_1) == pytest.approx(steady_throughput(hw, 1, SPECULATE), rel=0.10)
    assert tok_s(eagle_1) > tok_s(plain_1) and tok_s(eagle_250) < tok_s(plain_250) / 2  # the seed's finding
    for doc in (plain_250, eagle_250):
        [top] = doc["runs"][0]["levels"]
        # the decode batch runs a little below C: finished requests wait for their successors' prefill
        assert top["failed"] == 0 and 250 * 0.85 < top["server"]["mean_batch_size"] <= 250 * 1.01
        # the generator is not the bottleneck: 250 streams at 10x the box's speed cost it a fraction of a core
        assert top["loadgen"]["cpu_percent"] < 50
    [spec_top] = eagle_250["runs"][0]["levels"]
    # speculating at every step, several tokens per step (short answers cut the last step's acceptance)
    assert spec_top["server"]["spec_on_share"] == 1.0 and 1.8 < spec_top["accept_length"] <= 4.0


def test_compare_recommends_the_threshold_where_the_modes_cross(eagle_sim, tmp_path):
    hw = Hardware()
    levels = (1, 2, 4)  # the model's margins there: +35 %, +8 %, -15 % (speculation vs no-spec steps)
    doc = bench(tmp_path, eagle_sim.port, "--concurrency", ",".join(map(str, levels)), "--duration", "1.5",
                "--compare")
    # Where the cost model says speculation beats the patched server's no-spec steps (plain + draft extend)
    wins = [c for c in levels if steady_throughput(hw, c, SPECULATE) > steady_throughput(hw, c, SKIP)]
    expected = max(c for c in levels if all(x in wins for x in levels if x <= c))
    rec = doc["recommendation"]
    assert rec["threshold"] == expected
    assert rec["crossover"]["first_no_spec_win"] == min(c for c in levels if c > expected)
    spec_share = {r["mode"]: [lv["server"]["spec_on_share"] for lv in r["levels"]] for r in doc["runs"]}
    assert spec_share == {"no-spec": [0.0] * 3, "always-spec": [1.0] * 3}
    assert doc["threshold_before"] == 5
    info = eagle_sim.client().get("/server_info").json()
    assert info["internal_states"][0]["speculative_disable_batch_threshold"] == 5  # put back
