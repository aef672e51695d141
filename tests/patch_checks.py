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
                  "_no_spec_serves_logprobs", "_spec_disable_threshold", "_spec_disable_keeps_verify",
                  "_no_spec_result_tokens", "_spec_disable_decide_early"}
# sglang 0.5.14 on: one fragment, the draft skipped on disabled steps (no one-token draft-extend),
# and per-release adapter methods.
WORKER_METHODS_0_5_14 = {"_skip_speculation", "_init_spec_disable", "_capture_spec_disable_graphs",
                         "_spec_disable_plain_target", "_forward_batch_generation_no_spec",
                         "_spec_disable_threshold", "_spec_disable_keeps_recurrent_state",
                         "_spec_disable_target_decode", "_spec_disable_clear_read_done",
                         "_spec_disable_hand_over_read_done", "_spec_disable_keeps_verify"}


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


def check_server_args(text: str, variant: str = "0.5.12") -> None:
    tree = ast.parse(text)
    cls = _class(tree, "ServerArgs")
    fields = {n.target.id: n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert FIELD in fields, "ServerArgs has no speculative_disable_batch_threshold field"
    field = fields[FIELD]
    assert isinstance(field.value, ast.Constant) and field.value.value is None
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
        # the command line is derived from the annotation: Optional[int] gives type=int, the help text
        # is the string (sglang's own arg_utils, exercised in test_patching)
        annotation = field.annotation
        assert isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "A"
        inner, help_text, *markers = annotation.slice.elts
        assert ast.unparse(inner) == "Optional[int]"
        assert isinstance(help_text, ast.Constant) and "more than N requests" in help_text.value
        # where fields carry a namespace marker (0.5.17: NS("spec")), ours has the one of its neighbour
        neighbour = fields["speculative_num_draft_tokens"].annotation.slice.elts[2:]
        assert [ast.unparse(m) for m in markers] == [ast.unparse(m) for m in neighbour]
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


def check_scheduler(text: str) -> None:
    tree = ast.parse(text)
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
        assert isinstance(first, ast.If) and ast.unparse(first.test) == "self._skip_speculation(batch)"
        assert ast.unparse(first.body[0]) == "return self._forward_batch_generation_no_spec(batch, on_publish)"
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


def check_lean_plain_step(texts: dict[str, str]) -> None:
    """sglang 0.5.12: a plain-decode step resolves and stores only what it reads, and its lengths are
    not copied back from the device."""
    overlap = _class(ast.parse(texts["srt/managers/overlap_utils.py"]), "FutureMap")
    resolve = ast.unparse(_method(overlap, "resolve_future"))
    assert "decide = getattr(self, '_spec_disable_decide', None)" in resolve
    assert resolve.index("indices.record_stream(") < resolve.index("_spec_disable_decide") < resolve.index(
        "draft_input.topk_p = self.topk_p_buf[indices]")
    store = ast.unparse(_method(overlap, "store_to_map_for_new_batch"))
    assert store.index("if draft_input.topk_p is None and self.buf_initialized:") < store.index(
        "if not self.buf_initialized:")
    mixin = _class(ast.parse(texts["srt/speculative/eagle_info_v2.py"]), "EagleDraftInputV2Mixin")
    prepare = ast.unparse(_method(mixin, "prepare_for_decode"))
    assert prepare.index("known = known_seq_lens(self, batch)") < prepare.index("batch.seq_lens.cpu()")
    scheduler = ast.unparse(_method(_class(ast.parse(texts["srt/managers/scheduler.py"]), "Scheduler"), "__init__"))
    assert scheduler.index("self.init_overlap()") < scheduler.index(
        "self.future_map._spec_disable_decide = self.draft_worker._spec_disable_decide_early")


def check_all(texts: dict[str, str], variant: str = "0.5.12") -> None:
    check_server_args(texts["srt/server_args.py"], variant)
    check_scheduler(texts["srt/managers/scheduler.py"])
    check_eagle_worker(texts["srt/speculative/eagle_worker_v2.py"], variant)
    ast.parse(texts["srt/speculative/spec_batch_threshold.py"])
    if variant == "0.5.12":
        check_lean_plain_step(texts)


def unpatched_text(version: str, path: str, text: str) -> str:
    """The text of a patched file with the patch taken out by the engine's own unapply (reverts use backups)."""
    for recipe in recipes(variant_for(version)):
        if recipe.path == path:
            stripped, _ = _unapply_recipe(text, recipe)
            return stripped
    raise KeyError(path)
