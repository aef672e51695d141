"""Native strategy (sglang ≥ 0.5.14): the generated adaptive config, checked with the release's own code.

sglang's adaptive_spec_params.py (config loading, batch-size routing, step adaptation) and the
launch-time check in arg_groups/speculative_hook.py are pure Python but sit in modules that import
torch; `dynctl.core.native.exec_release_source` runs them from the wheel's source with only sglang's own
imports left out, so the release decides whether the config is valid and how each batch routes.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_trees import sglang_wheel

from dynctl.base.errors import PreflightError, UsageError
from dynctl.core.native import (
    exec_release_source,
    parse_launch_args,
    plan_native,
    spec_capture_batch_sizes,
    verify_with_release,
)

NATIVE_VERSIONS = ["0.5.14", "0.5.23"]
STEPS_ARGS = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4"]


@cache
def release_sources(version: str) -> tuple[str, str]:
    with zipfile.ZipFile(sglang_wheel(version)) as wheel:
        return (wheel.read("sglang/srt/speculative/adaptive_spec_params.py").decode(),
                wheel.read("sglang/srt/arg_groups/speculative_hook.py").decode())


@pytest.mark.parametrize("version", NATIVE_VERSIONS)
@pytest.mark.parametrize("threshold", [0, 1, 5, 8, 9, 31, 32, 33, 47, 48, 100, 256, 300])
def test_config_routes_every_batch_size_as_planned(version: str, threshold: int) -> None:
    plan = plan_native(threshold, args=STEPS_ARGS)
    verify_with_release(plan, *release_sources(version))
    sglang = exec_release_source(release_sources(version)[0], drop=("adaptive_unsupported_reason",))
    assert "DEFAULT_ADAPTIVE_CONFIG" in sglang  # the release's module really ran
    assert all(len(slot["candidate_steps"]) == 1 for slot in plan.config.values())  # pinned: no EMA moves


def test_the_config_text_and_flags() -> None:
    plan = plan_native(32, 3, config_path="/root/.dynctl/releases/0001/adaptive_spec.json")
    config, argv = plan.config_json, plan.argv
    assert json.loads(config) == {"1": {"candidate_steps": [3]}, "33": {"candidate_steps": [0]}}
    assert argv == ["--speculative-adaptive", "--speculative-adaptive-config",
                    "/root/.dynctl/releases/0001/adaptive_spec.json", "--speculative-eagle-topk", "1",
                    "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"]
    # the server args already say steps and topk: only the adaptive flags are added
    assert plan_native(32, args=STEPS_ARGS).argv == ["--speculative-adaptive", "--speculative-adaptive-config",
                                                      "adaptive_spec.json"]


def test_threshold_zero_keeps_the_configured_steps_among_the_candidates() -> None:
    plan = plan_native(0, 3)
    assert plan.config == {"0": {"candidate_steps": [3]}, "1": {"candidate_steps": [0]}}
    for version in NATIVE_VERSIONS:
        verify_with_release(plan, *release_sources(version))


def test_never_disable_means_no_adaptive_config() -> None:
    plan = plan_native(-1, 3)
    assert (plan.config_json, plan.argv) == (None, [])


@pytest.mark.parametrize(("threshold", "effective", "padded"), [(9, 8, 10), (33, 32, 40), (47, 44, 48), (100, 96, 104)])
def test_cuda_graph_padding_rounds_down_with_a_warning(threshold: int, effective: int, padded: int) -> None:
    plan = plan_native(threshold, 3)
    assert plan.effective_threshold == effective
    assert str(effective + 1) in plan.config
    assert len(plan.warnings) >= 1
    assert (f"threshold {threshold} is not a CUDA-graph batch size: sglang pads a batch of {threshold} requests "
            f"to {padded}") in plan.warnings[0]
    assert f"disabled above {effective} instead" in plan.warnings[0]


def test_explicit_cuda_graph_sizes_and_no_graphs() -> None:
    plan = plan_native(5, args=[*STEPS_ARGS, "--cuda-graph-bs", "1", "2", "4", "8", "16"])
    assert plan.captured_bs == [1, 2, 4, 8, 16] and plan.effective_threshold == 4
    verify_with_release(plan, *release_sources("0.5.23"))
    plan = plan_native(5, args=[*STEPS_ARGS, "--cuda-graph-bs-decode=6"])
    assert plan.captured_bs == [6] and plan.effective_threshold == 0  # every batch pads to 6 > 5
    plan = plan_native(5, args=[*STEPS_ARGS, "--disable-cuda-graph"])
    assert plan.captured_bs is None and plan.effective_threshold == 5 and plan.warnings == []
    verify_with_release(plan, *release_sources("0.5.14"))
    # batch sizes above the largest captured one are not padded: a threshold there is exact
    plan = plan_native(300, args=[*STEPS_ARGS, "--cuda-graph-max-bs", "256"])
    assert plan.captured_bs[-1] == 256 and plan.effective_threshold == 300
    verify_with_release(plan, *release_sources("0.5.23"))


def test_spec_capture_sizes_match_the_release_rule() -> None:
    """The list sglang generates for spec decoding (arg_groups/cuda_graph_hook.py in 0.5.23)."""
    with zipfile.ZipFile(sglang_wheel("0.5.23")) as wheel:
        hook = wheel.read("sglang/srt/arg_groups/cuda_graph_hook.py").decode()
    name = next(n for n in ("generate_decode_cuda_graph_batch_sizes", "_generate_decode_cuda_graph_batch_sizes")
                if f"def {n}(" in hook)
    ns = exec_release_source(hook, keep=(name,), stubs={"resolving_view": lambda sa: sa})
    for max_bs in (8, 48, 160, 256, 512):
        server_args = type("SA", (), {"disable_cuda_graph_padding": False, "speculative_algorithm": "EAGLE3"})()
        assert spec_capture_batch_sizes(max_bs) == sorted(ns[name](server_args, max_bs))


def test_max_running_requests_must_exceed_the_threshold() -> None:
    plan = plan_native(64, 3)
    assert plan.argv[-2:] == ["--max-running-requests", "136"]
    assert "would never fire" in plan.warnings[-1]
    plan = plan_native(16, args=[*STEPS_ARGS, "--max-running-requests", "16"])
    assert "--max-running-requests" not in plan.argv
    assert "speculation is never disabled" in plan.warnings[-1]
    assert plan_native(16, args=[*STEPS_ARGS, "--max-running-requests", "256"]).warnings == []


@pytest.mark.parametrize(("args", "error", "message"), [
    (["--speculative-eagle-topk", "4"], PreflightError, "needs topk 1"),
    (["--enable-dp-attention"], PreflightError, "does not support DP attention"),
    (["--speculative-algorithm", "NGRAM"], PreflightError, "EAGLE and EAGLE3 only"),
    (["--speculative-adaptive-config", "mine.json"], UsageError, "dynctl generates that file"),
    (["--speculative-num-steps", "two"], UsageError, "'two' is not an integer"),
    (["--max-running-requests"], UsageError, "needs a value"),
])
def test_launch_args_that_cannot_work_are_refused(args: list[str], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        plan_native(8, 3, args=args)


def test_bad_thresholds_and_steps() -> None:
    for bad in (-2, "abc", "1e3", 2_000_000):
        with pytest.raises(UsageError):
            plan_native(bad, 3)
    with pytest.raises(UsageError, match="steps must be an integer >= 1"):
        plan_native(8)
    with pytest.raises(UsageError, match="disagrees with --speculative-num-steps 3"):
        plan_native(8, 5, args=STEPS_ARGS)


def test_parse_launch_args_forms() -> None:
    got = parse_launch_args(["--tp", "8", "--speculative-num-steps=2", "--cuda-graph-bs", "4", "1", "2",
                             "--max-running-requests", "64", "--disable-cuda-graph-padding"])
    assert (got.steps, got.cuda_graph_bs, got.max_running_requests, got.disable_cuda_graph_padding) == \
        (2, (1, 2, 4), 64, True)


@pytest.mark.parametrize("version", NATIVE_VERSIONS)
def test_the_release_rejects_configs_that_are_wrong(version: str) -> None:
    """The check can fail: sglang's own rules refuse these."""
    good = plan_native(5, 3)
    cases = [
        ({"1": {"candidate_steps": [2]}, "6": {"candidate_steps": [0]}}, "--speculative-num-steps=3 is not in"),
        ({"1": {"candidate_steps": [3]}, "6": {"candidate_steps": [-1]}}, "non-negative ints"),
        ({"one": {"candidate_steps": [3]}}, "at least one integer-string"),
        ({"1": {"candidate_steps": [3]}, "9": {"candidate_steps": [0]}}, "the plan says 0"),
    ]
    for config, message in cases:
        with pytest.raises(PreflightError, match=message):
            verify_with_release(dataclasses.replace(good, config=config), *release_sources(version))


@settings(max_examples=40, deadline=None)
@given(threshold=st.integers(0, 600), steps=st.integers(1, 7), max_bs=st.none() | st.integers(1, 512))
def test_any_threshold_routes_as_planned(threshold: int, steps: int, max_bs: int | None) -> None:
    args = [] if max_bs is None else ["--cuda-graph-max-bs", str(max_bs)]
    plan = plan_native(threshold, steps, args=args)
    verify_with_release(plan, *release_sources("0.5.23"), max_batch=max(threshold * 2 + 2, 40))
