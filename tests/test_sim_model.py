"""The simulator's pure parts: the cost model on the GPU table, the speculation policies, options, log formats."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path
from importlib import resources

import pytest

from dynctl.sim import costmodel
from dynctl.sim.costmodel import PLAIN, SKIP, SPECULATE, TableError
from dynctl.sim.loglines import decode_batch_line, prefill_batch_line
from dynctl.sim.options import OptionError, split_sim_options
from dynctl.sim.speculation import AdaptiveSpeculation, captured_batch_sizes

COSTS = costmodel.load_table()


def closed_loop_tok_s(costs: costmodel.StepCosts, concurrency: int, kind: str, prompt_tokens: float,
                      new_tokens: int) -> float:
    """Decode tokens per simulated second of `concurrency` streams that each ask for `new_tokens`
    after a prompt of `prompt_tokens` (the first new token comes from the prefill)."""
    per_step = concurrency * (costs.accept_length if kind == SPECULATE else 1.0)
    prefill_per_step = per_step / (new_tokens - 1) * costs.prefill_step_seconds(prompt_tokens)
    return per_step / (costs.decode_step_seconds(concurrency, kind) + prefill_per_step)
# The GPU run's workload: prompts of 65 tokens on average, 128 new tokens.
WORKLOAD = (65.031, 128)


def test_the_shipped_table_is_the_h200_run():
    assert COSTS.source["sglang"] == "0.5.12.post1" and COSTS.source["date"] == "2026-11-30"
    assert "H200" in COSTS.source["gpu"] and "5.9 B" in COSTS.source["model"]["target"]
    assert (COSTS.steps, COSTS.draft_tokens) == (3, 4)
    assert COSTS.label == "1 x NVIDIA H200 (141 GB), sglang 0.5.12.post1, 2026-11-30"


@pytest.mark.parametrize("kind, expected", [
    # the H200 table's tok/s (sweeps nospec, eagle3) at concurrency 1, 8, 64, 256
    (PLAIN, {1: 247.4, 8: 1859.7, 64: 11728.7, 256: 21565.3}),
    (SPECULATE, {1: 439.6, 8: 1922.5, 64: 8282.2, 256: 11659.4}),
])
def test_a_closed_loop_on_the_model_serves_the_tables_tok_s(kind, expected):
    """Decode steps plus the prefills of the requests they finish, at the measured workload."""
    for c, tok_s in expected.items():
        assert closed_loop_tok_s(COSTS, c, kind, *WORKLOAD) == pytest.approx(tok_s, rel=0.001), (kind, c)


def test_a_disabled_step_costs_the_plain_step_times_its_measured_step_ratio():
    """The disabled rows come from the per-step measurement of the current patch on the same shape."""
    steady = json.loads((Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "results"
                         / "0.5.12.post1-5.9b-steady.json").read_text())["summary"]
    ratios = dict(zip(steady["levels"], steady["step_ratio_vs_no_spec"]["threshold_0"]))
    for batch, ratio in ratios.items():
        assert COSTS.decode_step_seconds(batch, SKIP) == pytest.approx(
            COSTS.decode_step_seconds(batch, PLAIN) * ratio, rel=1e-4), batch


def test_decode_steps_are_cheaper_than_the_measured_step_ms_by_the_prefills():
    """step_ms counts prefill passes too; the model's decode step must not charge them a second time."""
    assert COSTS.decode_step_seconds(256, PLAIN) * 1000 == pytest.approx(8.95, abs=0.01)  # step_ms 10.23
    assert COSTS.decode_step_seconds(1, PLAIN) * 1000 == pytest.approx(4.03, abs=0.01)  # step_ms 4.012
    assert COSTS.prefill_step_seconds(1000) == pytest.approx(0.0223, abs=0.0001)


def test_costs_between_measured_batches_are_interpolated_and_beyond_them_extrapolated():
    at = {b: COSTS.decode_step_seconds(b, PLAIN) for b in (128, 192, 256, 384)}
    assert at[192] == pytest.approx((at[128] + at[256]) / 2)
    assert at[384] - at[256] == pytest.approx(at[256] - at[128])  # along the last measured segment
    assert COSTS.decode_step_seconds(0, PLAIN) == 0.0
    plain, spec = (COSTS.decode_step_seconds(3, kind) for kind in (PLAIN, SPECULATE))
    # another speculative shape: the measured overhead over a plain step, scaled by steps + draft tokens
    assert COSTS.decode_step_seconds(3, SPECULATE, 7, 8) == pytest.approx(plain + (spec - plain) * 15 / 7)
    assert COSTS.decode_step_seconds(3, SPECULATE, 3, 4) == spec


def test_speculation_beats_the_patchs_disabled_steps_up_to_8_and_loses_from_16():
    """The GPU run recommended threshold 8: EAGLE-3 ahead at 1-8 streams, behind from 16 on."""
    ratio = {c: closed_loop_tok_s(COSTS, c, SPECULATE, *WORKLOAD) / closed_loop_tok_s(COSTS, c, SKIP, *WORKLOAD)
             for c in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    assert all(ratio[c] > 1.02 for c in (1, 2, 4, 8)), ratio
    assert all(ratio[c] < 0.95 for c in (16, 32, 64, 128, 256)), ratio


def test_accept_length_draws_match_the_table():
    rate = COSTS.accept_rate
    assert costmodel.expected_accept_length(rate, 3) == pytest.approx(2.974, abs=0.001)
    rng = random.Random(7)
    draws = [costmodel.draw_accepted_drafts(rng, rate, 3) for _ in range(20000)]
    assert 1 + sum(draws) / len(draws) == pytest.approx(2.974, rel=0.02)
    assert set(draws) == {0, 1, 2, 3}


def test_a_broken_table_names_the_file_and_the_part(tmp_path):
    doc = json.loads((resources.files("dynctl.sim") / costmodel.TABLE_FILE).read_text())
    del doc["kinds"]["skip"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TableError, match=r"t\.json: not a step-cost table \(KeyError: 'skip'\)"):
        costmodel.load_table(str(path))
    doc = json.loads((resources.files("dynctl.sim") / costmodel.TABLE_FILE).read_text())
    doc["kinds"]["plain"]["rows"][0]["decode_ms"] = 0
    path.write_text(json.dumps(doc))
    with pytest.raises(TableError, match="kinds.plain.rows must have distinct batches and positive decode_ms"):
        costmodel.load_table(str(path))
    path.write_text("{")
    with pytest.raises(TableError, match=r"t\.json: line 1: Expecting"):
        costmodel.load_table(str(path))


def test_captured_batch_sizes_follow_server_args_generation():
    spec = captured_batch_sizes({"speculative_algorithm": "EAGLE3", "cuda_graph_max_bs": 512,
                                 "max_running_requests": 48})
    assert spec[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12] and spec[-1] == 48
    plain = captured_batch_sizes({"speculative_algorithm": None, "cuda_graph_max_bs": 256})
    assert plain[:6] == [1, 2, 4, 8, 12, 16] and plain[-1] == 256


def test_adaptive_routing_pads_to_a_captured_size_then_takes_the_largest_key(tmp_path):
    config = tmp_path / "c.json"
    config.write_text('{"1": {"candidate_steps": [3]}, "10": {"candidate_steps": [0]}}')
    args = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "cuda_graph_max_bs": 64,
            "max_running_requests": 64, "speculative_adaptive_config": str(config)}
    adaptive = AdaptiveSpeculation(args, {})
    assert adaptive.decide(8).kind == SPECULATE
    assert adaptive.decide(9).kind == SKIP  # 9 pads to the captured 10, which routes to the "10" slot
    assert adaptive.decide(9).draft_tokens == 1
    assert adaptive.decide(100).kind == SKIP  # above every captured size: not padded


def test_adaptive_config_errors_name_the_problem(tmp_path):
    config = tmp_path / "c.json"
    config.write_text('{"1": {"candidate_steps": [-1]}}')
    with pytest.raises(ValueError, match="candidate_steps must be a list of non-negative ints"):
        AdaptiveSpeculation({"speculative_adaptive_config": str(config)}, {})


def test_sim_options_come_from_flags_or_environment():
    options, rest = split_sim_options(["--time-scale", "5", "--model-path", "/m", "--sim-ignore-sigterm"],
                                      {"DYNCTL_SIM_CRASH_AFTER": "3", "DYNCTL_SIM_TIME_SCALE": "9"})
    assert rest == ["--model-path", "/m"]
    assert options.time_scale == 5 and options.ignore_sigterm and options.crash_after == 3
    with pytest.raises(OptionError, match="DYNCTL_SIM_SLOW_HEALTH: expected float"):
        split_sim_options([], {"DYNCTL_SIM_SLOW_HEALTH": "soon"})
    with pytest.raises(OptionError, match="--time-scale must be > 0"):
        split_sim_options(["--time-scale", "0"], {})


def test_decode_and_prefill_lines_are_sglangs_format():
    line = decode_batch_line(running=64, used_tokens=81234, token_usage=0.12, accept=(2.714, 0.678),
                             cuda_graph=True, gen_throughput=4321.0, queued=0)
    assert line == ("Decode batch, #running-req: 64, #token: 81234, token usage: 0.12, accept len: 2.71, "
                    "accept rate: 0.68, cuda graph: True, gen throughput (token/s): 4321.00, #queue-req: 0")
    assert "accept len" not in decode_batch_line(running=1, used_tokens=1, token_usage=0, accept=None,
                                                 cuda_graph=False, gen_throughput=0, queued=3)
    prefill = prefill_batch_line(new_seqs=2, new_tokens=30, cached_tokens=0, token_usage=0.01, running=5, queued=1,
                                 input_throughput=12.5, cuda_graph=False)
    assert re.fullmatch(r"Prefill batch, #new-seq: 2, #new-token: 30, #cached-token: 0, token usage: 0\.01, "
                        r"#running-req: 5, #queue-req: 1, input throughput \(token/s\): 12\.50, cuda graph: False",
                        prefill)


def test_disabled_steps_run_on_the_patchs_graphs_when_the_flag_was_given_at_startup():
    from dynctl.agent import archive
    from dynctl.sim.speculation import ThresholdSpeculation

    spec = importlib.util.spec_from_file_location("policy_for_sim", archive.patches_dir() / "spec_batch_threshold.py")
    policy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(policy)
    base = {"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 1, "cuda_graph_max_bs": 256}
    at_start = ThresholdSpeculation(dict(base, speculative_disable_batch_threshold=4), policy, {}, None)
    plan = at_start.decide(16)
    assert (plan.kind, plan.cuda_graph) == (SKIP, True)
    assert at_start.decide(300).cuda_graph is False  # above the largest captured batch size
    # started without the flag (it is None), set live later: the patch captured nothing, so eagerly
    later = ThresholdSpeculation(dict(base, speculative_disable_batch_threshold=None), policy, {}, None)
    later.set_threshold(4)
    assert (later.decide(16).kind, later.decide(16).cuda_graph) == (SKIP, False)
