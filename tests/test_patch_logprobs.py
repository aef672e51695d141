"""Logprob requests on the plain-decode step (sglang 0.5.6-0.5.12), read by each release's own scheduler code.

A plain step's logits output is what the target's sampler gives a no-spec decode (one logprob per
request, top-k and token-id rows per request); the patched step reshapes it to the rows a speculative
step hands over. The release's process_batch_result_decode, compiled from its wheel, must then give each
request exactly what it gives a no-spec server's decode step. torch does not run here: the host tensors
below do what torch's tolist / unsqueeze do to the values, nothing else.
"""

from __future__ import annotations

import __future__
import ast
import contextlib
import copy
import types
import zipfile
from functools import cache

import pytest
from sglang_trees import sglang_wheel

from dynctl.patching import plan_patch
from dynctl.patching.recipe import target_files
from dynctl.base.sglang import parse_version

PATCH_VERSIONS = ["0.5.6", "0.5.7", "0.5.8", "0.5.9", "0.5.10", "0.5.11", "0.5.12"]
PROCESSOR = "srt/managers/scheduler_output_processor_mixin.py"
WORKER = "srt/speculative/eagle_worker_v2.py"


@cache
def _texts(version: str) -> tuple[dict[str, str | None], dict[str, str]]:
    """The release's pristine target files and the patched ones."""
    with zipfile.ZipFile(sglang_wheel(version)) as wheel:
        names = set(wheel.namelist())
        pristine = {p: wheel.read(f"sglang/{p}").decode() if f"sglang/{p}" in names else None for p in target_files()}
    return pristine, {c.path: c.after for c in plan_patch(version, pristine).changes}


class _HostTensor(list):
    """A CPU tensor as the scheduler reads one: is_cpu, tolist(), and unsqueeze(1) of a 1-d one."""

    is_cpu = True

    def tolist(self) -> list:
        return [x.tolist() if isinstance(x, _HostTensor) else x for x in self]

    def unsqueeze(self, dim: int) -> _HostTensor:
        assert dim == 1
        return _HostTensor(_HostTensor([x]) for x in self)


def _method(text: str, cls_name: str, name: str) -> ast.FunctionDef:
    cls = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _compiled(statements: list[ast.stmt], where: str):
    return compile(ast.Module(body=statements, type_ignores=[]), where, "exec")


def _decode_pieces(text: str):
    """From the release's process_batch_result_decode: the statement that turns the result's tensors into
    lists (token resolution and logprobs), and the per-request statement that records a request's logprobs."""
    body = _method(text, "SchedulerOutputProcessorMixin", "process_batch_result_decode").body
    head = [s for s in body if isinstance(s, ast.If)
            and "next_token_logprobs = logits_output.next_token_logprobs.tolist()" in ast.unparse(s)]
    loop = [s for s in body if isinstance(s, ast.For) and "req" in ast.unparse(s.target)]
    assert len(head) == 1 and len(loop) == 1
    record = [s for s in loop[0].body if isinstance(s, ast.If) and ast.unparse(s.test).startswith("req.return_logprob")]
    assert len(record) == 1
    return _compiled(head, PROCESSOR), _compiled(record, PROCESSOR)


def _resolver(text: str):
    """The release's own token resolution of a spec-v2 step (its name changed in 0.5.12), compiled."""
    cls = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)
               and n.name == "SchedulerOutputProcessorMixin")
    node = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_resolve_spec_overlap_token"))
    namespace = {"List": list, "Scheduler": object, "GenerationBatchResult": object, "ScheduleBatch": object}
    exec(_compiled([node], PROCESSOR), namespace)
    return node.name, namespace[node.name]


def _row_shaping(text: str):
    """What the patched plain step does to a logprob batch's logits output before returning it."""
    body = _method(text, "EAGLEWorkerV2", "_forward_batch_generation_no_spec").body
    shaping = [s for s in body if isinstance(s, ast.If) and ast.unparse(s.test) == "batch.return_logprob"]
    assert len(shaping) == 1
    return _compiled(shaping, WORKER)


# Three requests, each with its own top-k and token ids, as the sampler lays a decode's logprobs out:
# one value per request, one top-k row and one token-id row per request.
TOKENS = [7, 8, 9]
LOGPROBS = [-0.25, -1.5, -0.125]
TOP_K = [2, 1, 3]
TOP_VAL, TOP_IDX = [[-0.25, -2.0], [-1.5], [-0.125, -2.5, -3.0]], [[7, 3], [8], [9, 4, 5]]
TOKEN_IDS = [[11, 12], [13], [11, 14, 15]]
TOKEN_IDS_VAL = [[-4.0, -5.0], [-6.0], [-4.5, -7.0, -8.0]]


def _rows(values: list[list]) -> list[_HostTensor]:
    return [_HostTensor(row) for row in values]


def _plain_decode_output():
    return types.SimpleNamespace(
        next_token_logprobs=_HostTensor(LOGPROBS),
        next_token_top_logprobs_val=_rows(TOP_VAL), next_token_top_logprobs_idx=_rows(TOP_IDX),
        next_token_token_ids_logprobs_val=_rows(TOKEN_IDS_VAL),
        next_token_token_ids_logprobs_idx=[list(ids) for ids in TOKEN_IDS], hidden_states=None)


def _requests():
    reqs = []
    for k, ids in zip(TOP_K, TOKEN_IDS):
        req = types.SimpleNamespace(
            return_logprob=True, top_logprobs_num=k, token_ids_logprob=ids, is_retracted=False,
            kv_committed_len=10, spec_verify_ct=0, spec_accepted_tokens=0, spec_accepted_drafts=0,
            spec_num_correct_drafts=0, output_token_logprobs_val=[], output_token_logprobs_idx=[],
            output_top_logprobs_val=[], output_top_logprobs_idx=[], output_token_ids_logprobs_val=[],
            output_token_ids_logprobs_idx=[])
        req.finished = lambda: False
        req.update_spec_acceptance_histogram = req.update_spec_correct_drafts_histogram = lambda n: None
        reqs.append(req)
    return reqs


def _recorded(reqs) -> list[tuple]:
    return [(r.output_token_logprobs_val, r.output_token_logprobs_idx, r.output_top_logprobs_val,
             r.output_top_logprobs_idx, r.output_token_ids_logprobs_val, r.output_token_ids_logprobs_idx)
            for r in reqs]


def _process(processor: str, logits_output, *, speculative: bool, resolver=None) -> list[tuple]:
    """Run the release's own decode-result code on one step's output; what each request recorded."""
    head, record = _decode_pieces(processor)
    scheduler = types.SimpleNamespace(
        draft_worker=types.SimpleNamespace(speculative_num_draft_tokens=4),
        model_worker=types.SimpleNamespace(on_verify_complete_cpu=lambda accepted: None))
    if resolver is not None:
        name, fn = resolver
        setattr(scheduler, name, types.MethodType(fn, scheduler))
    batch = types.SimpleNamespace(reqs=_requests(), return_logprob=True, is_spec_v2=speculative, is_v2_eagle=speculative,
                                  spec_algorithm=types.SimpleNamespace(is_none=lambda: not speculative))
    result = types.SimpleNamespace(logits_output=logits_output, next_token_ids=_HostTensor(TOKENS),
                                   accept_lens=_HostTensor([1, 1, 1]), can_run_cuda_graph=True)
    if speculative:
        result.speculative_num_draft_tokens = 1  # what the plain step's result carries
    names = {"self": scheduler, "batch": batch, "result": result, "logits_output": logits_output,
             "next_token_ids": result.next_token_ids}
    exec(head, names)
    for i, req in enumerate(batch.reqs):
        names.update(i=i, req=req, next_token_id=names["next_token_ids"][i])
        exec(record, names)
    return _recorded(batch.reqs)


def _shaped(worker: str, logits_output):
    exec(_row_shaping(worker), {"batch": types.SimpleNamespace(return_logprob=True),
                                "result": types.SimpleNamespace(logits_output=logits_output)})
    return logits_output


@pytest.mark.parametrize("version", PATCH_VERSIONS)
def test_a_plain_steps_logprobs_reach_each_request_as_a_no_spec_decodes_do(version: str) -> None:
    """From 0.5.10 the scheduler records a speculative step's logprobs (rows per request, top-k and token ids
    at i * row + j): the plain step's reach each request exactly as the same sampler output does on a no-spec
    server, and the unshaped output is what it cannot read. Before 0.5.10 the scheduler records no decode
    logprobs of a speculative batch at all (its spec-v2 worker computes none on verify either), so a plain
    step there changes nothing that a client receives."""
    pristine, patched = _texts(version)
    processor, worker = patched.get(PROCESSOR) or pristine[PROCESSOR], patched[WORKER]
    no_spec = _process(processor, _plain_decode_output(), speculative=False)
    assert no_spec == [([lp], [tok], [val], [idx], [ids_val], [ids]) for lp, tok, val, idx, ids_val, ids
                       in zip(LOGPROBS, TOKENS, TOP_VAL, TOP_IDX, TOKEN_IDS_VAL, TOKEN_IDS)]
    plain = _process(processor, _shaped(worker, _plain_decode_output()), speculative=True,
                     resolver=_resolver(processor))
    if parse_version(version) >= (0, 5, 10):
        assert plain == no_spec
        with pytest.raises(TypeError):  # a [bs] output where the scheduler reads one row per request
            _process(processor, _plain_decode_output(), speculative=True, resolver=_resolver(processor))
    else:
        assert plain == [([], [], [], [], [], [])] * len(TOKENS)
        assert "return_logprob" not in pristine[WORKER]  # its verify computes none either


@pytest.mark.parametrize("version", PATCH_VERSIONS)
def test_logprob_steps_take_the_plain_step_and_grammar_ones_stay_on_verify(version: str) -> None:
    """The patched worker's own rule (its methods compiled from the patched file, run on batch stand-ins):
    only a grammar keeps a decode batch on verify."""
    _, patched = _texts(version)
    cls = next(n for n in ast.walk(ast.parse(patched[WORKER])) if isinstance(n, ast.ClassDef)
               and n.name == "EAGLEWorkerV2")
    ours = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith(("_spec_disable", "_no_spec"))]
    worker = copy.copy(cls)  # the class with our methods only, on no base
    worker.body, worker.bases, worker.keywords, worker.decorator_list = ours, [], [], []
    namespace: dict = {"contextlib": contextlib}  # the decorator some of them carry
    exec(compile(ast.Module(body=[worker], type_ignores=[]), WORKER, "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    keeps_verify = namespace["EAGLEWorkerV2"]()._spec_disable_keeps_verify
    for grammar in (False, True):
        for logprob in (False, True):
            assert keeps_verify(types.SimpleNamespace(has_grammar=grammar, return_logprob=logprob)) is grammar
