"""sglang 0.5.14 on: while the threshold disables speculation a prefill leaves the draft out.

Runs each release's patched EAGLEWorkerV2.forward_batch_generation (and, from 0.5.21, the
_forward_prefill_batch it calls) with the patch's _spec_disable_skips_draft_prefill, taken from the wheel as
the patch leaves them, on stand-ins for the models (torch does not run here): the target prefills as the
release has it; the draft's extend over the prompt runs unless speculation is disabled, the draft was
already primed once, the threshold is the one the last decode step decided with and the draft mode is not
"extend". A skipped draft hands the FutureMap the bonus tokens only, as a plain-decode step does.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import types
from pathlib import Path
from typing import Optional

import pytest
from test_patch_policy import sbt
from test_patch_resolving import WORKER, _args, _Bag, _class_of, _definitions, _patched, _worker

RELEASES = ["0.5.14", "0.5.15", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22"]


class Mode:
    def __init__(self, name: str):
        self.name = name

    def is_extend(self) -> bool:
        return self.name == "EXTEND"

    def is_decode(self) -> bool:
        return self.name == "DECODE"

    def is_idle(self) -> bool:
        return False


EXTEND = Mode("EXTEND")


class EagleDraftInput:
    def __init__(self, **fields):
        self.fields = fields


class Target:
    """The target worker: one prefill result per call, its tokens and hidden states named."""

    def __init__(self):
        self.calls = 0

    def forward_batch_generation(self, batch, **kwargs):
        self.calls += 1
        logits = types.SimpleNamespace(hidden_states="target-hidden", mm_input_embeds=None)
        # kv_loc_plan: what 0.5.22 on asks the target for, the draft's KV slots (a plan, nothing held)
        return types.SimpleNamespace(logits_output=logits, next_token_ids=f"tokens-{self.calls}", kv_loc_plan=None)


class Draft:
    """The draft worker: counts its extends over a prompt."""

    def __init__(self):
        self.extends = 0
        self.draft_runner = types.SimpleNamespace(tp_group=None)
        self.draft_owns_attention = False

    def draft_tp_context(self, *args, **kwargs):
        return contextlib.nullcontext()

    def _draft_extend_for_prefill(self, batch, hidden_states, next_token_ids, mm_input_embeds=None, **plan):
        self.extends += 1
        return EagleDraftInput(topk_p="draft-topk", bonus_tokens=next_token_ids)


def _prefill_worker(version: str):
    names = {"forward_batch_generation", "_spec_disable_skips_draft_prefill"}
    body = _definitions(_patched(version, WORKER), {"EAGLEWorkerV2"})[0].body
    names |= {n.name for n in body if isinstance(n, ast.FunctionDef) and n.name == "_forward_prefill_batch"}
    methods = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in methods} == names
    nullcontext = lambda *args, **kwargs: contextlib.nullcontext()  # noqa: E731
    namespace = {"__name__": "eagle_worker_v2", "Optional": Optional, "ScheduleBatch": object,
                 "PPProxyTensors": object, "EagleDraftInput": EagleDraftInput,
                 "ForwardMode": types.SimpleNamespace(EXTEND=EXTEND),
                 "CaptureHiddenMode": types.SimpleNamespace(NULL="null", FULL="full", LAST="last"),
                 "speculative_moe_backend_context": nullcontext, "speculative_moe_a2a_backend_context": nullcontext,
                 "spec_stage_span": nullcontext, "draft_tp_context": nullcontext}
    worker_cls = _class_of(methods, namespace, WORKER, "Worker")
    worker = worker_cls.__new__(worker_cls)
    worker.target_worker, worker.draft_worker = Target(), Draft()
    worker._draft_worker = worker.draft_worker  # 0.5.19 on: a pipeline stage without the draft has None
    worker.speculative_algorithm = types.SimpleNamespace(is_standalone=lambda: False)
    worker.enable_dp_spec_prefill_coordination = False
    # what _init_spec_disable leaves, armed at 5, the draft skipped while disabled
    worker._spec_disable_policy = sbt.SpecDisablePolicy(5)
    worker._spec_disable_prefills_draft = False
    worker._spec_disable_draft_primed = False
    worker.live_threshold = 5
    worker._spec_disable_threshold = lambda: worker.live_threshold
    return worker


def _prefill(worker):
    batch = types.SimpleNamespace(forward_mode=EXTEND, is_extend_in_batch=False, seq_lens=[7, 9], reqs=[1, 2],
                                  _spec_disable_plain=False)
    published = []
    return worker.forward_batch_generation(batch, on_publish=published.append), published


@pytest.mark.parametrize("version", RELEASES)
def test_a_prefill_while_disabled_leaves_the_draft_out_once_it_was_primed(version: str) -> None:
    worker = _prefill_worker(version)
    worker._spec_disable_policy.decide(9)  # the last decode step ran without speculation
    first, _ = _prefill(worker)
    assert worker.draft_worker.extends == 1 and first.next_draft_input.fields["topk_p"] == "draft-topk"

    second, published = _prefill(worker)
    assert worker.target_worker.calls == 2 and published == [[7, 9]]
    assert worker.draft_worker.extends == 1
    assert second.next_draft_input.fields == {"bonus_tokens": "tokens-2"}


@pytest.mark.parametrize("version", RELEASES)
def test_the_draft_prefills_while_speculating_after_a_live_change_or_in_extend_mode(version: str) -> None:
    worker = _prefill_worker(version)
    _prefill(worker)  # primed
    _prefill(worker)  # the policy speculates: the draft runs
    assert worker.draft_worker.extends == 2

    worker._spec_disable_policy.decide(9)
    worker.live_threshold = 16  # raised since that decision: the next decode step may speculate
    _prefill(worker)
    assert worker.draft_worker.extends == 3

    worker.live_threshold = 5
    worker._spec_disable_prefills_draft = True  # SGLANG_SPEC_THRESHOLD_DRAFT=extend
    _prefill(worker)
    assert worker.draft_worker.extends == 4

    worker._spec_disable_prefills_draft = False
    _prefill(worker)
    assert worker.draft_worker.extends == 4


@pytest.mark.parametrize("mode, prefills", [("extend", True), ("skip", False), ("auto", False)])
def test_the_draft_mode_decides_whether_disabled_prefills_run_the_draft(
        mode: str, prefills: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(sbt.DRAFT_MODE_ENV, mode)
    worker = _worker("0.5.19", tmp_path, _args(enable_metrics_for_all_schedulers=False), _Bag())
    with caplog.at_level(logging.INFO, logger="eagle_worker_v2"):
        worker._init_spec_disable()
    assert worker._spec_disable_prefills_draft is prefills
    assert worker._spec_disable_draft_primed is False
    assert ("its prefill runs while disabled" in worker._spec_disable_draft_note) is prefills
