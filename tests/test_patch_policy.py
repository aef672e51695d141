"""The policy module that goes into sglang, imported by file path on CPU (stdlib only, no torch)."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynctl.agent import archive

MODULE_PATH = archive.patches_dir() / "spec_batch_threshold.py"


def load_module(path: Path = MODULE_PATH) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("spec_batch_threshold_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sbt = load_module()


def test_imports_with_the_standard_library_only() -> None:
    code = (
        "import importlib.util, sys\n"
        "before = set(sys.modules)\n"
        f"spec = importlib.util.spec_from_file_location('m', {str(MODULE_PATH)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "new = sorted(n.split('.')[0] for n in set(sys.modules) - before)\n"
        "third = [n for n in new if n not in sys.stdlib_module_names and n != 'm']\n"
        "print(third)\n"
        "assert m.SpecDisablePolicy(3).decide(4).speculate is False\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --------------------------------------------------------------------------- validate_threshold


@pytest.mark.parametrize("value", [None, -1, 0, 1, 5, 48, 10**9])
def test_valid_thresholds(value: object) -> None:
    assert sbt.validate_threshold(value) == value


@pytest.mark.parametrize(("value", "message"), [
    (-2, ">= -1"), (-100, ">= -1"), (True, "type bool"), (False, "type bool"), (1.0, "type float"),
    ("5", "type str"), ("abc", "type str"), ([5], "type list"),
])
def test_invalid_thresholds(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        sbt.validate_threshold(value)
    assert "speculative_disable_batch_threshold" in str(err.value)


# --------------------------------------------------------------------------- decisions and transitions


def test_decisions_transitions_and_counters() -> None:
    policy = sbt.SpecDisablePolicy(5)
    assert policy.enabled is True and policy.disabled_steps == 0 and policy.threshold == 5
    steps = [(1, True, None), (5, True, None),
             (7, False, "Speculation disabled: batch size 7 > threshold 5"),
             (9, False, None), (6, False, None),
             (5, True, "Speculation enabled: batch size 5 <= threshold 5"),
             (3, True, None), (6, False, "Speculation disabled: batch size 6 > threshold 5")]
    for bs, speculate, transition in steps:
        decision = policy.decide(bs)
        assert decision == sbt.Decision(speculate, transition), bs
        assert policy.enabled is speculate
    assert policy.disabled_steps == 4


def test_threshold_changes_at_runtime() -> None:
    policy = sbt.SpecDisablePolicy(None)
    assert policy.decide(500) == (True, None)
    policy.threshold = 8
    assert policy.decide(9) == (False, "Speculation disabled: batch size 9 > threshold 8")
    policy.threshold = 16
    assert policy.decide(9) == (True, "Speculation enabled: batch size 9 <= threshold 16")
    policy.threshold = 4
    assert policy.decide(9).speculate is False
    policy.threshold = -1  # never disable: speculation comes back on the next step
    assert policy.decide(9) == (True, "Speculation enabled: batch size 9, threshold off")
    assert policy.disabled_steps == 2
    with pytest.raises(ValueError):
        policy.threshold = -5
    assert policy.threshold == -1  # a rejected value leaves the old one


def test_threshold_zero_never_speculates() -> None:
    policy = sbt.SpecDisablePolicy(0)
    assert policy.decide(1) == (False, "Speculation disabled: batch size 1 > threshold 0")
    assert all(not policy.decide(bs).speculate for bs in range(1, 50))


@pytest.mark.parametrize("bad", [-1, 2.0, "3", None, True])
def test_batch_size_must_be_a_count(bad: object) -> None:
    with pytest.raises(ValueError, match="batch size"):
        sbt.SpecDisablePolicy(5).decide(bad)


@given(st.lists(st.tuples(st.integers(-1, 64) | st.none(), st.integers(0, 128)), max_size=60))
def test_decide_matches_the_rule_for_any_sequence(steps: list[tuple[int | None, int]]) -> None:
    policy = sbt.SpecDisablePolicy(None)
    state, disabled = True, 0
    for threshold, bs in steps:
        policy.threshold = threshold
        decision = policy.decide(bs)
        expected = threshold is None or threshold < 0 or bs <= threshold
        assert decision.speculate is expected
        assert (decision.transition is not None) == (expected != state)
        if decision.transition:
            assert decision.transition.startswith("Speculation enabled: " if expected else "Speculation disabled: ")
            assert f"batch size {bs}" in decision.transition
        state = expected
        disabled += not expected
        assert policy.enabled is state and policy.disabled_steps == disabled


# --------------------------------------------------------------------------- when it may arm


def server_args(**overrides: object) -> types.SimpleNamespace:
    base = {"speculative_algorithm": "EAGLE3", "disable_overlap_schedule": False, "speculative_eagle_topk": 1,
            "enable_dp_attention": False, "enable_multi_layer_eagle": False, "enable_two_batch_overlap": False,
            "enable_pdmux": False, "speculative_disable_batch_threshold": 5, "max_running_requests": 48}
    base.update(overrides)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize(("overrides", "reason"), [
    ({}, None),
    ({"speculative_algorithm": "EAGLE"}, None),
    ({"speculative_algorithm": None}, "speculative decoding is off"),
    ({"speculative_algorithm": "NGRAM"}, "speculative_algorithm=NGRAM (only EAGLE and EAGLE3"),
    ({"speculative_algorithm": "STANDALONE"}, "speculative_algorithm=STANDALONE"),
    ({"disable_overlap_schedule": True}, "spec v2 is not in use"),
    ({"speculative_eagle_topk": 4}, "speculative_eagle_topk=4 (only topk=1"),
    ({"enable_dp_attention": True}, "DP attention is enabled"),
    ({"enable_multi_layer_eagle": True}, "enable_multi_layer_eagle=True"),
    ({"enable_two_batch_overlap": True}, "enable_two_batch_overlap=True"),
    ({"enable_pdmux": True}, "enable_pdmux=True"),
    ({"speculative_adaptive": True}, "speculative_adaptive=True"),
])
def test_unsupported_reason(overrides: dict, reason: str | None) -> None:
    got = sbt.unsupported_reason(server_args(**overrides))
    assert got == reason if reason is None else reason in got


def test_startup_check_logs_one_line_when_it_cannot_arm(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=sbt.logger.name):
        sbt.check_threshold_args(server_args(disable_overlap_schedule=True))
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith(
        "speculative_disable_batch_threshold=5 is not armed: spec v2 is not in use")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=sbt.logger.name):
        sbt.check_threshold_args(server_args(max_running_requests=5))
    assert "never fires: max_running_requests=5" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=sbt.logger.name):
        sbt.check_threshold_args(server_args())
        sbt.check_threshold_args(server_args(speculative_disable_batch_threshold=-1, speculative_algorithm=None))
    assert caplog.records == []
    with pytest.raises(ValueError, match=">= -1"):
        sbt.check_threshold_args(server_args(speculative_disable_batch_threshold=-2))


# --------------------------------------------------------------------------- metrics


def test_metrics_names_labels_and_values() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    labels = {"model_name": "m", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}
    metrics = sbt.SpecDisableMetrics(labels, registry=registry)
    policy = sbt.SpecDisablePolicy(5)

    def sample(name: str) -> float | None:
        return registry.get_sample_value(name, {k: str(v) for k, v in labels.items()})

    metrics.observe(policy, policy.decide(3))
    assert sample("sglang:spec_enabled") == 1 and sample("sglang:spec_disable_threshold") == 5
    assert sample("sglang:spec_disabled_steps_total") == 0
    for bs in (7, 8, 9):
        metrics.observe(policy, policy.decide(bs))
    assert sample("sglang:spec_enabled") == 0 and sample("sglang:spec_disabled_steps_total") == 3
    policy.threshold = -1
    metrics.observe(policy, policy.decide(9))
    assert sample("sglang:spec_enabled") == 1 and sample("sglang:spec_disable_threshold") == -1
    text = generate_latest(registry).decode()
    assert 'sglang:spec_disabled_steps_total{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",' \
           'tp_rank="0"} 3.0' in text
    assert "# TYPE sglang:spec_enabled gauge" in text and "# TYPE sglang:spec_disable_threshold gauge" in text


# --------------------------------------------------------------------------- the draft while disabled


@pytest.mark.parametrize(("environ", "mode"), [
    ({}, "auto"), ({"SGLANG_SPEC_THRESHOLD_DRAFT": "skip"}, "skip"),
    ({"SGLANG_SPEC_THRESHOLD_DRAFT": " Extend "}, "extend"), ({"SGLANG_SPEC_THRESHOLD_DRAFT": "auto"}, "auto"),
])
def test_draft_mode_from_the_environment(environ: dict, mode: str) -> None:
    assert sbt.draft_mode(environ) == mode


def test_an_unknown_draft_mode_falls_back_to_auto_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert sbt.draft_mode({"SGLANG_SPEC_THRESHOLD_DRAFT": "cold"}) == "auto"
    assert "SGLANG_SPEC_THRESHOLD_DRAFT='cold' is not one of auto, extend, skip" in caplog.text


class _Param:
    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n


class _Model:
    def __init__(self, **params: int) -> None:
        self.params = params

    def named_parameters(self):
        return [(name.replace("__", "."), _Param(n)) for name, n in self.params.items()]


def test_weights_read_per_step_leave_out_the_embedding_tables() -> None:
    # an EAGLE-3 draft shares the target's embedding, whose rows are gathered, not read whole
    draft = _Model(model__embed_tokens__weight=131_072_000, fc__weight=50_331_648, lm_head__weight=131_072_000)
    assert sbt.weights_read_per_step(draft) == 50_331_648 + 131_072_000


@pytest.mark.parametrize(("mode", "draft", "target", "resolved"), [
    ("auto", 383_000_000, 5_770_000_000, "skip"),      # the H200 benchmark's 5.9 B target: 6.6 %
    ("auto", 424_000_000, 69_000_000_000, "extend"),   # a 70 B target with an 8 B-class draft: 0.6 %
    ("auto", 30, 1000, "extend"),                     # exactly the 3 % share
    ("auto", 31, 1000, "skip"),
    ("auto", 1, 0, "skip"),
    ("extend", 383_000_000, 5_770_000_000, "extend"),  # the operator's word wins
    ("skip", 1, 1_000_000, "skip"),
])
def test_auto_keeps_the_draft_warm_only_when_it_is_small(mode: str, draft: int, target: int, resolved: str) -> None:
    assert sbt.resolve_draft_mode(mode, draft, target) == resolved


class _Lens(list):
    """A host tensor of lengths, as far as known_seq_lens uses one (elementwise + 1)."""

    def __add__(self, other):
        return _Lens(x + other for x in self)


class _Future:
    def __init__(self, interval):
        self.interval = interval


def _draft(plain, interval=slice(1, 4)):
    draft = types.SimpleNamespace(future_indices=_Future(interval))
    if plain:
        draft._spec_disable_plain = True
    return draft


def _batch(n=3):
    return types.SimpleNamespace(seq_lens_cpu=_Lens(range(10, 10 + n)), reqs=[object()] * n)


def test_known_seq_lens_after_a_plain_step_are_the_host_copy_plus_one():
    assert sbt.known_seq_lens(_draft(True), _batch()) == [11, 12, 13]


@pytest.mark.parametrize(("draft", "batch"), [
    (_draft(False), _batch()),                      # a speculative step: accept lengths unknown on the host
    (_draft(True, interval=None), _batch()),        # merged with new requests since: their rows need no +1
    (types.SimpleNamespace(_spec_disable_plain=True, future_indices=None), _batch()),
    (_draft(True), types.SimpleNamespace(seq_lens_cpu=None, reqs=[])),
])
def test_known_seq_lens_reads_back_whenever_the_rows_are_not_the_plain_steps(draft, batch):
    assert sbt.known_seq_lens(draft, batch) is None
