"""The simulator's pure parts: the calibrated cost model, the speculation policies, options, log formats."""

from __future__ import annotations

import random
import re

import pytest

from dynctl.sim import costmodel
from dynctl.sim.costmodel import PLAIN, SKIP, SPECULATE, Hardware, steady_throughput
from dynctl.sim.loglines import decode_batch_line, prefill_batch_line
from dynctl.sim.options import OptionError, split_sim_options
from dynctl.sim.speculation import AdaptiveSpeculation, captured_batch_sizes

HW = Hardware()
LEVELS = [1, 2, 4, 8, 16, 32, 64, 128, 250, 256]


def test_calibration_matches_the_seed_measurements_at_250():
    nospec = steady_throughput(HW, 250, PLAIN)
    eagle3 = steady_throughput(HW, 250, SPECULATE)
    assert nospec == pytest.approx(costmodel.SEED_NOSPEC_TOK_S, rel=0.01)
    assert eagle3 == pytest.approx(costmodel.SEED_EAGLE3_TOK_S, rel=0.01)


def test_speculation_wins_only_at_concurrency_1():
    ratios = {b: steady_throughput(HW, b, SPECULATE) / steady_throughput(HW, b, PLAIN) for b in LEVELS}
    assert ratios[1] > 1.1
    assert all(ratios[b] < 1.0 for b in LEVELS if b >= 2), ratios


def test_a_threshold_step_costs_little_more_than_no_speculation():
    """The patch's disabled steps (eager decode + one draft extend) stay within 6 % of plain decoding."""
    for b in (64, 128, 250):
        skip = b / costmodel.decode_step_seconds(HW, b, SKIP)
        assert 0.94 * steady_throughput(HW, b, PLAIN) < skip < steady_throughput(HW, b, PLAIN)


def test_accept_length_draws_match_the_expectation():
    rng = random.Random(7)
    draws = [costmodel.draw_accepted_drafts(rng, 0.7, 3) for _ in range(20000)]
    assert 1 + sum(draws) / len(draws) == pytest.approx(costmodel.expected_accept_length(0.7, 3), rel=0.02)
    assert set(draws) == {0, 1, 2, 3}


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
