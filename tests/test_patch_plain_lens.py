"""sglang 0.5.14-0.5.18: after a plain-decode step the scheduler takes the lengths that step published.

Runs each release's patched FutureMap.publish and FutureMap.resolve_seq_lens_cpu, taken from the wheel as
the patch leaves them, on host stand-ins for the tensors (torch does not run here): a plain step's publish
hands the next resolve its rows, its host lengths and the device tensor it wrote; the next resolve of the
same rows takes that tensor instead of gathering it back from the buffer, and the host lengths instead of
copying the buffer to the host. Other rows, another step's publish, or host lengths the release needs but
the step did not have take the release's own gather.
"""

from __future__ import annotations

import ast
import contextlib
import types
from typing import Optional

import pytest
from test_patch_resolving import _definitions, _patched

RELEASES = ["0.5.14", "0.5.15", "0.5.16", "0.5.17", "0.5.18"]


class Lens(list):
    """A 1-D host stand-in for an int64 tensor: what the two methods do to one."""

    shape = property(lambda self: (len(self),))
    dtype = "int64"

    def __add__(self, n):
        return Lens(x + n for x in self)

    def to(self, dtype):
        return Lens(self)

    def sum(self):
        return sum(iter(self))

    def record_stream(self, stream):
        self.recorded = stream


class Buffer:
    """The FutureMap's per-slot buffer of new lengths; counts its gathers."""

    dtype = "int64"

    def __init__(self, size: int):
        self.values, self.gathers = [0] * size, 0

    def __getitem__(self, rows):
        self.gathers += 1
        return Lens(self.values[r] for r in rows)

    def __setitem__(self, rows, values):
        for r, v in zip(rows, values):
            self.values[r] = v

    def copy_(self, other, non_blocking=False):
        self.values = list(other.values)


class Event:
    def record(self):
        pass

    def wait(self):
        pass

    def synchronize(self):
        pass


class Stream(Event):
    def wait_event(self, event):
        pass


SCHEDULE_STREAM = Stream()


class FakeTorch:
    Tensor = Lens

    @staticmethod
    def equal(a, b):
        return list(a) == list(b)

    @staticmethod
    def get_device_module(device):
        return types.SimpleNamespace(Event=Event, current_stream=lambda: SCHEDULE_STREAM,
                                     stream=lambda s: contextlib.nullcontext())


def future_map(version: str, needs_cpu: bool):
    nodes = _definitions(_patched(version, "srt/managers/overlap_utils.py"),
                         {"publish", "resolve_seq_lens_cpu"}, cls="FutureMap")
    namespace = {"torch": FakeTorch, "Optional": Optional, "ScheduleBatch": object, "_is_hip": False,
                 "_DEBUG_ASSERT": False}
    cls = ast.ClassDef(name="FutureMap", bases=[], keywords=[], body=nodes, decorator_list=[])
    exec(compile(ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[])), "overlap_utils", "exec"),
         namespace)
    fm = namespace["FutureMap"]()
    fm.__dict__.update(
        new_seq_lens_buf=Buffer(8), new_seq_lens_cpu_pinned=Buffer(8), needs_cpu_seq_lens=needs_cpu,
        publish_ready=Event(), fwd_prepare_d2h_stream=Stream(), device="cuda", needs_confidence_relay=False,
        spec_algo=types.SimpleNamespace(is_some=lambda: True, is_dflash=lambda: False, is_ngram=lambda: False))
    return fm


def batch(rows, lens, needs_cpu):
    draft = types.SimpleNamespace(future_indices=Lens(rows), direct_carry_valid=False)
    return types.SimpleNamespace(spec_info=draft, req_pool_indices_cpu=Lens(rows), seq_lens=None,
                                 seq_lens_cpu=Lens(lens) if needs_cpu else None, seq_lens_sum=None)


def plain_step(fm, b, needs_cpu):
    """What the patched resolve and a plain step do: the rows and host lengths + 1 are pending, and the
    step publishes its new lengths, a device tensor of its own."""
    fm._spec_disable_host_pending = (Lens(b.req_pool_indices_cpu), b.seq_lens_cpu + 1 if needs_cpu else None)
    new = Lens(b.seq_lens_cpu + 1 if needs_cpu else [5, 7, 9])
    fm.publish(Lens(b.req_pool_indices_cpu), new)
    return new


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("needs_cpu", [False, True])
def test_the_next_resolve_of_the_same_rows_takes_what_the_plain_step_published(version, needs_cpu):
    fm = future_map(version, needs_cpu)
    b = batch([3, 1, 6], [4, 6, 8], needs_cpu)
    new = plain_step(fm, b, needs_cpu)
    fm.resolve_seq_lens_cpu(b)
    assert b.seq_lens is new and new.recorded is SCHEDULE_STREAM
    assert fm.new_seq_lens_buf.gathers == 0 and fm.new_seq_lens_buf.values[6] == new[2]
    if needs_cpu:
        assert (b.seq_lens_cpu, b.seq_lens_sum) == ([5, 7, 9], 21)
    else:
        assert (b.seq_lens_cpu, b.seq_lens_sum) == (None, None)


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("needs_cpu", [False, True])
def test_other_rows_or_another_steps_publish_gather_as_the_release_does(version, needs_cpu):
    fm = future_map(version, needs_cpu)
    b = batch([3, 1, 6], [4, 6, 8], needs_cpu)
    plain_step(fm, b, needs_cpu)
    shrunk = batch([3, 6], [5, 9], needs_cpu)  # a request finished: the batch was filtered
    fm.resolve_seq_lens_cpu(shrunk)
    assert fm.new_seq_lens_buf.gathers == 1 and shrunk.seq_lens == [5, 9]

    plain_step(fm, b, needs_cpu)
    fm.publish(Lens([3, 1, 6]), Lens([9, 9, 9]))  # a verify's publish: nothing pending
    fm.resolve_seq_lens_cpu(b)
    assert fm.new_seq_lens_buf.gathers == 2 and b.seq_lens == [9, 9, 9]
    if needs_cpu:
        assert b.seq_lens_cpu == [9, 9, 9]


@pytest.mark.parametrize("version", RELEASES)
def test_a_release_that_needs_host_lengths_gathers_when_the_step_had_none(version):
    fm = future_map(version, True)
    b = batch([2, 4], [10, 20], True)
    fm._spec_disable_host_pending = (Lens([2, 4]), None)
    fm.publish(Lens([2, 4]), Lens([11, 21]))
    fm.resolve_seq_lens_cpu(b)
    assert fm.new_seq_lens_buf.gathers == 1
    assert (b.seq_lens, b.seq_lens_cpu, b.seq_lens_sum) == ([11, 21], [11, 21], 32)
