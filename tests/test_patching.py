"""The patch engine against real sglang sources from PyPI: plans, idempotence, refusals, versions."""

from __future__ import annotations

import ast
import hashlib
import re
import zipfile
from functools import cache

import pytest
from patch_checks import LEAN_SCHEDULE_BATCH_VARIANTS, SPEC_FIELDS, check_all, takes_schedule_batch, unpatched_text
from sglang_trees import sglang_wheel

from dynctl.base.errors import PreflightError, UsageError
from dynctl.base.sglang import parse_version
from dynctl.patching import (
    MAX_THRESHOLD,
    SUPPORTED,
    TARGET_FILES,
    PatchRefused,
    parse_threshold,
    plan_patch,
    sha256_text,
    strategy_for,
    variant_for,
)
from dynctl.patching.recipe import NEW_MODULE, SERVER_ARGS, recipes, target_files
from dynctl.patching.versions import strategy_note, unmeasured_note

PATCH_VERSIONS = ["0.5.6", "0.5.7", "0.5.8", "0.5.9", "0.5.10", "0.5.11", "0.5.12"]
# Releases whose worker takes a ScheduleBatch (their own contract tests below).
SCHEDULE_BATCH_VERSIONS = ["0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18",
                           "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"]


@cache
def wheel_text(version: str, path: str) -> str | None:
    with zipfile.ZipFile(sglang_wheel(version)) as wheel:
        try:
            return wheel.read(f"sglang/{path}").decode("utf-8")
        except KeyError:
            return None


def originals(version: str) -> dict[str, str | None]:
    return {path: wheel_text(version, path) for path in target_files()}


def record(version: str) -> dict[str, str]:
    """sha256 (hex) of the target files as the wheel's RECORD lists them."""
    import base64
    import csv

    with zipfile.ZipFile(sglang_wheel(version)) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(wheel.read(name).decode().splitlines())
        out = {}
        for row in rows:
            if row and row[0].startswith("sglang/srt/") and row[1].startswith("sha256="):
                b64 = row[1][7:]
                out[row[0][len("sglang/"):]] = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
        return out


@pytest.mark.parametrize("version", PATCH_VERSIONS + SCHEDULE_BATCH_VERSIONS)
def test_plan_applies_compiles_and_is_idempotent(version: str) -> None:
    before = originals(version)
    plan = plan_patch(version, before, record=record(version))
    assert plan.status == "ready"
    assert [c.path for c in plan.changes] == target_files(variant_for(version))
    after = {c.path: c.after for c in plan.changes}
    for path, text in after.items():
        compile(text, path, "exec")  # what py_compile does on the host
    check_all(after, variant_for(version))
    for change in plan.changes:
        assert change.sha256_before == (None if before[change.path] is None else sha256_text(before[change.path]))
        assert change.sha256_after == hashlib.sha256(change.after.encode()).hexdigest()
        assert change.after.startswith(before[change.path] or "") or change.before is not None
    # planning against the patched texts: already applied, nothing to change
    again = plan_patch(version, after, expected={c.path: c.sha256_after for c in plan.changes})
    assert again.status == "applied" and again.changes == ()
    assert "already applied, intact" in again.message
    # the patch only inserts: taking it out gives the original bytes back
    for path in target_files(variant_for(version)):
        if path != NEW_MODULE:
            assert unpatched_text(version, path, after[path]) == before[path]


@pytest.mark.parametrize("version", PATCH_VERSIONS + SCHEDULE_BATCH_VERSIONS)
def test_the_diff_is_a_unified_diff_of_insertions(version: str) -> None:
    plan = plan_patch(version, originals(version))
    diff = plan.diff()
    # from 0.5.20 the spec fields are declared in arg_groups/fields/spec.py
    fields = SPEC_FIELDS if SPEC_FIELDS in target_files(variant_for(version)) else SERVER_ARGS
    assert f"--- a/sglang/{fields}" in diff and f"+++ b/sglang/{fields}" in diff
    assert f"--- /dev/null\n+++ b/sglang/{NEW_MODULE}" in diff
    removed = [ln for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert removed == []  # insertions only
    if takes_schedule_batch(variant_for(version)):  # the command line comes from the annotated field
        assert "+    speculative_disable_batch_threshold: A[\n" in diff
    else:
        assert '+            "--speculative-disable-batch-threshold",' in diff


def test_variants_follow_the_release_matrix() -> None:
    assert [variant_for(v) for v in PATCH_VERSIONS] == ["0.5.6", "0.5.7", "0.5.8", "0.5.8", "0.5.8", "0.5.8", "0.5.12"]
    assert variant_for("0.5.12.post1") == "0.5.12"
    assert variant_for("0.5.14") == variant_for("0.5.14.post1") == "0.5.14"
    assert variant_for("0.5.15") == variant_for("0.5.15.post1") == variant_for("0.5.15.post2") == "0.5.15"
    assert [variant_for(v) for v in ("0.5.16", "0.5.17")] == ["0.5.16", "0.5.17"]
    assert [variant_for(v) for v in ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22")] == [
        "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22"]
    assert variant_for("0.5.23") == variant_for("0.5.23.post1") == "0.5.22"
    for version in ("0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"):  # what plan, deploy and status say
        assert strategy_note(version, "patch") == unmeasured_note(version)
        assert unmeasured_note(version).startswith(f"patch not measured on a GPU for sglang {version}: ")
        assert strategy_note(version, "native") == (f"a patch variant for sglang {version} exists but is not "
                                                    f'measured on a GPU; strategy = "patch" takes it')
    for version in ("0.5.24", "0.6.0", "0.5.13", "0.5.5"):
        with pytest.raises(PreflightError):
            variant_for(version)


# --------------------------------------------------------------------------- the release's own contract


def _dataclass_fields(text: str, name: str, replaceable: bool = False) -> set[str]:
    cls = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == name)
    if replaceable:  # dataclasses.replace() would run a __post_init__ again
        assert not any(isinstance(n, ast.FunctionDef) and n.name == "__post_init__" for n in cls.body)
        assert "init=False" not in ast.unparse(cls)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _self_attrs(text: str, cls_name: str) -> set[str]:
    cls = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    attrs = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
             and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return attrs | {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("version", PATCH_VERSIONS)
def test_what_the_plain_decode_step_uses_exists_in_the_release(version: str) -> None:
    """Every field, attribute and helper the inserted worker code touches is there in this release."""
    mwb = _dataclass_fields(wheel_text(version, "srt/managers/schedule_batch.py"), "ModelWorkerBatch", True)
    assert {"forward_mode", "input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "seq_lens_cpu",
            "seq_lens_sum", "return_logprob", "is_extend_in_batch", "spec_info", "capture_hidden_mode",
            "has_grammar"} <= mwb
    result = _dataclass_fields(wheel_text(version, "srt/managers/utils.py"), "GenerationBatchResult")
    assert {"logits_output", "next_token_ids", "can_run_cuda_graph", "accept_lens", "next_draft_input"} <= result
    draft = _dataclass_fields(wheel_text(version, "srt/speculative/eagle_info.py"), "EagleDraftInput")
    bonus = "bonus_tokens" if variant_for(version) == "0.5.12" else "verified_id"
    assert {bonus, "new_seq_lens", "verify_done"} <= draft

    # The scheduler reads the token stride where the variant puts it.
    mixin = wheel_text(version, "srt/managers/scheduler_output_processor_mixin.py")
    if variant_for(version) == "0.5.12":
        assert "speculative_num_draft_tokens" in result
        assert "stride = result.speculative_num_draft_tokens" in mixin
    else:
        assert "stride = self.draft_worker.speculative_num_draft_tokens" in mixin

    # The plain decode writes the first of the D slots prepare_for_decode assigned: req_to_token[req, seq_len].
    assert "self.req_to_token = torch.zeros(" in wheel_text(version, "srt/mem_cache/memory_pool.py")
    # logprob steps run plain: from 0.5.10 the scheduler reads one row of accepted-token logprobs per
    # request; before, it records decode logprobs of non-speculative batches only (test_patch_logprobs)
    rows = ("accepted_logprobs = next_token_logprobs[i]", "flat_idx = i * max_accept + j",
            "max_accept = len(accepted_logprobs)")
    if parse_version(version) >= (0, 5, 10):
        assert all(row in mixin for row in rows)
    else:
        assert not any(row in mixin for row in rows)
        assert "if req.return_logprob and batch.spec_algorithm.is_none():" in mixin
    fbi = wheel_text(version, "srt/model_executor/forward_batch_info.py")
    assert "ret.positions = clamp_position(batch.seq_lens)" in fbi  # DECODE positions are seq_lens - 1
    # ... from a module-level function that the arming step calls once, to compile it ahead of use
    assert re.search(r"^(def clamp_position\(seq_lens\):|    clamp_position = clamp_position_cuda)$", fbi, re.M)
    assert "torch.int64" in wheel_text(version, "srt/managers/schedule_batch.py")
    assert "self.graph_runner.can_run(forward_batch)" in wheel_text(version, "srt/model_executor/model_runner.py")

    worker = wheel_text(version, "srt/speculative/eagle_worker_v2.py")
    assert {"server_args", "tp_rank", "device", "speculative_num_draft_tokens", "req_to_token_pool",
            "target_worker", "draft_worker"} <= _self_attrs(worker, "EAGLEWorkerV2")
    draft_worker = _self_attrs(worker, "EagleDraftWorker")
    assert {"_draft_extend_for_decode", "draft_runner"} <= draft_worker
    if variant_for(version) not in ("0.5.6", "0.5.7"):
        assert "draft_tp_context" in draft_worker
    # what each release does around its own draft-extend, mirrored by the compat methods
    around = worker[worker.index("batch_output = self.verify(model_worker_batch)"):]
    around = around[: around.index("._draft_extend_for_decode(")]
    assert ("draft_tp_context" in around) == (variant_for(version) not in ("0.5.6", "0.5.7"))
    assert ("speculative_moe_backend_context" in around) == (variant_for(version) != "0.5.6")


@pytest.mark.parametrize("version", PATCH_VERSIONS)
def test_what_the_plain_decode_graphs_use_exists_in_the_release(version: str) -> None:
    """The fast path captures a second graph set through the release's own runners: each knob it turns
    (attribute overrides during construction) is read where the inserted code expects it."""
    runner = wheel_text(version, "srt/model_executor/model_runner.py")
    assert "def _get_attention_backend(self, init_new_workspace: bool = False):" in runner
    assert {"attn_backend", "graph_runner", "spec_algorithm", "init_new_workspace", "tp_size",
            "tp_group"} <= _self_attrs(runner, "ModelRunner")
    # the draft-mode decision is all-reduced over the TP group's CPU (gloo) group
    assert "self.cpu_group = cpu_group" in wheel_text(version, "srt/distributed/parallel_state.py")
    args = _dataclass_fields(wheel_text(version, "srt/server_args.py"), "ServerArgs")
    assert {"enable_return_hidden_states", "enable_lora", "speculative_num_steps",
            "speculative_num_draft_tokens"} <= args
    assert "return cls.NONE" in wheel_text(version, "srt/speculative/spec_info.py")  # from_string(None)

    graphs = wheel_text(version, "srt/model_executor/cuda_graph_runner.py")
    init = ast.unparse(next(n for n in ast.walk(next(c for c in ast.walk(ast.parse(graphs)) if isinstance(c, ast.ClassDef)
                                                     and c.name == "CudaGraphRunner")) if isinstance(n, ast.FunctionDef) and n.name == "__init__"))
    # TARGET_VERIFY only for a speculative model runner; FULL hidden states from the server flag;
    # the attention backend is the model runner's (or defaults to it).
    assert "model_runner.spec_algorithm.is_" in init and "ForwardMode.TARGET_VERIFY" in init
    assert "if model_runner.server_args.enable_return_hidden_states:" in init
    assert "self.capture_hidden_mode = CaptureHiddenMode.FULL" in init
    assert ("self.model_runner.attn_backend.init_cuda_graph_state" in init
            or "self.attn_backend = attn_backend or model_runner.attn_backend" in init)
    assert "self.capture_bs" in init

    worker = wheel_text(version, "srt/speculative/eagle_worker_v2.py")
    assert {"speculative_num_steps", "speculative_num_draft_tokens", "cuda_graph_runner_for_draft_extend",
            "draft_extend_attn_backend", "topk", "draft_runner"} <= _self_attrs(worker, "EagleDraftWorker")
    extend = worker[worker.index("def _draft_extend_for_decode("):]
    extend = extend[: extend.index("\n    def ", 10)] if "\n    def " in extend[10:] else extend
    for used in ("self.speculative_num_steps + 1", "* self.speculative_num_draft_tokens",
                 "self.cuda_graph_runner_for_draft_extend"):
        assert used in extend, used
    factory = next(n for n in ast.walk(ast.parse(wheel_text(version, "srt/speculative/draft_utils.py")))
                   if isinstance(n, ast.ClassDef) and n.name == "DraftBackendFactory")
    assert [a.arg for a in _method_node(factory, "__init__").args.args] == [
        "self", "server_args", "draft_model_runner", "topk", "speculative_num_steps"]
    assert _method_node(factory, "create_draft_extend_backend")

    # The draft-extend graph runner sizes itself from speculative_num_steps (server args, or a
    # keyword that defaults to them) and uses the worker's draft-extend backend.
    ext = wheel_text(version, "srt/speculative/eagle_draft_extend_cuda_graph_runner.py")
    assert "self.num_tokens_per_bs = self.speculative_num_steps + 1" in ext
    assert "model_runner.server_args.speculative_num_steps" in ext
    assert "eagle_worker.draft_extend_attn_backend" in ext
    triton = wheel_text(version, "srt/layers/attention/triton_backend.py")
    assert "self.speculative_num_steps = model_runner.server_args.speculative_num_steps" in triton
    # capture sizes its query layout from the steps; replay from them too, or (0.5.6-0.5.9) from the
    # accept lengths, which are 1 per request on a one-token extend
    assert triton.count("num_tokens_per_bs = self.speculative_num_steps + 1") == 2 or (
        triton.count("num_tokens_per_bs = self.speculative_num_steps + 1") == 1
        and "accept_lens = spec_info.accept_length[:bs]" in triton)


def _method_node(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


# --------------------------------------------------------------------------- the lean plain step (0.5.6-0.5.12)

LEAN_VERSIONS = ["0.5.6", "0.5.7", "0.5.8", "0.5.9", "0.5.10", "0.5.11", "0.5.12"]


@pytest.mark.parametrize("part", ["resolve", "store"])
def test_the_older_futuremap_pieces_are_0_5_12s_but_for_the_bonus_field(part: str) -> None:
    """0.5.6-0.5.11's FutureMap insertions and 0.5.12's are joins of the same pieces but one, a line that
    names the bonus-token field: what 0.5.12 renamed (verified_id -> bonus_tokens)."""
    from dynctl.patching.recipe import fragment_text, table

    joins = table()["fragments"]
    older, newer = joins[f"overlap_utils.{part}-0.5.6"], joins[f"overlap_utils.{part}-0.5.12"]
    bonus = f"overlap_utils.{part}.bonus-"
    assert [p for p in older if not p.startswith(bonus)] == [p for p in newer if not p.startswith(bonus)]
    assert len(older) == len(newer) == 3
    assert [p for p in older if p.startswith(bonus)] == [f"{bonus}verified_id.pyfrag"]
    assert [p for p in newer if p.startswith(bonus)] == [f"{bonus}bonus_tokens.pyfrag"]
    old_line, new_line = fragment_text(f"{bonus}verified_id.pyfrag"), fragment_text(f"{bonus}bonus_tokens.pyfrag")
    assert old_line.count("\n") == new_line.count("\n") == 1
    assert "bonus_tokens" not in old_line and old_line.replace("verified_id", "bonus_tokens") == new_line
    ours = fragment_text(f"overlap_utils.{part}-0.5.6")
    assert "bonus_tokens" not in ours and ours.replace("verified_id", "bonus_tokens") == fragment_text(
        f"overlap_utils.{part}-0.5.12")


@pytest.mark.parametrize("version", LEAN_VERSIONS)
def test_what_the_lean_plain_step_relies_on_holds_in_the_release(version: str) -> None:
    """The scheduler-side shortcuts of a plain step read what each release's scheduler does around it."""
    variant = variant_for(version)
    bonus = "bonus_tokens" if variant == "0.5.12" else "verified_id"
    # A verify's result carries no stride of its own before 0.5.12 (getattr gives None: D tokens per request).
    result = _dataclass_fields(wheel_text(version, "srt/managers/utils.py"), "GenerationBatchResult")
    assert ("speculative_num_draft_tokens" in result) is (variant == "0.5.12")
    processor = wheel_text(version, "srt/managers/scheduler_output_processor_mixin.py")
    # set once, read in the one slice (0.5.12: and asserted)
    assert processor.count("stride") == (4 if variant == "0.5.12" else 3)
    assert "next_token_ids[i * stride : i * stride + accept_lens[i]]" in processor
    assert "    def _resolve_spec_overlap_token" in processor

    # The FutureMap: one buffer per draft field, the bonus tokens under the release's name, hidden states
    # optional; resolve runs right before the spec worker's forward, on the same ModelWorkerBatch.
    overlap = wheel_text(version, "srt/managers/overlap_utils.py")
    for name in ("topk_p", "topk_index", bonus, "new_seq_lens"):
        assert f"self.{name}_buf[intv] = draft_input.{name}" in overlap, name
    assert "interval: Optional[slice] = None" in overlap
    scheduler = wheel_text(version, "srt/managers/scheduler.py")
    run_batch = ast.unparse(next(n for n in ast.walk(ast.parse(scheduler)) if isinstance(n, ast.FunctionDef)
                                 and n.name == "run_batch"))
    assert run_batch.index("self.future_map.resolve_future(model_worker_batch)") < run_batch.index(
        "batch_result = self.model_worker.forward_batch_generation(model_worker_batch")
    assert "batch.spec_info = batch_result.next_draft_input" in run_batch
    assert "batch.spec_info.future_indices = future_indices" in run_batch
    assert "self.model_worker = self.draft_worker" in scheduler
    init = ast.unparse(_method_node(next(n for n in ast.walk(ast.parse(scheduler)) if isinstance(n, ast.ClassDef)
                                         and n.name == "Scheduler"), "__init__"))
    # the spec worker exists when the FutureMap is handed its decision (0.5.6 builds it in __init__ itself)
    built = "self.init_model_worker()" if variant != "0.5.6" else "self.draft_worker = "
    assert init.index(built) < init.index("self.init_overlap()")

    # known_seq_lens: a filtered batch keeps its rows' host lengths and its future interval; a merged one
    # gets future indices without an interval.
    batch = wheel_text(version, "srt/managers/schedule_batch.py")
    assert "self.seq_lens_cpu = self.seq_lens_cpu[keep_indices]" in batch
    assert "self.reqs = [self.reqs[i] for i in keep_indices]" in batch
    assert "self.seq_lens_cpu = torch.cat([self.seq_lens_cpu, other.seq_lens_cpu])" in batch
    info = wheel_text(version, "srt/speculative/eagle_info.py")
    assert "self.future_indices.indices = self.future_indices.indices[new_indices]" in info
    assert "self.future_indices = FutureIndices(\n                indices=torch.cat(" in info
    # prepare_for_decode ends with the host copy the plain step skips: nothing after it is skipped too
    mixin = next(n for n in ast.walk(ast.parse(wheel_text(version, "srt/speculative/eagle_info_v2.py")))
                 if isinstance(n, ast.ClassDef) and n.name == "EagleDraftInputV2Mixin")
    tail = [ast.unparse(s) for s in _method_node(mixin, "prepare_for_decode").body[-2:]]
    assert tail == ["batch.seq_lens_cpu = batch.seq_lens.cpu()", "batch.seq_lens_sum = batch.seq_lens_cpu.sum().item()"]


class _HostTensor(list):
    """A CPU tensor as _resolve_spec_overlap_token_ids reads one (is_cpu, tolist)."""

    is_cpu = True

    def tolist(self) -> list:
        return list(self)


def _resolve_tokens(text: str):
    """The release's own (patched or pristine) _resolve_spec_overlap_token_ids, compiled from its source."""
    cls = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)
               and n.name == "SchedulerOutputProcessorMixin")
    node = _method_node(cls, "_resolve_spec_overlap_token_ids")
    namespace = {"List": list, "Scheduler": object, "GenerationBatchResult": object, "ScheduleBatch": object}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "scheduler_output_processor_mixin.py", "exec"), namespace)
    return namespace["_resolve_spec_overlap_token_ids"]


def _req():
    import types

    req = types.SimpleNamespace(kv_committed_len=10, spec_verify_ct=0, spec_accepted_tokens=0,
                                spec_accepted_drafts=0)
    req.update_spec_acceptance_histogram = lambda accepted: None
    return req


@pytest.mark.parametrize("version", ["0.5.6", "0.5.7", "0.5.8", "0.5.9", "0.5.10", "0.5.11"])
def test_the_patched_scheduler_reads_one_token_per_request_after_a_plain_step(version: str) -> None:
    """The release's own token resolution, patched, on a plain step's result (3 requests, D = 4, one token
    each) and on a verify's (D tokens each, accept lengths 2, 1, 3); the pristine code misreads the first."""
    import types

    scheduler = types.SimpleNamespace(draft_worker=types.SimpleNamespace(speculative_num_draft_tokens=4))
    plain = types.SimpleNamespace(next_token_ids=_HostTensor([7, 8, 9]), accept_lens=_HostTensor([1, 1, 1]),
                                  speculative_num_draft_tokens=1)
    verify = types.SimpleNamespace(next_token_ids=_HostTensor([1, 2, 0, 0, 3, 0, 0, 0, 4, 5, 6, 0]),
                                   accept_lens=_HostTensor([2, 1, 3]))
    patched = _resolve_tokens(_patched(version)["srt/managers/scheduler_output_processor_mixin.py"])
    pristine = _resolve_tokens(originals(version)["srt/managers/scheduler_output_processor_mixin.py"])

    def tokens(resolve, result):
        batch = types.SimpleNamespace(reqs=[_req() for _ in range(3)])
        return resolve(scheduler, result, batch), batch

    got, batch = tokens(patched, plain)
    assert got == [[7], [8], [9]]
    assert [r.spec_verify_ct for r in batch.reqs] == [1, 1, 1]
    assert tokens(patched, verify)[0] == [[1, 2], [3], [4, 5, 6]]
    assert tokens(pristine, verify)[0] == [[1, 2], [3], [4, 5, 6]]
    assert tokens(pristine, plain)[0] == [[7], [], []]  # what the stride-1 result would give unpatched


# --------------------------------------------------------------------------- refusals


def test_a_hand_edited_anchor_is_refused_naming_file_and_anchor() -> None:
    texts = originals("0.5.9")
    texts[SERVER_ARGS] = texts[SERVER_ARGS].replace(
        "    speculative_num_draft_tokens: Optional[int] = None\n",
        "    speculative_num_draft_tokens: Optional[int] = 4  # tuned by hand\n",
    )
    with pytest.raises(PatchRefused) as err:
        plan_patch("0.5.9", texts)
    assert err.value.file == SERVER_ARGS
    assert "speculative_num_draft_tokens: Optional[int] = None" in err.value.anchor
    assert "srt/server_args.py: anchor for the speculative_num_draft_tokens field not found" in str(err.value)
    assert err.value.exit_code == 3


def test_a_hand_edit_away_from_the_anchors_is_caught_by_the_record() -> None:
    texts = originals("0.5.9")
    texts[SERVER_ARGS] = texts[SERVER_ARGS].replace("# Handle model loading format.", "# edited on the box")
    plan_patch("0.5.9", texts)  # the anchors alone cannot tell
    with pytest.raises(PatchRefused, match=r"srt/server_args.py: edited by hand .*RECORD"):
        plan_patch("0.5.9", texts, record=record("0.5.9"))


def test_an_anchor_found_twice_is_refused() -> None:
    texts = originals("0.5.10")
    texts[SERVER_ARGS] += "\n    speculative_num_draft_tokens: Optional[int] = None\n"
    with pytest.raises(PatchRefused, match="found 2 times, expected once"):
        plan_patch("0.5.10", texts)


def test_eagle_worker_must_end_with_the_class() -> None:
    texts = originals("0.5.8")
    texts["srt/speculative/eagle_worker_v2.py"] += "\n\ndef helper():\n    pass\n"
    with pytest.raises(PatchRefused, match="EAGLEWorkerV2 is not the last definition"):
        plan_patch("0.5.8", texts)


def _patched(version: str) -> dict[str, str]:
    return {c.path: c.after for c in plan_patch(version, originals(version)).changes}


def test_edited_inserted_code_is_patched_but_modified() -> None:
    texts = _patched("0.5.9")
    texts["srt/managers/scheduler.py"] = texts["srt/managers/scheduler.py"].replace(
        'logging.warning(f"Updating {k} to {v!r} is rejected: {e}")', "pass")
    with pytest.raises(PatchRefused, match=r"patched but modified: srt/managers/scheduler.py"):
        plan_patch("0.5.9", texts)


def test_a_patched_file_edited_elsewhere_is_caught_by_the_release_sha() -> None:
    plan = plan_patch("0.5.11", originals("0.5.11"))
    texts = {c.path: c.after for c in plan.changes}
    texts[SERVER_ARGS] = texts[SERVER_ARGS].replace("# Handle model loading format.", "# edited")
    expected = {c.path: c.sha256_after for c in plan.changes}
    assert plan_patch("0.5.11", texts).status == "applied"  # the inserted code is intact
    with pytest.raises(PatchRefused, match=r"patched but modified: srt/server_args.py"):
        plan_patch("0.5.11", texts, expected=expected)


def test_a_modified_new_module_is_refused() -> None:
    texts = _patched("0.5.12")
    texts[NEW_MODULE] = texts[NEW_MODULE].replace("NEVER = -1", "NEVER = -2")
    with pytest.raises(PatchRefused, match=r"patched but modified: srt/speculative/spec_batch_threshold.py"):
        plan_patch("0.5.12", texts)


def test_a_half_patched_tree_is_refused() -> None:
    texts = originals("0.5.7")
    texts[SERVER_ARGS] = _patched("0.5.7")[SERVER_ARGS]
    with pytest.raises(PatchRefused, match=r"partly applied: srt/server_args.py patched"):
        plan_patch("0.5.7", texts)


def test_a_missing_target_file_is_refused() -> None:
    texts = originals("0.5.6")
    del texts["srt/managers/scheduler.py"]
    with pytest.raises(PatchRefused, match="srt/managers/scheduler.py: file not found"):
        plan_patch("0.5.6", texts)


# --------------------------------------------------------------------------- versions and thresholds


@pytest.mark.parametrize(("version", "strategy"), [
    ("0.5.6", "patch"), ("0.5.9", "patch"), ("0.5.12", "patch"), ("0.5.6.post2", "patch"),
    ("0.5.10.post1", "patch"), ("0.5.14", "patch"), ("0.5.14.post1", "patch"), ("0.5.15.post1", "patch"),
    ("0.5.16", "patch"), ("0.5.17", "patch"), ("0.5.18", "native"), ("0.5.23", "native"),
    ("0.6.0", "native"),
])
def test_strategy_for_supported_versions(version: str, strategy: str) -> None:
    assert strategy_for(version) == strategy
    # 0.5.6-0.5.12 also change the scheduler's FutureMap and prepare_for_decode for the lean plain step,
    # 0.5.6-0.5.11 the output processor's token stride (0.5.12 reads it from the result), and 0.5.14 on
    # the FutureMap, prepare_for_decode's host lengths, the scheduler's speculative KV estimate and its
    # result of a plain step (in the variants' file order)
    variant = variant_for(version) if strategy == "patch" else None
    files = ["srt/server_args.py", "srt/managers/scheduler.py", "srt/speculative/eagle_worker_v2.py"]
    if variant in ("0.5.6", "0.5.7", "0.5.8", "0.5.12"):
        files += ["srt/managers/overlap_utils.py", "srt/speculative/eagle_info_v2.py"]
    if variant in ("0.5.6", "0.5.7", "0.5.8"):
        files += ["srt/managers/scheduler_output_processor_mixin.py"]
    elif variant == "0.5.14":
        files[2:2] = ["srt/managers/overlap_utils.py", "srt/speculative/eagle_info_v2.py"]
        files[0:0] = ["srt/managers/scheduler_components/batch_result_processor.py", "srt/managers/schedule_batch.py"]
    elif variant in ("0.5.15", "0.5.16", "0.5.17"):
        # from 0.5.15 the plain slots and host lengths live in eagle_utils.py (eagle_info_v2.py is
        # gone), and from 0.5.16 a speculative decode allocates its KV in mem_cache/allocation.py
        files[2:2] = ["srt/managers/overlap_utils.py"]
        files[0:0] = ["srt/managers/scheduler_components/batch_result_processor.py", "srt/managers/schedule_batch.py"]
        files += ["srt/speculative/eagle_utils.py"] + (["srt/mem_cache/allocation.py"] if variant != "0.5.15" else [])
    assert TARGET_FILES(version) == ([] if strategy == "native" else
                                     files + ["srt/speculative/spec_batch_threshold.py"])


@pytest.mark.parametrize(("version", "why"), [
    ("0.5.5", "too old"), ("0.5.5.post3", "too old"), ("0.4.10", "too old"), ("0.5.13", "not supported"),
    ("0.5.13.post1", "not supported"), ("0.5.10.dev3+g1a2b3c", "not a release"), ("0.5.9rc1", "not a release"),
    ("0.5.9+cu128", "not a release"), ("", "not a release"), ("unknown", "not a release"),
])
def test_unsupported_versions_are_refused_with_version_and_ranges(version: str, why: str) -> None:
    with pytest.raises(PreflightError) as err:
        strategy_for(version)
    assert err.value.exit_code == 3
    assert why in str(err.value)
    assert SUPPORTED in str(err.value)
    assert (version in str(err.value)) if version else "''" in str(err.value)


@pytest.mark.parametrize("value", [-1, 0, 5, "32", " 7 ", "+3", MAX_THRESHOLD])
def test_thresholds_accepted(value: object) -> None:
    assert parse_threshold(value) == int(str(value).strip())


@pytest.mark.parametrize(("value", "message"), [
    (-2, "below -1"), ("-2", "below -1"), ("abc", "not an integer"), ("1e3", "not an integer"),
    ("1.5", "not an integer"), ("", "not an integer"), (True, "expected an integer"),
    (MAX_THRESHOLD + 1, "larger than 1,000,000"), ("99999999999999999999", "larger than"),
])
def test_thresholds_refused_with_usage_errors(value: object, message: str) -> None:
    with pytest.raises(UsageError, match=message) as err:
        parse_threshold(value, "--threshold")
    assert err.value.exit_code == 2
    assert str(err.value).startswith("--threshold: ")


@pytest.mark.parametrize(("version", "preference", "strategy"), [
    ("0.5.14", "auto", "patch"), ("0.5.14", "patch", "patch"), ("0.5.14", "native", "native"),
    ("0.5.12", "patch", "patch"), ("0.5.6", "auto", "patch"), ("0.5.23", "native", "native"),
    ("0.5.23", "auto", "native"),
    # variants measured on a GPU: "auto" takes the patch, "native" still gets the native route
    ("0.5.15", "auto", "patch"), ("0.5.15.post1", "auto", "patch"), ("0.5.16", "auto", "patch"),
    ("0.5.17", "auto", "patch"), ("0.5.17", "native", "native"),
    # variants not measured on a GPU: "auto" stays native, "patch" takes them
    *((v, p, {"auto": "native", "patch": "patch", "native": "native"}[p])
      for v in ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23") for p in ("auto", "patch", "native")),
])
def test_the_host_strategy_key_picks_where_a_release_allows_both(version: str, preference: str, strategy: str) -> None:
    assert strategy_for(version, preference) == strategy


@pytest.mark.parametrize(("version", "preference", "why"), [
    ("0.5.12", "native", 'strategy = "native" cannot serve sglang 0.5.12: the native strategy needs'),
    ("0.5.6.post1", "native", "from sglang 0.5.14"),
    ("0.5.24", "patch", 'strategy = "patch" cannot serve sglang 0.5.24: dynctl has no patch variant'),
    ("0.6.0", "patch", "variants: 0.5.6, 0.5.7, 0.5.8, 0.5.12, 0.5.14, 0.5.15, 0.5.16, 0.5.17, 0.5.18, "
                       "0.5.19, 0.5.20, 0.5.21, 0.5.22"),
    ("0.5.13", "native", "sglang 0.5.13 is not supported"),
])
def test_a_strategy_the_release_cannot_take_is_refused(version: str, preference: str, why: str) -> None:
    with pytest.raises(PreflightError, match=re.escape(why)) as err:
        strategy_for(version, preference)
    assert err.value.exit_code == 3


# --------------------------------------------------------------------------- sglang 0.5.14's own contract


def _source(version: str, path: str) -> str:
    text = wheel_text(version, path)
    assert text is not None, f"sglang {version} has no {path}"
    return text


def _function(text: str, cls_name: str | None, name: str) -> ast.FunctionDef:
    tree = ast.parse(text)
    scope = tree if cls_name is None else next(
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    return next(n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == name)


# Where each release keeps what the ScheduleBatch fast path reads (the adapter fragments follow these).
_RANKS_IN_PS = {"0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20"}  # the worker's ranks are in self.ps
_RANKS_IN_CONTEXT = {"0.5.21", "0.5.22"}  # no ranks of its own: get_parallel() (the adapter's tp_rank property)
# From 0.5.16: ScheduleBatch lost capture_hidden_mode (a forward keyword), the workers are properties of
# BaseSpecWorker, verify is run_eagle_verify, the hybrid-model helpers are in configs/hybrid_arch.
_FROM_0_5_16 = _RANKS_IN_PS | _RANKS_IN_CONTEXT
_CAPTURE_MODE_KEYWORD = _FROM_0_5_16
# forward_batch_generation's arguments after on_publish: grammar_barrier (used only for batches with a
# grammar, which stay on verify) and, from 0.5.19, pp_proxy_tensors (pipeline parallelism does not arm)
_FORWARD_EXTRA = {"0.5.17": ["grammar_barrier"], "0.5.18": ["grammar_barrier"],
                  **dict.fromkeys(("0.5.19", "0.5.20", "0.5.21", "0.5.22"), ["grammar_barrier", "pp_proxy_tensors"])}
# The write-after-read barrier: the spec worker's runner property and the model runner's event.
_WAR = dict.fromkeys(("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22"),
                     ("last_shared_read_runner", "shared_read_done_event"))
_WAR_BEFORE = ("war_fastpath_runner", "war_fastpath_read_done_event")


def _server_args_fields(version: str) -> set[str]:
    """ServerArgs's fields; from 0.5.20 it composes the namespace classes of arg_groups/fields/."""
    with zipfile.ZipFile(sglang_wheel(version)) as wheel:
        parts = [n[len("sglang/"):] for n in wheel.namelist()
                 if n.startswith("sglang/srt/arg_groups/fields/") and n.endswith(".py")]
    fields = _dataclass_fields(_source(version, "srt/server_args.py"), "ServerArgs")
    for part in parts:
        tree = ast.parse(_source(version, part))
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            fields |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return fields


def _adapter_batch_fields(version: str) -> tuple[str, ...]:
    """The ScheduleBatch fields the variant's adapter says the step changes (and restores)."""
    adapter = next(ins for recipe in recipes(variant_for(version)) for ins in recipe.insertions
                   if ins.fragment.startswith("eagle_worker_v2.adapt-"))
    cls = ast.parse("class Adapter:\n" + adapter.text).body[0]
    node = next(n for n in cls.body if isinstance(n, ast.Assign) and n.targets[0].id == "_SPEC_DISABLE_BATCH_FIELDS")
    return tuple(ast.literal_eval(node.value))


@pytest.mark.parametrize("version", SCHEDULE_BATCH_VERSIONS)
def test_what_the_schedule_batch_fast_path_uses_exists_in_the_release(version: str) -> None:
    """Every field, attribute and helper the 0.5.14+ plain-decode step touches is there, used as it expects."""
    variant = variant_for(version)
    sb = _dataclass_fields(_source(version, "srt/managers/schedule_batch.py"), "ScheduleBatch")
    fields = set(_adapter_batch_fields(version))
    assert {"forward_mode", "input_ids", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "out_cache_loc",
            "spec_info"} <= fields
    assert fields | {"req_pool_indices", "has_grammar", "return_logprob", "return_hidden_states",
                     "is_extend_in_batch"} <= sb
    keyword = variant in _CAPTURE_MODE_KEYWORD
    assert ("capture_hidden_mode" in sb) is (not keyword) and ("seq_lens_cpu_cache" in sb) is (not keyword)
    # ForwardBatch is built from the ScheduleBatch: a given capture_hidden_mode overrides the derived one, a
    # seq_lens_cpu_cache overrides seq_lens_cpu (cleared by the step), and DECODE positions are seq_lens - 1
    fbi = _source(version, "srt/model_executor/forward_batch_info.py")
    init_new = ast.unparse(_function(fbi, "ForwardBatch", "init_new"))
    for used in ("if capture_hidden_mode is None:", "seq_lens_cpu = batch.seq_lens_cpu",
                 "ret.positions = clamp_position(batch.seq_lens)", "input_ids=batch.input_ids",
                 "out_cache_loc=batch.out_cache_loc", "spec_info=batch.spec_info",
                 *(() if keyword else ("capture_hidden_mode = batch.capture_hidden_mode",
                                       "seq_lens_cpu = seq_lens_cpu_cache"))):
        assert used in init_new, used
    tp_node = _function(_source(version, "srt/managers/tp_worker.py"), "TpModelWorker", "forward_batch_generation")
    tp = ast.unparse(tp_node)
    if keyword:
        assert "capture_hidden_mode" in [a.arg for a in tp_node.args.kwonlyargs]
        # 0.5.23 may fold an encoder-SWA replay into an extend batch first (folded stays None for a decode)
        assert ("ForwardBatch.init_new(batch, self.model_runner, capture_hidden_mode=capture_hidden_mode" in tp
                or "ForwardBatch.init_new(batch if folded is None else folded.batch, self.model_runner, "
                   "capture_hidden_mode=capture_hidden_mode" in tp)
        assert "batch_result.next_token_ids = self.model_runner.sample(" in tp
    else:
        assert "forward_batch = ForwardBatch.init_new(batch, self.model_runner)" in tp
        assert "batch_result.next_token_ids = self.model_runner.sample(logits_output, forward_batch)" in tp

    result = _dataclass_fields(_source(version, "srt/managers/utils.py"), "GenerationBatchResult")
    assert {"logits_output", "next_token_ids", "can_run_cuda_graph", "accept_lens", "new_seq_lens",
            "next_draft_input", "speculative_num_draft_tokens"} <= result
    draft = _dataclass_fields(_source(version, "srt/speculative/eagle_info.py"), "EagleDraftInput")
    assert {"bonus_tokens", "topk_p", "topk_index", "hidden_states", "draft_probs"} <= draft
    # the scheduler reads D tokens per request at the stride the result carries, accept_lens of them
    processor = _source(version, "srt/managers/scheduler_components/batch_result_processor.py")
    assert "stride = result.speculative_num_draft_tokens" in processor
    assert "accept_tokens = next_token_ids[i * stride : i * stride + accept_lens[i]]" in processor

    # the plain step reads the first of a request's allocated slots from the pool at seq_len
    pool = _source(version, "srt/mem_cache/memory_pool.py")
    assert "self.req_to_token = torch.zeros(" in ast.unparse(_function(pool, "ReqToTokenPool", "__init__"))
    if variant in LEAN_SCHEDULE_BATCH_VARIANTS:
        # the FutureMap members the lean resolve and stash read (bonus tokens only on a plain step)
        overlap = _source(version, "srt/managers/overlap_utils.py")
        future_map = _self_attrs(overlap, "FutureMap")
        assert {"output_tokens_buf", "need_topk", "topk_p_buf", "topk_index_buf", "need_hidden_states",
                "hidden_states_buf", "_forward_buf_initialized"} <= future_map
        stash = ast.unparse(_function(overlap, "FutureMap", "stash"))
        assert "self.output_tokens_buf[indices] = " in stash and "self._lazy_init_forward_buf(" in stash
        resolve = ast.unparse(_function(overlap, "FutureMap", "_resolve_spec_extras"))
        assert "indices = draft_input.future_indices" in resolve and "draft_input.bonus_tokens = " in resolve
        # the scheduler snapshots a speculative batch whole around the worker, other batches' sampling info only
        isolation = ast.unparse(_function(_source(version, "srt/managers/scheduler.py"), "Scheduler", "_forward_isolation"))
        assert "if snapshot_v2_full else None" in isolation and "batch.sampling_info = sched_sampling_info" in isolation
    # a spec step's logprobs: one row per request of its accepted tokens, top-k flat at i * row + j
    assert "accepted_logprobs = next_token_logprobs[i]" in processor
    assert "flat_idx = i * max_accept + j" in processor
    assert "def record_stream_each(tensors, stream):" in _source(version, "srt/speculative/spec_utils.py")

    worker = _source(version, "srt/speculative/eagle_worker_v2.py")
    eagle = _self_attrs(worker, "EAGLEWorkerV2")
    if variant in _FROM_0_5_16:  # from 0.5.16 the workers are properties of BaseSpecWorker
        eagle |= _self_attrs(_source(version, "srt/speculative/base_spec_worker.py"), "BaseSpecWorker")
        eagle |= {"req_to_token_pool"} if "self.req_to_token_pool = req_to_token_pool" in worker else set()
    rank = "ps" if variant in _RANKS_IN_PS else None if variant in _RANKS_IN_CONTEXT else "tp_rank"
    war_runner, war_event = _WAR.get(variant, _WAR_BEFORE)
    assert {"server_args", *filter(None, [rank]), "device", "speculative_num_draft_tokens", "req_to_token_pool",
            "target_worker", "draft_worker", war_runner} <= eagle
    if rank != "tp_rank":  # nothing of the release's own sets self.tp_rank, which the adapter makes a property
        assert "tp_rank" not in eagle
        assert ("self.ps.tp_rank" if rank == "ps" else "get_parallel().pp_group.is_last_rank") in worker
    if rank is None:  # the adapter's source of the rank: what the launcher publishes, as the release reads it
        assert '"tp_rank": tp_rank,' in _source(version, "srt/runtime_context.py")
        assert "tp_rank = get_parallel().tp_rank" in _source(version, "srt/model_loader/loader.py")
    forward = _function(worker, "EAGLEWorkerV2", "forward_batch_generation")
    # 0.5.17 adds grammar_barrier, used only for batches with a grammar (which stay on verify)
    assert [a.arg for a in forward.args.args][:3] == ["self", "batch", "on_publish"]
    assert [a.arg for a in forward.args.args][3:] == _FORWARD_EXTRA.get(variant, [])
    assert "on_publish(batch_output.new_seq_lens)" in ast.unparse(forward)
    # a verify with accept length 1 returns these, which the disabled step mirrors
    verify = ast.unparse(_function(worker, "EAGLEWorkerV2", "verify"))
    if variant in _FROM_0_5_16:  # from 0.5.16 verify is run_eagle_verify, given the worker's D
        assert "num_draft_tokens=self.speculative_num_draft_tokens" in verify
        verify = ast.unparse(_function(_source(version, "srt/speculative/eagle_worker_common.py"), None,
                                       "run_eagle_verify"))
        verify = verify.replace("speculative_num_draft_tokens=num_draft_tokens",
                                "speculative_num_draft_tokens=self.speculative_num_draft_tokens")
    for used in ("next_token_ids=predict", "speculative_num_draft_tokens=self.speculative_num_draft_tokens",
                 "accept_lens=accept_lens", "new_seq_lens=new_seq_lens",
                 "next_draft_input = EagleDraftInput(bonus_tokens=bonus_tokens)"):
        assert used in verify, used
    # the scheduler passes on_publish (the FutureMap), stashes next_draft_input, and its write-after-read
    # barrier waits on the spec worker's runner's read-done event, else on the whole forward
    scheduler = _source(version, "srt/managers/scheduler.py")
    run_batch = ast.unparse(_function(scheduler, "Scheduler", "run_batch"))
    assert ("'on_publish': partial(self.future_map.publish, future_indices)" in run_batch
            or "fwd_kwargs['on_publish'] = partial(self.future_map.publish, future_indices)" in run_batch)
    # the step's host lengths are resolved before its inputs (and the plain-step decision)
    assert run_batch.index("self.future_map.resolve_seq_lens_cpu(batch)") < run_batch.index(
        "resolve_forward_inputs(batch, self.future_map)")
    if variant == "0.5.14":
        assert "self.future_map.stash(future_indices, stash_payload)" in run_batch
    else:  # from 0.5.15 through a helper that relays every field of next_draft_input
        assert ("self._relay_forward_payload(future_indices, batch_result)" in run_batch
                or "self._relay_forward_payload(batch, future_indices, batch_result)" in run_batch)
        relay = ast.unparse(_function(scheduler, "Scheduler", "_relay_forward_payload"))
        assert "RelayPayload.from_draft_input(batch_result.next_draft_input)" in relay
        assert "self.future_map.stash(future_indices, payload)" in relay
    barrier = ast.unparse(_function(scheduler, "Scheduler", "_apply_war_barrier"))
    assert f"runner = self.model_worker.{war_runner}" in barrier
    assert f"ev = runner.{war_event}" in barrier
    assert "self.schedule_stream.wait_stream(self.forward_stream)" in barrier
    # the hand-over point: the collector exists before init_model_worker, which captures every graph
    init = ast.unparse(_function(scheduler, "Scheduler", "__init__"))
    if variant == "0.5.14":
        assert init.index("self.metrics_collector = ") < init.index("self.init_model_worker()")
    else:  # from 0.5.15 in a method of its own, called first
        assert init.index("self.init_metrics_collector(") < init.index("self.init_model_worker()")
        setup = ast.unparse(_function(scheduler, "Scheduler", "init_metrics_collector"))
        assert "self.metrics_collector = " in setup
    model_worker = ast.unparse(_function(scheduler, "Scheduler", "init_model_worker"))
    assert "self.init_all_cuda_graphs()" in model_worker and "self.maybe_init_draft_worker()" in model_worker
    collector = _source(version, "srt/observability/metrics_collector.py")
    assert "self.labels = labels" in ast.unparse(_function(collector, "SchedulerMetricsCollector", "__init__"))


@pytest.mark.parametrize("version", SCHEDULE_BATCH_VERSIONS)
def test_what_the_schedule_batch_plain_decode_graphs_use_exists_in_the_release(version: str) -> None:
    runner = _source(version, "srt/model_executor/model_runner.py")
    assert "def _get_attention_backend(self, init_new_workspace: bool = False):" in runner
    attrs = _self_attrs(runner, "ModelRunner")
    assert {"attn_backend", "decode_cuda_graph_runner", "spec_algorithm", "init_new_workspace", "model_config",
            _WAR.get(variant_for(version), _WAR_BEFORE)[1]} <= attrs
    if variant_for(version) in _FROM_0_5_16:
        # the hybrid-model helpers left the runner: a getattr on it would find nothing and stop refusing
        assert not {"hybrid_gdn_config", "mamba2_config"} & attrs
        hybrid = _function(_source(version, "srt/configs/hybrid_arch.py"), None, "mambaish_config")
        assert [a.arg for a in hybrid.args.args] == ["model_config"]
        assert "hybrid_gdn_config(model_config)" in ast.unparse(hybrid) and "mamba2_config(model_config)" in ast.unparse(hybrid)
    else:  # properties: the adapter compares their values with None
        for name in ("hybrid_gdn_config", "mamba2_config"):
            prop = _function(runner, "ModelRunner", name)
            assert [ast.unparse(d) for d in prop.decorator_list] == ["property"], name
    forward = ast.unparse(_function(runner, "ModelRunner", "_forward_raw"))
    # None makes the step eager; the graphs are picked by batch size, not by forward mode
    assert "self.decode_cuda_graph_runner and self.decode_cuda_graph_runner.can_run_graph(forward_batch)" in forward
    assert "self.decode_cuda_graph_runner.execute(" in forward
    # without CUDA graphs the decode runner is the eager runner (why arming checks the class)
    if variant_for(version) in _FROM_0_5_16:
        graph_setup = _source(version, "srt/model_executor/model_runner_components/cuda_graph_setup.py")
        assert "self.decode_cuda_graph_runner = capture.decode.runner" in runner
        assert "eager_runner = EagerRunner(model_runner" in graph_setup and "runner=eager_runner," in graph_setup
    else:
        assert "self.decode_cuda_graph_runner = self.eager_runner" in runner
    assert "class EagerRunner(BaseRunner):" in _source(version, "srt/model_executor/runner/eager_runner.py")
    assert "return cls.NONE" in _source(version, "srt/speculative/spec_info.py")
    assert "from sglang.srt.model_executor.runner import (\n    DecodeCudaGraphRunner," in _source(
        version, "srt/speculative/eagle_worker_v2.py")

    graphs = _source(version, "srt/model_executor/runner/decode_cuda_graph_runner.py")
    init_node = _function(graphs, "DecodeCudaGraphRunner", "__init__")
    assert "attn_backend" in [a.arg for a in init_node.args.kwonlyargs]
    init = ast.unparse(init_node)
    # TARGET_VERIFY only for a speculative model runner; the backend given is the one set up and captured on
    assert "if model_runner.spec_algorithm.is_speculative():" in init
    assert "self.capture_forward_mode = ForwardMode.TARGET_VERIFY" in init
    assert "self.capture_forward_mode = ForwardMode.DECODE" in init
    assert "self.attn_backend = attn_backend or model_runner.attn_backend" in init
    assert "self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)" in init
    assert "self.capture_bs" in init and "self.capture()" in init
    # a DECODE replay records the read-done event the WAR barrier may wait on
    execute = ast.unparse(_function(graphs, "DecodeCudaGraphRunner", "execute"))
    if variant_for(version) in _WAR:
        # from 0.5.18 every replay publishes where the attention backend declares its reads end
        assert "shared_read_ends = self._resolve_shared_read_ends(" in execute
        for where in ("PRE_REPLAY", "IN_REPLAY", "POST_REPLAY"):
            assert f"if shared_read_ends is SharedReadEnds.{where}:" in execute
        publish = ast.unparse(_function(graphs, "DecodeCudaGraphRunner", "_publish_read_done"))
        assert "self.model_runner.shared_read_done_event = read_done" in publish
    else:
        assert "forward_batch.forward_mode.is_decode()" in execute
        assert "self.model_runner.war_fastpath_read_done_event = read_done" in execute

    args = _server_args_fields(version)
    assert {"speculative_algorithm", "disable_overlap_schedule", "speculative_eagle_topk", "enable_dp_attention",
            "enable_multi_layer_eagle", "enable_two_batch_overlap", "enable_pdmux", "speculative_adaptive",
            "enable_lora", "enable_metrics", "enable_metrics_for_all_schedulers", "max_running_requests",
            "speculative_num_draft_tokens"} <= args


@pytest.mark.parametrize("version", SCHEDULE_BATCH_VERSIONS)
def test_the_annotated_field_gives_the_flag_through_sglangs_own_cli_derivation(version: str, tmp_path) -> None:
    """sglang's arg_utils (stdlib only) turns the inserted field into `--speculative-disable-batch-threshold N`."""
    import argparse
    import dataclasses
    import importlib.util
    import sys
    import typing

    from dynctl.patching.recipe import fragment_text

    source = tmp_path / "arg_utils.py"
    source.write_text(_source(version, "srt/arg_groups/arg_utils.py"))
    spec = importlib.util.spec_from_file_location("sglang_arg_utils", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        # the class resolves its annotations in the module it names: arg_utils has A and Optional
        namespace = {"__name__": spec.name, "A": module.A, "Optional": typing.Optional,
                     "NS": getattr(module, "NS", None)}
        field, path = next((ins.fragment, recipe.path) for recipe in recipes(variant_for(version))
                           for ins in recipe.insertions if ins.fragment.startswith("server_args.field"))
        if path == SPEC_FIELDS:  # from 0.5.20 a msgspec struct in a module of its own, as the release's Spec
            import types

            import msgspec

            fields_module = types.ModuleType("sglang_spec_fields")
            fields_module.__dict__.update(A=module.A, Optional=typing.Optional, msgspec=msgspec)
            sys.modules[fields_module.__name__] = fields_module
            exec("class Spec(msgspec.Struct):\n    _NS_PATH = 'spec'\n" + fragment_text(field), fields_module.__dict__)
            args_cls = fields_module.Spec
            # /set_internal_state's override routes a key to the namespace of the class that declares it
            assert module.namespace_of(args_cls)["speculative_disable_batch_threshold"] == "spec"
        else:
            exec("class Args:\n" + fragment_text(field), namespace)
            args_cls = dataclasses.dataclass(namespace["Args"])
        parser = argparse.ArgumentParser()
        module.add_cli_args_from_dataclass(parser, args_cls)
    finally:
        del sys.modules[spec.name]
        sys.modules.pop("sglang_spec_fields", None)
    assert parser.parse_args(["--speculative-disable-batch-threshold", "7"]).speculative_disable_batch_threshold == 7
    assert parser.parse_args([]).speculative_disable_batch_threshold is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-disable-batch-threshold", "abc"])
