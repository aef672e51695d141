"""AST checks that a patched sglang tree carries every piece of the patch (shared by the patch tests)."""

from __future__ import annotations

import ast
import builtins

from dynctl.patching.engine import _unapply_recipe
from dynctl.patching.recipe import recipes
from dynctl.patching.versions import variant_for
from dynctl.base.sglang import parse_version

FLAG = "--speculative-disable-batch-threshold"
FIELD = "speculative_disable_batch_threshold"
WORKER_METHODS = {"_skip_speculation", "_init_spec_disable", "_capture_spec_disable_graphs",
                  "_spec_disable_plain_target", "_spec_disable_one_token_draft",
                  "_forward_batch_generation_no_spec", "_no_spec_draft_extend",
                  "_no_spec_bonus_tokens", "_no_spec_finish_result", "_no_spec_draft_context",
                  "_spec_disable_threshold", "_spec_disable_keeps_verify", "_spec_disable_decide_early"}
# sglang 0.5.14 on: one fragment, the draft skipped on disabled steps (no one-token draft-extend),
# and per-release adapter methods.
WORKER_METHODS_0_5_14 = {"_skip_speculation", "_init_spec_disable", "_capture_spec_disable_graphs",
                         "_spec_disable_plain_target", "_forward_batch_generation_no_spec",
                         "_spec_disable_threshold", "_spec_disable_keeps_recurrent_state",
                         "_spec_disable_target_decode", "_spec_disable_clear_read_done",
                         "_spec_disable_hand_over_read_done", "_spec_disable_keeps_verify",
                         "_spec_disable_decide_early"}


# Variants whose plain-decode step also cuts the speculative scheduler's bookkeeping (FutureMap, host
# lengths, one token per request).
LEAN_PLAIN_STEP_VARIANTS = ("0.5.6", "0.5.7", "0.5.8", "0.5.12")
# ... of which these also patch the output processor to read one token per request from a plain step's result.
STRIDE_FROM_RESULT_VARIANTS = ("0.5.6", "0.5.7", "0.5.8")
# The ScheduleBatch variants whose FutureMap and forward isolation take the lean plain step (0.5.19 on: not
# yet; their plain step relays the draft state it resolved, as before).
LEAN_SCHEDULE_BATCH_VARIANTS = ("0.5.14", "0.5.15", "0.5.16", "0.5.17", "0.5.18")


def takes_schedule_batch(variant: str) -> bool:
    """Variants of the releases whose worker takes the ScheduleBatch (0.5.14 and later)."""
    return parse_version(variant) >= (0, 5, 14)


def worker_methods(variant: str) -> set[str]:
    return WORKER_METHODS_0_5_14 if takes_schedule_batch(variant) else WORKER_METHODS


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
    assert len(found) == 1, f"class {name}: found {len(found)}"
    return found[0]


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    found = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"{cls.name}.{name}: found {len(found)}"
    return found[0]


def check_field(text: str, cls_name: str = "ServerArgs") -> dict[str, ast.AnnAssign]:
    """The threshold field of `cls_name` (None by default, annotated as its neighbour is); its class's fields."""
    cls = _class(ast.parse(text), cls_name)
    fields = {n.target.id: n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert FIELD in fields, f"{cls_name} has no speculative_disable_batch_threshold field"
    field = fields[FIELD]
    assert isinstance(field.value, ast.Constant) and field.value.value is None
    annotation = field.annotation
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "A":
        # the command line is derived from the annotation: Optional[int] gives type=int, the help text
        # is the string (sglang's own arg_utils, exercised in test_patching)
        inner, help_text, *markers = annotation.slice.elts
        assert ast.unparse(inner) == "Optional[int]"
        assert isinstance(help_text, ast.Constant) and "more than N requests" in help_text.value
        # where fields carry a namespace marker (0.5.17-0.5.19: NS("spec")), ours has the one of its neighbour
        neighbour = fields["speculative_num_draft_tokens"].annotation.slice.elts[2:]
        assert [ast.unparse(m) for m in markers] == [ast.unparse(m) for m in neighbour]
    return fields


def check_resolution_pipeline(text: str) -> None:
    """sglang 0.5.19 on: the startup check follows the speculative hook of the resolution pipeline and
    reads what resolution declared (resolving_view)."""
    check = "check_threshold_args(resolving_view(server_args))"
    holders = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and check in ast.unparse(n)]
    assert len(holders) == 1, f"{check} found in {len(holders)} functions"
    body = ast.unparse(holders[0])
    hook = "run_hook(handle_speculative_decoding, server_args)"
    hook = hook if hook in body else "handle_speculative_decoding(server_args)"
    assert body.index(hook) < body.index(check)
    assert "from sglang.srt.arg_groups.overrides import resolving_view" in body


def check_internal_state(text: str) -> None:
    """sglang 0.5.22 on: /set_internal_state's handler table takes the threshold, validated by the policy and
    rejected with the release's own UpdateRejected."""
    tree = ast.parse(text)
    table = ast.unparse(_method(_class(tree, "SchedulerInternalStateController"), "_update_handlers"))
    assert f"'{FIELD}': _UpdateHandler(_validate_spec_disable_batch_threshold, _override)" in table
    validate = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                    and n.name == "_validate_spec_disable_batch_threshold")
    assert [a.arg for a in validate.args.args] == ["key", "value"]
    body = ast.unparse(validate)
    assert "validate_threshold(value)" in body and "raise UpdateRejected(" in body


def check_server_args(text: str, variant: str = "0.5.12") -> None:
    tree = ast.parse(text)
    cls = _class(tree, "ServerArgs")
    fields = check_field(text)
    field = fields[FIELD]
    post_init = ast.unparse(_method(cls, "__post_init__"))
    # from 0.5.15 model overrides declare settings that reach the fields at the end of __post_init__
    # (materialize_declarations): the startup check reads through resolved_view until then
    declared = parse_version(variant) >= (0, 5, 15)
    check = "check_threshold_args(resolved_view(self))" if declared else "check_threshold_args(self)"
    if check not in post_init:
        # from 0.5.18 __post_init__ runs an ordered pipeline method, which holds the check
        pipeline = [n for n in cls.body if isinstance(n, ast.FunctionDef)
                    and check in ast.unparse(n)]
        assert len(pipeline) == 1 and f"self.{pipeline[0].name}()" in post_init
        post_init = ast.unparse(pipeline[0])
    assert check in post_init
    if declared:
        assert post_init.index(check) < post_init.index("materialize_declarations(self)")
    if takes_schedule_batch(variant):
        assert ast.unparse(field.annotation).startswith("A[")
        assert post_init.index("handle_speculative_decoding(self)") < post_init.index(check)
        return
    assert ast.unparse(field.annotation) == "Optional[int]"
    calls = [n for n in ast.walk(_method(cls, "add_cli_args")) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
             and n.args and isinstance(n.args[0], ast.Constant) and n.args[0].value == FLAG]
    assert len(calls) == 1, f"add_argument({FLAG!r}) found {len(calls)} times"
    kwargs = {k.arg: ast.unparse(k.value) for k in calls[0].keywords}
    assert kwargs["type"] == "int"
    assert kwargs["default"] == f"ServerArgs.{FIELD}"
    assert "help" in kwargs
    assert post_init.index("_handle_speculative_decoding()") < post_init.index(check)


def check_scheduler(text: str, internal_state: bool = True) -> None:
    """The scheduler arms the threshold at startup and, unless a handler table elsewhere does
    (`internal_state` False: 0.5.22 on), lets /set_internal_state set it."""
    tree = ast.parse(text)
    if internal_state:
        method = _method(_class(tree, "Scheduler"), "set_internal_state")
        allow = [n for n in ast.walk(method) if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "args_allow_update" for t in n.targets)]
        assert len(allow) == 1
        names = {c.value for c in ast.walk(allow[0].value) if isinstance(c, ast.Constant)}
        assert FIELD in names, "speculative_disable_batch_threshold is not in set_internal_state's allow-list"
        assert "validate_threshold(v)" in ast.unparse(method)
    handover = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0])
                == "self.draft_worker.metrics_collector"]
    assert len(handover) == 1, "the scheduler does not hand its metrics collector to the spec worker"
    arm = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func)
           == "self.draft_worker._init_spec_disable"]
    assert len(arm) == 1, "the scheduler does not arm the threshold (and capture its graphs) at startup"


def check_eagle_worker(text: str, variant: str = "0.5.12") -> None:
    tree = ast.parse(text)
    cls = _class(tree, "EAGLEWorkerV2")
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    wanted = worker_methods(variant)
    assert wanted <= methods, f"missing methods: {wanted - methods}"
    first = _method(cls, "forward_batch_generation").body[0]
    if takes_schedule_batch(variant):
        # the decision taken when the scheduler resolved the step's inputs (the long-lived ScheduleBatch
        # must not carry it to the next step), else taken here
        assert ast.unparse(first) == "plain = batch.__dict__.pop('_spec_disable_plain', None)"
        second = _method(cls, "forward_batch_generation").body[1]
        assert isinstance(second, ast.If) and ast.unparse(second.test) == (
            "self._skip_speculation(batch) if plain is None else plain")
        assert ast.unparse(second.body[0]) == "return self._forward_batch_generation_no_spec(batch, on_publish)"
    else:
        # the decision taken when the scheduler resolved the step's inputs, else taken here
        assert ast.unparse(first) == "plain = getattr(model_worker_batch, '_spec_disable_plain', None)"
        second = _method(cls, "forward_batch_generation").body[1]
        assert isinstance(second, ast.If) and ast.unparse(second.test) == (
            "self._skip_speculation(model_worker_batch) if plain is None else plain")
        assert ast.unparse(second.body[0]) == "return self._forward_batch_generation_no_spec(model_worker_batch)"
    undefined = undefined_names(tree, cls, wanted)
    assert not undefined, f"names the patch uses but eagle_worker_v2.py does not define: {undefined}"


def undefined_names(tree: ast.Module, cls: ast.ClassDef, methods: set[str]) -> set[str]:
    """Global names read in `methods` that the module neither defines nor imports (a pyflakes subset)."""
    defined = set(dir(builtins))
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                defined |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    missing = set()
    for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in methods):
        local = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        local |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for n in ast.walk(fn):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local | defined:
                missing.add(n.id)
    return missing


def check_lean_plain_step(texts: dict[str, str], variant: str = "0.5.12") -> None:
    """sglang 0.5.6-0.5.12: a plain-decode step resolves and stores only what it reads and its lengths are
    not copied back from the device; 0.5.6-0.5.11: the scheduler reads one token per request from its result."""
    bonus = "bonus_tokens" if variant == "0.5.12" else "verified_id"
    overlap = _class(ast.parse(texts["srt/managers/overlap_utils.py"]), "FutureMap")
    resolve = ast.unparse(_method(overlap, "resolve_future"))
    assert "decide = getattr(self, '_spec_disable_decide', None)" in resolve
    # after the release keeps the indices alive on the forward stream (0.5.8 does not), before any gather
    assert resolve.index("indices = draft_input.future_indices.indices") < resolve.index("_spec_disable_decide")
    if "indices.record_stream(" in resolve:
        assert resolve.index("indices.record_stream(") < resolve.index("_spec_disable_decide")
    assert resolve.index("_spec_disable_decide") < resolve.index(
        "draft_input.topk_p = self.topk_p_buf[indices]")
    plain = resolve[resolve.index("if decide is not None and decide(model_worker_batch):"):]
    plain = plain[: plain.index("return") + len("return")]
    assert f"draft_input.{bonus} = self.{bonus}_buf[indices]" in plain
    assert "draft_input.new_seq_lens = self.new_seq_lens_buf[indices]" in plain
    store = ast.unparse(_method(overlap, "store_to_map_for_new_batch"))
    # before the buffers are first initialised (0.5.6: by a call that returns once they are)
    lazy = "if not self.buf_initialized:" if variant != "0.5.6" else "self._lazy_init_buf(draft_input)"
    assert store.index("if draft_input.topk_p is None and self.buf_initialized:") < store.index(lazy)
    assert f"self.{bonus}_buf[intv] = draft_input.{bonus}" in store.split(lazy)[0]
    mixin = _class(ast.parse(texts["srt/speculative/eagle_info_v2.py"]), "EagleDraftInputV2Mixin")
    prepare = ast.unparse(_method(mixin, "prepare_for_decode"))
    assert prepare.index("known = known_seq_lens(self, batch)") < prepare.index("batch.seq_lens.cpu()")
    scheduler = ast.unparse(_method(_class(ast.parse(texts["srt/managers/scheduler.py"]), "Scheduler"), "__init__"))
    assert scheduler.index("self.init_overlap()") < scheduler.index(
        "self.future_map._spec_disable_decide = self.draft_worker._spec_disable_decide_early")
    # the step returns one token per request and says so on its result, which is what the scheduler slices by
    step = ast.unparse(_method(_class(ast.parse(texts["srt/speculative/eagle_worker_v2.py"]), "EAGLEWorkerV2"),
                               "_forward_batch_generation_no_spec"))
    assert "tokens = result.next_token_ids = result.next_token_ids.to(torch.int32)" in step
    assert "result.speculative_num_draft_tokens = 1" in step
    assert step.count("result.next_token_ids =") == 1
    if variant in STRIDE_FROM_RESULT_VARIANTS:  # 0.5.12's own scheduler reads the stride from the result
        processor = ast.parse(texts["srt/managers/scheduler_output_processor_mixin.py"])
        resolve_tokens = ast.unparse(_method(_class(processor, "SchedulerOutputProcessorMixin"),
                                             "_resolve_spec_overlap_token_ids"))
        assert resolve_tokens.index("stride = self.draft_worker.speculative_num_draft_tokens") < resolve_tokens.index(
            "stride = getattr(result, 'speculative_num_draft_tokens', None) or stride") < resolve_tokens.index(
            "next_token_ids[i * stride:i * stride + accept_lens[i]]")


def check_lean_plain_step_schedule_batch(texts: dict[str, str]) -> None:
    """sglang 0.5.14 on: a plain-decode step resolves and stores only the bonus tokens, and the scheduler
    does not snapshot the whole batch around it."""
    overlap = _class(ast.parse(texts["srt/managers/overlap_utils.py"]), "FutureMap")
    resolve = ast.unparse(_method(overlap, "_resolve_spec_extras"))
    assert "decide = getattr(self, '_spec_disable_decide', None)" in resolve
    assert resolve.index("indices.record_stream(") < resolve.index("_spec_disable_decide") < resolve.index(
        "gather_spec_extras(")
    stash = ast.unparse(_method(overlap, "stash"))
    assert stash.index("payload.topk_p is None and self._forward_buf_initialized") < stash.index(
        "if not self._forward_buf_initialized:")
    # a plain step's rows and host lengths (old + 1) ride to the next resolve through the publish of that
    # step alone (tests/test_patch_plain_lens.py runs publish and resolve_seq_lens_cpu), set where the
    # plain step is decided
    assert "self._spec_disable_host_pending = (batch.req_pool_indices_cpu.clone(), host_lens)" in resolve
    assert resolve.index("decide(batch)") < resolve.index("self._spec_disable_host_pending = ") < resolve.index(
        "gather_spec_extras(")
    # prepare_for_decode's host kv lengths are pinned before their non-blocking copies to the device
    if "srt/speculative/eagle_info_v2.py" in texts:
        prepare = ast.unparse(_method(_class(ast.parse(texts["srt/speculative/eagle_info_v2.py"]),
                                             "EagleDraftInputV2Mixin"), "prepare_for_decode"))
    else:
        prepare = ast.unparse(next(n for n in ast.parse(texts["srt/speculative/eagle_utils.py"]).body
                                   if isinstance(n, ast.FunctionDef) and n.name == "eagle_prepare_for_decode"))
    assert prepare.index("nxt_kv_lens_cpu = torch.tensor(") < prepare.index(
        "cur_kv_lens_cpu, nxt_kv_lens_cpu = (cur_kv_lens_cpu.pin_memory(), nxt_kv_lens_cpu.pin_memory())") < (
        prepare.index("cur_kv_lens_device = cur_kv_lens_cpu.to(device=batch.device, non_blocking=True)"))
    # the step hands the FutureMap and the scheduler the sampler's own tensor, unconverted (int64 when
    # greedy, the buffer's dtype), and accept lengths of 1 kept on the host: nothing to copy back
    step = ast.unparse(_method(_class(ast.parse(texts["srt/speculative/eagle_worker_v2.py"]), "EAGLEWorkerV2"),
                               "_forward_batch_generation_no_spec"))
    assert step.index("sampled = result.next_token_ids") < step.index(
        "next_draft = EagleDraftInput(bonus_tokens=sampled)")
    assert "result.next_token_ids =" not in step and "sampled.to(" not in step
    assert "self._spec_disable_ones = torch.ones(max(bs, 256), dtype=torch.int32)" in step
    assert step.index("self._spec_disable_ones = torch.ones(") < step.index("result.accept_lens = ones[:bs]")
    cls = _class(ast.parse(texts["srt/managers/scheduler.py"]), "Scheduler")
    init = ast.unparse(_method(cls, "__init__"))
    assert init.index("self.init_overlap()") < init.index(
        "self.future_map._spec_disable_decide = self.draft_worker._spec_disable_decide_early")
    isolation = ast.unparse(_method(cls, "_forward_isolation"))
    assert isolation.index("snapshot_v2_full = not batch.spec_algorithm.is_none()") < isolation.index(
        "if snapshot_v2_full and getattr(batch, '_spec_disable_plain', False):") < isolation.index(
        "sched_snapshot = ")


RESOLUTION_PIPELINE = "srt/arg_groups/pipeline.py"  # 0.5.19 on: the startup check
SPEC_FIELDS = "srt/arg_groups/fields/spec.py"  # 0.5.20 on: the field
INTERNAL_STATE = "srt/managers/scheduler_components/internal_state.py"  # 0.5.22 on: /set_internal_state


def check_all(texts: dict[str, str], variant: str = "0.5.12") -> None:
    if RESOLUTION_PIPELINE in texts:
        check_resolution_pipeline(texts[RESOLUTION_PIPELINE])
        if SPEC_FIELDS in texts:
            check_field(texts[SPEC_FIELDS], "Spec")
        else:
            check_field(texts["srt/server_args.py"])
    else:
        check_server_args(texts["srt/server_args.py"], variant)
    if INTERNAL_STATE in texts:
        check_internal_state(texts[INTERNAL_STATE])
    check_scheduler(texts["srt/managers/scheduler.py"], internal_state=INTERNAL_STATE not in texts)
    check_eagle_worker(texts["srt/speculative/eagle_worker_v2.py"], variant)
    ast.parse(texts["srt/speculative/spec_batch_threshold.py"])
    if variant in LEAN_PLAIN_STEP_VARIANTS:
        check_lean_plain_step(texts, variant)
    elif variant in LEAN_SCHEDULE_BATCH_VARIANTS:
        check_lean_plain_step_schedule_batch(texts)


def unpatched_text(version: str, path: str, text: str) -> str:
    """The text of a patched file with the patch taken out by the engine's own unapply (reverts use backups)."""
    for recipe in recipes(variant_for(version)):
        if recipe.path == path:
            stripped, _ = _unapply_recipe(text, recipe)
            return stripped
    raise KeyError(path)
