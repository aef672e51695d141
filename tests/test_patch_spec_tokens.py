"""sglang 0.5.14 on: the scheduler's estimate of the next speculative decode step's KV slots, as patched,
gives what the release's own estimate gives.

Runs each release's patched ScheduleBatch.new_tokens_required_next_decode next to its own
_new_tokens_required_next_decode_spec_v2 and the real ceil_div/ceil_align, all taken from the wheel,
on stand-in requests laid out as that release keeps their lengths: with one-token pages the patch
answers through spec_batch_threshold.spec_decode_tokens_needed, with larger pages through the
release's own loop, and both must equal the release's own loop.
"""

from __future__ import annotations

import ast
import random
import re
import types

import pytest
from test_patch_plain_slots import RESERVE, _req, install_policy
from test_patch_policy import load_module
from test_patch_resolving import _class_of, _definitions, _patched, _run, _wheel_text

RELEASES = ["0.5.14", "0.5.15", "0.5.16", "0.5.18", "0.5.19", "0.5.22", "0.5.23"]
SCHEDULE_BATCH = "srt/managers/schedule_batch.py"


def _utils_text(version: str) -> str:
    for path in ("srt/utils/common.py", "srt/utils.py"):
        try:
            text = _wheel_text(version, path)
        except KeyError:
            continue
        if "def ceil_align(" in text:
            return text
    raise AssertionError("no ceil_align")


def _estimates(version: str, patched: bool):
    """The release's ScheduleBatch estimate (patched or as shipped) bound to a stand-in batch class."""
    text = _patched(version, SCHEDULE_BATCH) if patched else _wheel_text(version, SCHEDULE_BATCH)
    methods = _definitions(text, {"new_tokens_required_next_decode", "_new_tokens_required_next_decode_spec_v2"},
                           cls="ScheduleBatch")
    namespace = {"__name__": "schedule_batch", "get_alloc_reserve_per_decode": lambda: RESERVE,
                 "List": list, "Optional": lambda *a: None}
    _run(_definitions(_utils_text(version), {"ceil_div", "ceil_align"}), namespace, "utils")
    return _class_of(methods, namespace, SCHEDULE_BATCH)


def _layout(version: str) -> tuple[str, str]:
    own = ast.unparse(_definitions(_wheel_text(version, SCHEDULE_BATCH), {"_new_tokens_required_next_decode_spec_v2"},
                                   cls="ScheduleBatch")[0])
    committed = re.search(r"r\.((?:kv\.)?kv_committed_len) \+ reserve", own).group(1)
    allocated = re.search(r"cur = r\.((?:kv\.)?kv_allocated_len)", own).group(1)
    return allocated, committed


@pytest.fixture
def policy(monkeypatch):
    """A policy module where the patched method imports it from, counting its calls."""
    module = install_policy(monkeypatch)
    calls = []
    real = module.spec_decode_tokens_needed
    module.spec_decode_tokens_needed = lambda *a, **k: calls.append(a) or real(*a, **k)
    module.calls = calls
    return module


def _batch(cls, reqs, page_size: int):
    batch = object.__new__(cls)
    batch.reqs = reqs
    batch.token_to_kv_pool_allocator = types.SimpleNamespace(page_size=page_size)
    batch.spec_algorithm = types.SimpleNamespace(is_none=lambda: False)
    return batch


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_the_patched_estimate_is_the_releases_own(version, page_size, policy):
    allocated, committed = _layout(version)
    rng = random.Random(f"{version}-{page_size}")
    patched, own = _estimates(version, True), _estimates(version, False)
    for _ in range(40):
        # held slots from none to more than the reserve, so that some requests need none
        reqs = [_req(allocated, committed, c + rng.randrange(0, 2 * RESERVE), c)
                for c in (rng.randrange(1, 4000) for _ in range(rng.randrange(1, 64)))]
        want = own.new_tokens_required_next_decode(_batch(own, reqs, page_size))
        assert patched.new_tokens_required_next_decode(_batch(patched, reqs, page_size)) == want
        assert patched.new_tokens_required_next_decode(_batch(patched, reqs, page_size), [0]) == (
            own.new_tokens_required_next_decode(_batch(own, reqs, page_size), [0]))
    # one-token pages take the policy's sum, larger pages the release's loop with its rounding
    assert bool(policy.calls) == (page_size == 1)


def test_the_sum_counts_only_what_each_request_lacks():
    policy = load_module()
    reqs = [types.SimpleNamespace(kv_allocated_len=a, kv_committed_len=10) for a in (10, 15, 30)]
    assert policy.spec_decode_tokens_needed(reqs, RESERVE) == 8 + 3 + 0
    nested = [types.SimpleNamespace(kv=types.SimpleNamespace(kv_allocated_len=12, kv_committed_len=10))]
    assert policy.spec_decode_tokens_needed(nested, RESERVE, "kv.kv_allocated_len", "kv.kv_committed_len") == 6
