"""The experiment tree `benchmarks/gpu/experiments/0.5.14-plainresult.diff` (a plain-step branch of
sglang 0.5.14's speculative result loop, for the GPU benchmark's PROFILE_TREES) applies to the committed
patch, and its branch keeps the bookkeeping the release's own loop does for a step of one token per
request: the tokens, the committed lengths, the verify counts, the histograms, the adaptive hook.

Both loops are taken from the wheel (the experiment applied to it with `patch`) and run on stand-in
requests that carry the release's own histogram method; torch is not here, so the result's tensors are
host lists with the two methods the loops call.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import types
from pathlib import Path

from test_patch_resolving import _class_of, _definitions, _wheel_text

REPO = Path(__file__).resolve().parents[1]
DIFF = REPO / "benchmarks" / "gpu" / "experiments" / "0.5.14-plainresult.diff"
PROCESSOR = "srt/managers/scheduler_components/batch_result_processor.py"


class HostTensor(list):
    is_cpu = True

    def tolist(self):
        return list(self)


def _experiment_text(tmp_path: Path) -> str:
    """The wheel's result processor with the experiment's hunks for it applied (no fuzz)."""
    root = tmp_path / "tree"
    (root / Path("sglang") / PROCESSOR).parent.mkdir(parents=True)
    (root / "sglang" / PROCESSOR).write_text(_wheel_text("0.5.14", PROCESSOR))
    hunks = DIFF.read_text().split("diff -ru ")
    mine = next("diff -ru " + h for h in hunks if h.startswith(f"patched/sglang/{PROCESSOR}"))
    assert shutil.which("patch"), "the test needs patch(1)"
    subprocess.run(["patch", "-s", "-p1", "--fuzz=0", "-d", str(root)], input=mine, text=True, check=True)
    return (root / "sglang" / PROCESSOR).read_text()


def _processor(text: str, names: set[str]):
    namespace = {"List": list, "Union": object, "GenerationBatchResult": object, "ScheduleBatch": object,
                 "Req": object, "logger": types.SimpleNamespace(error=print), "AbortReq": object}
    cls = _class_of(_definitions(text, names, cls="SchedulerBatchResultProcessor"), namespace, PROCESSOR)
    seen = []
    processor = object.__new__(cls)
    processor.model_worker = types.SimpleNamespace(
        on_verify_complete_cpu=lambda per_req, batch_size: seen.append((list(per_req), batch_size)))
    return processor, seen


def _request_class():
    method = _definitions(_wheel_text("0.5.14", "srt/managers/schedule_batch.py"),
                          {"update_spec_correct_drafts_histogram"}, cls="Req")
    return _class_of(method, {}, "schedule_batch")


def _requests(seed: int, n: int):
    rng, Req = random.Random(seed), _request_class()
    reqs = []
    for i in range(n):
        req = Req()
        req.kv_committed_len, req.spec_verify_ct, req.spec_num_correct_drafts = 100 + i, rng.randrange(5), 0
        req.spec_correct_drafts_histogram = [] if rng.random() < 0.3 else [rng.randrange(4), 1]
        req.is_retracted = rng.random() < 0.1
        done = rng.random() < 0.2
        req.finished = lambda done=done: done
        req.grammar = None
        reqs.append(req)
    return reqs


def _state(reqs):
    return [(r.kv_committed_len, r.spec_verify_ct, r.spec_num_correct_drafts, r.spec_correct_drafts_histogram)
            for r in reqs]


def test_the_plain_step_branch_keeps_the_releases_bookkeeping(tmp_path):
    text = _experiment_text(tmp_path)
    branch, branch_seen = _processor(text, {"_resolve_spec_v2_tokens", "_resolve_plain_step_tokens",
                                            "_accept_grammar_tokens"})
    own, own_seen = _processor(_wheel_text("0.5.14", PROCESSOR), {"_resolve_spec_v2_tokens", "_accept_grammar_tokens"})
    for seed, n in ((1, 1), (2, 16), (3, 256)):
        tokens = [random.Random(seed).randrange(32000) for _ in range(n)]
        batch = types.SimpleNamespace(spec_algorithm=types.SimpleNamespace(is_dflash=lambda: False))

        def result(plain):
            r = types.SimpleNamespace(next_token_ids=HostTensor(tokens), accept_lens=HostTensor([1] * n),
                                      speculative_num_draft_tokens=1)
            if plain:
                r._spec_disable_plain = True
            return r

        mine, theirs = _requests(seed, n), _requests(seed, n)
        got_result, want_result = result(True), result(False)
        got = branch._resolve_spec_v2_tokens(got_result, types.SimpleNamespace(reqs=mine, **vars(batch)))
        want = own._resolve_spec_v2_tokens(want_result, types.SimpleNamespace(reqs=theirs, **vars(batch)))
        assert got == want == [[t] for t in tokens]
        assert _state(mine) == _state(theirs)
        assert (got_result.num_correct_drafts, got_result.num_correct_drafts_per_req_cpu) == (
            want_result.num_correct_drafts, want_result.num_correct_drafts_per_req_cpu)
    assert branch_seen == own_seen
