"""sglang 0.5.14 on: a plain-decode step allocates no KV slot while its requests hold the one it writes.

Runs each release's patched prepare function (EagleDraftInputV2Mixin.prepare_for_decode in 0.5.14,
eagle_prepare_for_decode from 0.5.15), taken from the wheel as the patch leaves it, on stand-in
requests laid out as that release's own allocation loop reads them. Anything the function does past
the plain step's return (host tensors, the allocator, the lengths helper) raises `Allocates`: torch is
not here, and a plain step that holds its slots must not need it.
"""

from __future__ import annotations

import ast
import re
import sys
import types
from operator import attrgetter

import pytest
from test_patch_policy import load_module
from test_patch_resolving import _patched, _wheel_text

RELEASES = ["0.5.14", "0.5.15", "0.5.16", "0.5.18", "0.5.19", "0.5.22", "0.5.23"]
RESERVE = 8  # get_alloc_reserve_per_decode(): twice the 4 slots one verify writes


class Allocates(Exception):
    """The release's own allocation path was reached."""


class _NoTorch:
    def __getattr__(self, name):
        raise Allocates(f"torch.{name}")


def _allocates(*args, **kwargs):
    raise Allocates("page_aligned_decode_alloc_lens")


def _path(version: str) -> str:
    return "srt/speculative/eagle_info_v2.py" if version == "0.5.14" else "srt/speculative/eagle_utils.py"


def _prepare_node(text: str) -> ast.FunctionDef:
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "eagle_prepare_for_decode":
            return node
        if isinstance(node, ast.ClassDef) and node.name == "EagleDraftInputV2Mixin":
            return next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "prepare_for_decode")
    raise AssertionError("no prepare function")


def _layout(version: str) -> tuple[str, str, bool]:
    """Where the release's own allocation keeps a request's allocated and committed lengths, and whether
    it pre-claims the bonus slot in the committed length (read from the unpatched source)."""
    original = _wheel_text(version, _path(version))
    if "page_aligned_decode_alloc_lens(" in original:  # 0.5.19 on: the loop moved into it
        original += _wheel_text(version, "srt/mem_cache/allocation_sizing.py")
    allocated = re.search(r"cur = r\.((?:kv\.)?kv_allocated_len)", original).group(1)
    committed = re.search(r"\br\.((?:kv\.)?kv_committed_len) \+ (?:double_alloc|reserve)", original).group(1)
    claims = "r.kv_committed_len += 1" in ast.unparse(_prepare_node(original))
    return allocated, committed, claims


def _req(allocated_name: str, committed_name: str, allocated: int, committed: int):
    req = types.SimpleNamespace(decode_batch_idx=0)
    for name, value in ((allocated_name, allocated), (committed_name, committed)):
        owner = req
        *parents, leaf = name.split(".")
        for parent in parents:
            if not hasattr(owner, parent):
                setattr(owner, parent, types.SimpleNamespace())
            owner = getattr(owner, parent)
        setattr(owner, leaf, value)
    return req


def _batch(reqs):
    return types.SimpleNamespace(
        reqs=reqs, seq_lens=[0] * len(reqs), batch_size=lambda: len(reqs), maybe_evict_swa=lambda: None,
        sampling_info=types.SimpleNamespace(penalizer_orchestrator=types.SimpleNamespace(is_required=False)),
        token_to_kv_pool_allocator=types.SimpleNamespace(page_size=1), device="cuda")


def install_policy(monkeypatch) -> types.ModuleType:
    """A fresh policy module, where the patched sglang code imports it from."""
    module = load_module()
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.spec_batch_threshold", module)
    return module


@pytest.fixture
def policy(monkeypatch):
    """A fresh policy module where the patched function imports it from."""
    module = install_policy(monkeypatch)
    utils = types.ModuleType("sglang.srt.speculative.spec_utils")
    utils.assign_req_to_token_pool_func = _allocates
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.spec_utils", utils)
    return module


def _prepare(version: str):
    node = _prepare_node(_patched(version, _path(version)))
    node.decorator_list = []
    namespace = {"__name__": "prepare", "torch": _NoTorch(), "get_alloc_reserve_per_decode": lambda: RESERVE,
                 "page_aligned_decode_alloc_lens": _allocates}
    exec(compile(ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[])), _path(version), "exec"),
         namespace)
    fn = namespace[node.name]
    if node.name == "prepare_for_decode":  # a method of the draft input, which it does not read before allocating
        return lambda batch: fn(object(), batch)
    return fn


@pytest.mark.parametrize("version", RELEASES)
def test_a_plain_step_whose_requests_hold_their_slots_allocates_nothing(version, policy):
    allocated, committed, claims = _layout(version)
    asked = []
    policy.set_plain_step_decider(lambda batch: asked.append(batch) or True)
    # one verify may have accepted up to 4 tokens the host's committed length does not count yet:
    # the slot a plain step writes is within committed + 5
    reqs = [_req(allocated, committed, 105, 100), _req(allocated, committed, 57, 40)]
    batch = _batch(reqs)
    assert _prepare(version)(batch) is None
    assert asked == [batch]
    lengths = [(attrgetter(allocated)(r), attrgetter(committed)(r), r.decode_batch_idx) for r in reqs]
    bonus = 1 if claims else 0  # 0.5.14 claims the bonus slot here, later releases when they resolve
    assert lengths == [(105, 100 + bonus, 1), (57, 40 + bonus, 1)]


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize(("plain", "held"), [
    (True, 4),       # a plain step, but one request holds one slot too few: the release tops everyone up
    (False, RESERVE),  # a speculative step
    (None, RESERVE),   # the threshold is not armed: no decider
])
def test_otherwise_the_release_allocates_as_it_does_for_speculation(version, policy, plain, held):
    allocated, committed, _ = _layout(version)
    if plain is not None:
        policy.set_plain_step_decider(lambda batch: plain)
    reqs = [_req(allocated, committed, 100 + RESERVE, 100), _req(allocated, committed, 40 + held, 40)]
    with pytest.raises(Allocates):
        _prepare(version)(_batch(reqs))


def test_the_policy_asks_for_half_the_reserve_and_one_slot_more():
    policy = load_module()
    reqs = [types.SimpleNamespace(kv_allocated_len=a, kv_committed_len=10) for a in (15, 19)]
    batch = types.SimpleNamespace(reqs=reqs)
    assert not policy.plain_step_holds_slots(batch, RESERVE)  # nobody decides: not armed
    policy.set_plain_step_decider(lambda b: True)
    assert policy.plain_step_holds_slots(batch, RESERVE)
    reqs[0].kv_allocated_len = 14
    assert not policy.plain_step_holds_slots(batch, RESERVE)
    policy.set_plain_step_decider(lambda b: False)
    reqs[0].kv_allocated_len = 30
    assert not policy.plain_step_holds_slots(batch, RESERVE)

