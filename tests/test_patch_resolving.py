"""sglang 0.5.19-0.5.23: resolution declares settings beside the raw fields, and /set_internal_state
moved to a handler table (0.5.22). The patched worker's refusals run against the release's own
resolving_view (and 0.5.22's attn_dp_enabled_of, environ), and the patched handler table against the
release's own set_internal_state, each taken from the wheel as it is (the modules around them import
torch, these pieces do not)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import sys
import types
import typing
import zipfile
from pathlib import Path

import pytest
from sglang_trees import sglang_wheel
from test_patch_policy import sbt, server_args

from dynctl.patching.engine import plan_patch
from dynctl.patching.recipe import recipes
from dynctl.patching.versions import variant_for

RELEASES = ["0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"]
WORKER = "srt/speculative/eagle_worker_v2.py"
INTERNAL_STATE = "srt/managers/scheduler_components/internal_state.py"


@functools.cache
def _wheel_text(version: str, path: str) -> str:
    with zipfile.ZipFile(sglang_wheel(version)) as wheel:
        return wheel.read(f"sglang/{path}").decode()


@functools.cache
def _patched(version: str, path: str) -> str:
    originals = {r.path: _wheel_text(version, r.path) for r in recipes(variant_for(version))}
    plan = plan_patch(version, {**originals, "srt/speculative/spec_batch_threshold.py": None})
    return next(c.after for c in plan.changes if c.path == path)


def _definitions(text: str, names: set[str], cls: str | None = None) -> list[ast.stmt]:
    tree = ast.parse(text)
    scope = tree.body if cls is None else next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = [n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in names]
    assert {n.name for n in found} == names
    return found


def _run(body: list[ast.stmt], namespace: dict, filename: str) -> dict:
    exec(compile(ast.Module(body=body, type_ignores=[]), filename, "exec"), namespace)
    return namespace


def _class_of(methods: list[ast.stmt], namespace: dict, filename: str, name: str = "StandIn") -> type:
    """A class holding a release's `methods` (from _definitions), defined in `namespace`."""
    cls = ast.ClassDef(name=name, bases=[], keywords=[], body=methods, decorator_list=[], type_params=[])
    return _run([ast.fix_missing_locations(cls)], namespace, filename)[name]


def _environ(version: str, tmp_path: Path):
    """The release's environ.py (stdlib only), loaded by path."""
    path = tmp_path / "environ.py"
    path.write_text(_wheel_text(version, "srt/environ.py"))
    spec = importlib.util.spec_from_file_location(f"sglang_environ_{version.replace('.', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module.envs


def _reason(version: str, tmp_path: Path):
    """The patched worker's unsupported_reason, with the release's own views, environ and (0.5.22 on)
    attn_dp_enabled_of."""
    base = _wheel_text(version, "srt/arg_groups/model_override_base.py")
    derived = _patched(version, WORKER).count("attn_dp_enabled_of") > 0
    views = _run(_definitions(base, {"ResolvedView", "ResolvingConfig", "resolving_view", "_declaration_overlay",
                                     "resolved_view", *(["ep_scale_joiner_of"] if derived else [])}),
                 {"__name__": "model_override_base", **vars(typing)}, "model_override_base.py")
    namespace = {"__name__": "eagle_worker_v2", "spec_batch_threshold": sbt, "envs": _environ(version, tmp_path),
                 "resolving_view": views["resolving_view"], "resolved_view": views["resolved_view"]}
    names = {"unsupported_reason", "_spec_disable_release_reason"}
    if derived:
        runtime = _wheel_text(version, "srt/runtime_context.py")
        attn_dp = _definitions(runtime, {"attn_dp_enabled_of"})
        # its import of ep_scale_joiner_of is a lazy one from model_override_base
        sys.modules["sglang.srt.arg_groups.model_override_base"] = type(sys)("model_override_base")
        sys.modules["sglang.srt.arg_groups.model_override_base"].ep_scale_joiner_of = views["ep_scale_joiner_of"]
        namespace["attn_dp_enabled_of"] = _run(attn_dp, {"__name__": "runtime_context", "Any": typing.Any},
                                               "runtime_context.py")["attn_dp_enabled_of"]
    return _run(_definitions(_patched(version, WORKER), names), namespace, WORKER)["unsupported_reason"]


@pytest.fixture(autouse=True)
def _no_stray_modules():
    yield
    sys.modules.pop("sglang.srt.arg_groups.model_override_base", None)


def _args(declared: dict | None = None, **fields: object):
    base = {"pp_size": 1, "enable_lora": None, "speculative_adaptive": False, "attn_dp_size": 1,
            "ep_join_mode": None, **fields}
    return server_args(_resolved_overrides=[("a resolution hook", declared or {})], **base)


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize(("fields", "declared", "reason"), [
    ({}, {}, None),
    # what resolution declared, which the raw fields do not carry
    ({"speculative_eagle_topk": None}, {"speculative_eagle_topk": 4}, "speculative_eagle_topk=4"),
    ({}, {"enable_dp_attention": True}, "DP attention is enabled"),
    ({}, {"enable_multi_layer_eagle": True}, "enable_multi_layer_eagle=True"),
    ({}, {"enable_lora": True}, "LoRA is enabled"),
    ({"enable_lora": True}, {}, "LoRA is enabled"),
    ({"speculative_adaptive": True}, {}, "speculative_adaptive=True"),
    ({"pp_size": 2}, {}, "pipeline parallelism is enabled (pp_size=2)"),
    ({}, {"pp_size": 4}, "pipeline parallelism is enabled (pp_size=4)"),
])
def test_the_worker_refuses_what_resolution_decided(version: str, fields: dict, declared: dict, reason: str | None,
                                                    tmp_path: Path) -> None:
    unsupported_reason = _reason(version, tmp_path)
    got = unsupported_reason(_args(declared, **fields))
    assert got is None if reason is None else reason in got
    if declared:  # the raw fields alone would have armed
        assert sbt.unsupported_reason(_args(declared, **fields)) is None


@pytest.mark.parametrize("version", RELEASES)
def test_dp_speculation_coordination_does_not_arm_where_the_release_has_it(
        version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION", "1")
    got = _reason(version, tmp_path)(_args())
    if "SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION" in _wheel_text(version, "srt/environ.py"):
        assert "SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION is on" in got
    else:  # 0.5.19, 0.5.20: no such mode
        assert got is None


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23"])
def test_attention_dp_derived_from_the_widths_does_not_arm(version: str, tmp_path: Path) -> None:
    """From 0.5.22 attention DP is attn_dp_size > 1 (enable_dp_attention may stay False on the record)."""
    got = _reason(version, tmp_path)(_args(attn_dp_size=2))
    assert "DP attention is enabled" in got
    assert sbt.unsupported_reason(_args(attn_dp_size=2)) is None  # the field alone says nothing


# --------------------------------------------------------------------------- 0.5.22 on: the handler table


class _Context:
    """Records the override set_internal_state makes (runtime_context's RuntimeContext.override)."""

    def __init__(self) -> None:
        self.overrides: list[dict] = []

    def override(self, source: str, **fields: object) -> None:
        assert source == "update_server_args"
        self.overrides.append(fields)


def _controller(version: str):
    """The patched SchedulerInternalStateController (its whole class and the table's helpers), on a
    scheduler whose speculation is EAGLE (not DFlash, so the accept-threshold handlers take any value)."""
    text = _patched(version, INTERNAL_STATE)
    body = _definitions(text, {"UpdateRejected", "_UpdateHandler", "_override", "SchedulerInternalStateController",
                               "_validate_spec_disable_batch_threshold"})
    context = _Context()
    namespace = {"__name__": "internal_state", **vars(typing), "logger": logging.getLogger("internal_state"),
                 "get_context": lambda: context,
                 "SetInternalStateReqOutput": lambda updated: {"updated": updated}}
    _run(body, namespace, INTERNAL_STATE)
    eagle = types.SimpleNamespace(is_dflash=lambda: False, is_none=lambda: False)
    scheduler = types.SimpleNamespace(spec_algorithm=eagle)
    return namespace["SchedulerInternalStateController"](scheduler, record_step_time=False), context


@pytest.fixture()
def policy_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The validator imports the policy module by its sglang name, as the patched tree has it."""
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.spec_batch_threshold", sbt)


def _request(**fields: object):
    return type("SetInternalStateReq", (), {"server_args": fields})()


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23"])
@pytest.mark.usefixtures("policy_importable")
def test_the_handler_table_sets_a_valid_threshold(version: str) -> None:
    controller, context = _controller(version)
    assert controller.set_internal_state(_request(speculative_disable_batch_threshold=3)) == {"updated": True}
    assert context.overrides == [{"speculative_disable_batch_threshold": 3}]
    assert controller.set_internal_state(_request(speculative_disable_batch_threshold=-1)) == {"updated": True}


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23"])
@pytest.mark.parametrize("value", [-2, "5", 2.5, True])
@pytest.mark.usefixtures("policy_importable")
def test_the_handler_table_rejects_a_bad_threshold_and_changes_nothing(
        version: str, value: object, caplog: pytest.LogCaptureFixture) -> None:
    controller, context = _controller(version)
    with caplog.at_level(logging.WARNING, logger="internal_state"):
        # a valid key beside it is not applied either: the request is validated whole first
        out = controller.set_internal_state(_request(speculative_accept_threshold_single=1.0,
                                                     speculative_disable_batch_threshold=value))
    assert out == {"updated": False} and context.overrides == []
    message = caplog.records[-1].getMessage()
    assert f"Updating speculative_disable_batch_threshold to {value!r} is rejected" in message


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23"])
def test_without_the_patch_the_release_refuses_the_key(version: str) -> None:
    """The check above can fail: the release's own table does not know the threshold."""
    text = _wheel_text(version, INTERNAL_STATE)
    assert "speculative_disable_batch_threshold" not in text
    assert 'raise UpdateRejected(f"Updating {key} is not supported.")' in text


# --------------------------------------------------------------------------- the worker's decision, per step


class _Bag:
    """The spec config bag get_spec() returns; /set_internal_state's override changes it (0.5.17 on)."""

    speculative_disable_batch_threshold = 5


class _Runner:
    model_config = object()
    decode_cuda_graph_runner = None  # an eager runner: no plain-decode graphs to capture


def _worker(version: str, tmp_path: Path, args, bag: _Bag):
    """The patched EAGLEWorkerV2's own arming, decision and adapter methods, on a worker whose models are
    stand-ins (no torch here): what they read of the worker is set below."""
    names = {"_skip_speculation", "_spec_disable_keeps_verify", "_init_spec_disable", "_spec_disable_threshold",
             "_spec_disable_keeps_recurrent_state", "tp_rank", "_spec_disable_decide_prepared",
             "_spec_disable_decide_early"}
    methods = [n for n in _definitions(_patched(version, WORKER), {"EAGLEWorkerV2"})[0].body
               if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in methods} == names
    deciders: list = []  # what the worker hands the policy module's set_plain_step_decider
    namespace = {"__name__": "eagle_worker_v2", "logger": logging.getLogger("eagle_worker_v2"),
                 "set_plain_step_decider": deciders.append,
                 "unsupported_reason": _reason(version, tmp_path), "get_spec": lambda: bag,
                 "get_parallel": lambda: types.SimpleNamespace(tp_rank=0),
                 "hybrid_arch": types.SimpleNamespace(mambaish_config=lambda model_config: None),
                 "DecodeCudaGraphRunner": type("DecodeCudaGraphRunner", (), {}),
                 **{name: getattr(sbt, name) for name in ("DRAFT_MODE_ENV", "DRAFT_EXTEND", "DRAFT_SKIP", "SpecDisableMetrics",
                                                          "SpecDisablePolicy", "draft_mode")}}
    cls = ast.ClassDef(name="Worker", bases=[], keywords=[], body=methods, decorator_list=[])
    worker_cls = _run([ast.fix_missing_locations(ast.copy_location(cls, methods[0]))], namespace, WORKER)["Worker"]
    worker = worker_cls.__new__(worker_cls)
    worker.server_args = args
    worker.ps = types.SimpleNamespace(tp_rank=0)  # 0.5.19, 0.5.20: the worker's ParallelState
    worker.target_worker = types.SimpleNamespace(model_runner=_Runner())
    worker._spec_disable_warm_positions = lambda: None
    worker.deciders = deciders
    return worker


def _decode(batch_size: int):
    mode = types.SimpleNamespace(is_decode=lambda: True)
    return types.SimpleNamespace(forward_mode=mode, is_extend_in_batch=False, spec_info=object(),
                                 seq_lens=[0] * batch_size, has_grammar=False, return_logprob=False,
                                 return_hidden_states=False)


@pytest.mark.parametrize("version", ["0.5.19", "0.5.21", "0.5.22"])
def test_decode_steps_above_the_live_threshold_skip_speculation(version: str, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    bag = _Bag()
    worker = _worker(version, tmp_path, _args(enable_metrics_for_all_schedulers=False), bag)
    with caplog.at_level(logging.INFO, logger="eagle_worker_v2"):
        steps = [worker._skip_speculation(_decode(n)) for n in (3, 5, 6, 9)]
        bag.speculative_disable_batch_threshold = 8  # what /set_internal_state's override puts in the bag
        steps += [worker._skip_speculation(_decode(n)) for n in (9, 8)]
    assert steps == [False, False, True, True, True, False]
    assert [r.getMessage() for r in caplog.records] == [
        "Speculation disabled: batch size 6 > threshold 5", "Speculation enabled: batch size 8 <= threshold 8"]


@pytest.mark.parametrize("version", ["0.5.19", "0.5.22"])
def test_a_step_is_decided_once_when_its_batch_is_prepared(version: str, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    worker = _worker(version, tmp_path, _args(enable_metrics_for_all_schedulers=False), _Bag())
    with caplog.at_level(logging.INFO, logger="eagle_worker_v2"):
        worker._init_spec_disable()
        # armed: the worker's prepare-time decision is what the batch's KV allocation asks
        assert worker.deciders == [worker._spec_disable_decide_prepared]
        batch = _decode(6)
        assert worker.deciders[0](batch) is True and batch._spec_disable_plain is True
        # the scheduler's resolve reads it back, without a second decision (one transition, one step)
        assert worker._spec_disable_decide_early(batch) is True
        assert worker._spec_disable_policy.disabled_steps == 1
        # a batch nobody prepared is decided when it is resolved
        fresh = _decode(3)
        assert worker._spec_disable_decide_early(fresh) is False and fresh._spec_disable_plain is False
    assert [r.getMessage() for r in caplog.records] == [
        "Speculation disabled: batch size 6 > threshold 5", "Speculation enabled: batch size 3 <= threshold 5"]


@pytest.mark.parametrize("version", ["0.5.19", "0.5.22"])
def test_a_server_that_cannot_arm_hands_no_decider_to_the_allocation(version: str, tmp_path: Path) -> None:
    worker = _worker(version, tmp_path, _args({"enable_lora": True}, enable_metrics_for_all_schedulers=False), _Bag())
    worker._init_spec_disable()
    assert worker.deciders == []


@pytest.mark.parametrize("version", ["0.5.19", "0.5.22"])
@pytest.mark.parametrize(("declared", "fields", "reason"), [
    ({}, {"pp_size": 2}, "pipeline parallelism is enabled (pp_size=2)"),
    ({"enable_lora": True}, {}, "LoRA is enabled"),
    ({"speculative_eagle_topk": 4}, {"speculative_eagle_topk": None}, "speculative_eagle_topk=4"),
])
def test_a_server_that_cannot_arm_always_speculates_and_says_why_once(
        version: str, declared: dict, fields: dict, reason: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    worker = _worker(version, tmp_path, _args(declared, enable_metrics_for_all_schedulers=False, **fields), _Bag())
    with caplog.at_level(logging.INFO, logger="eagle_worker_v2"):
        assert [worker._skip_speculation(_decode(n)) for n in (64, 128)] == [False, False]
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"speculative_disable_batch_threshold=5 is not armed: {reason}")
    assert message.endswith(". Speculation is never disabled.")
