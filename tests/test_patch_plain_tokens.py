"""sglang 0.5.14 on: the scheduler's result of a plain-decode step, as patched, settles what the release's
own speculative result loop settles for a step of one token per request.

Each release's patched SchedulerBatchResultProcessor._resolve_spec_v2_tokens (the plain step marked on
its result, so it answers through spec_batch_threshold.plain_step_tokens) runs next to the release's own
(taken from the wheel, with the helpers it calls) on the same stand-in requests, laid out as that release
keeps their committed length, some finished or retracted, with empty and filled histograms. Both must
return the same tokens and leave the same lengths, verify counts, histograms, result fields and
adaptive-controller calls. A batch whose result is not marked (a grammar request in it) keeps the
release's loop.
"""

from __future__ import annotations

import ast
import random
import re
import types

import pytest
from test_patch_plain_slots import install_policy
from test_patch_resolving import _class_of, _definitions, _patched, _run, _wheel_text

RELEASES = ["0.5.14", "0.5.15", "0.5.16", "0.5.17", "0.5.19", "0.5.20", "0.5.23"]
PROCESSOR = "srt/managers/scheduler_components/batch_result_processor.py"
METHODS = {"_resolve_spec_v2_tokens", "_accept_grammar_tokens", "advance_grammar_fsm"}
RESULT_FIELDS = ("num_correct_drafts", "num_correct_drafts_per_req_cpu", "num_block_accept_tokens", "num_cap_tokens")


class HostTensor(list):
    """A host tensor as the loop reads it: is_cpu and tolist()."""

    is_cpu = True

    def tolist(self):
        return list(self)


def _committed_name(version: str) -> str:
    own = ast.unparse(_definitions(_wheel_text(version, PROCESSOR), {"_resolve_spec_v2_tokens"},
                                   cls="SchedulerBatchResultProcessor")[0])
    return re.search(r"req\.((?:kv\.)?kv_committed_len) \+= num_accept_tokens", own).group(1)


def _processor(version: str, patched: bool):
    text = _patched(version, PROCESSOR) if patched else _wheel_text(version, PROCESSOR)
    namespace = {"__name__": "batch_result_processor", "List": list, "Union": object, "Optional": object,
                 "GenerationBatchResult": object, "ScheduleBatch": object, "Req": object}
    if "def _get_speculative_output_stride(" in text:  # 0.5.20 on
        _run(_definitions(text, {"_get_speculative_output_stride"}), namespace, PROCESSOR)
    names = {m for m in METHODS if f"def {m}(" in text}  # advance_grammar_fsm from 0.5.17
    cls = _class_of(_definitions(text, names, cls="SchedulerBatchResultProcessor"), namespace, PROCESSOR)
    processor = object.__new__(cls)
    processor.calls = calls = []
    processor.model_worker = types.SimpleNamespace(
        on_verify_complete_cpu=lambda per_req, batch_size: calls.append(("verify", list(per_req), batch_size)))
    processor.metrics_reporter = types.SimpleNamespace(
        snapshot_spec_decode_metrics=lambda batch, result: calls.append(("snapshot", len(batch.reqs))))
    return processor


def _request_class(version: str):
    method = _definitions(_wheel_text(version, "srt/managers/schedule_batch.py"),
                          {"update_spec_correct_drafts_histogram"}, cls="Req")
    return _class_of(method, {}, "schedule_batch")


def _requests(version: str, seed: int, n: int):
    rng, Req, committed = random.Random(seed), _request_class(version), _committed_name(version)
    reqs = []
    for i in range(n):
        req = Req()
        lens = req
        if committed.startswith("kv."):
            req.kv = lens = types.SimpleNamespace()
        lens.kv_committed_len = 100 + i
        req.spec_verify_ct, req.spec_num_correct_drafts = rng.randrange(5), 0
        req.spec_num_block_accept_tokens = req.spec_num_cap_tokens = 0
        req.spec_correct_drafts_histogram = [] if rng.random() < 0.3 else [rng.randrange(4), 1]
        req.is_retracted = rng.random() < 0.1
        done = rng.random() < 0.2
        req.finished = lambda done=done: done
        req.grammar = None
        reqs.append(req)
    return reqs


def _state(reqs):
    return [(getattr(r, "kv", r).kv_committed_len, r.spec_verify_ct, r.spec_num_correct_drafts,
             r.spec_correct_drafts_histogram, r.spec_num_block_accept_tokens, r.spec_num_cap_tokens) for r in reqs]


def _result(tokens, plain: bool):
    result = types.SimpleNamespace(
        next_token_ids=HostTensor(tokens), accept_lens=HostTensor([1] * len(tokens)), speculative_num_draft_tokens=1,
        speculative_output_stride=None, num_non_draft_tokens_per_req=1, block_accept_lens=None, cap_lens=None,
        grammar_advanced=False, grammar_retained_tokens=None, copy_done=None)
    if plain:
        result._spec_disable_plain_result = True
    return result


def _batch(reqs):
    return types.SimpleNamespace(reqs=reqs, has_grammar=False, forward_mode=types.SimpleNamespace(is_decode=lambda: True),
                                 spec_algorithm=types.SimpleNamespace(is_dflash=lambda: False))


@pytest.fixture
def policy(monkeypatch):
    """The policy module where the patched method imports it from, counting its calls."""
    module = install_policy(monkeypatch)
    module.calls = calls = []
    real = module.plain_step_tokens
    module.plain_step_tokens = lambda *a, **k: calls.append(k) or real(*a, **k)
    return module


@pytest.mark.parametrize("version", RELEASES)
def test_the_plain_step_result_settles_what_the_releases_loop_settles(version, policy):
    patched, own = _processor(version, True), _processor(version, False)
    for seed, n in ((1, 1), (2, 16), (3, 256)):
        tokens = [random.Random(seed).randrange(32000) for _ in range(n)]
        mine, theirs = _requests(version, seed, n), _requests(version, seed, n)
        got_result, want_result = _result(tokens, True), _result(tokens, False)
        got = patched._resolve_spec_v2_tokens(got_result, _batch(mine))
        want = own._resolve_spec_v2_tokens(want_result, _batch(theirs))
        assert got == want == [[t] for t in tokens]
        assert _state(mine) == _state(theirs)
        for field in RESULT_FIELDS:
            assert getattr(got_result, field, None) == getattr(want_result, field, None), field
    assert patched.calls == own.calls
    assert len(policy.calls) == 3  # the patched method answered through the policy every time


@pytest.mark.parametrize("version", ["0.5.14", "0.5.19"])
def test_an_unmarked_result_keeps_the_releases_loop(version, policy):
    reqs = _requests(version, 4, 8)
    _processor(version, True)._resolve_spec_v2_tokens(_result(list(range(8)), False), _batch(reqs))
    assert policy.calls == []


def test_the_fast_path_marks_a_plain_steps_result_only_without_grammar():
    text = _patched("0.5.14", "srt/speculative/eagle_worker_v2.py")
    step = ast.unparse(_definitions(text, {"_forward_batch_generation_no_spec"}, cls="EAGLEWorkerV2")[0])
    assert "result._spec_disable_plain_result = not batch.has_grammar" in step
