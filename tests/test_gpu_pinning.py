"""The GPU benchmark's SERVER_CORES: each server it launches runs on cores of its own, and its child
processes inherit them.

A stand-in `sglang.launch_server` (sglang itself needs a GPU) is launched by phase.py's own Server,
a real process whose affinity the kernel reports; it starts a child as sglang starts its scheduler.
"""

from __future__ import annotations

import os
import textwrap
import time

from test_gpu_summarize import phase  # noqa: F401  (the fixture)

STAND_IN = """
import multiprocessing, os, sys, time
def child(path):
    open(path, "w").write(" ".join(map(str, sorted(os.sched_getaffinity(0)))))
    time.sleep(60)
if __name__ == "__main__":
    out = os.environ["AFFINITY_OUT"]
    multiprocessing.Process(target=child, args=(out + ".child",)).start()
    open(out, "w").write(" ".join(map(str, sorted(os.sched_getaffinity(0)))))
    time.sleep(60)
"""


def _wait_for(path, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.path.exists(path) and open(path).read():
            return {int(c) for c in open(path).read().split()}
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def test_each_server_gets_cores_of_its_own_and_its_children_keep_them(phase, tmp_path, monkeypatch):  # noqa: F811
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "the test needs two cores: one for the server, one for the load"
    pkg = tmp_path / "standin" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(textwrap.dedent(STAND_IN))
    os.makedirs(phase.RES, exist_ok=True)
    monkeypatch.setenv("SERVER_CORES", str(len(cores) - 1))
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "standin"))
    first = phase.Server("first", 39001, dict(env, AFFINITY_OUT=str(tmp_path / "first")))
    second = phase.Server("second", 39002, dict(env, AFFINITY_OUT=str(tmp_path / "second")))
    try:
        first.launch()
        second.launch()  # no cores left beside the load's: runs unpinned
        want = set(cores[1:])
        assert first.cores == sorted(want)
        assert _wait_for(str(tmp_path / "first")) == want
        assert _wait_for(str(tmp_path / "first.child")) == want
        assert second.cores is None
        assert _wait_for(str(tmp_path / "second")) == set(cores)
    finally:
        first.stop()
        second.stop()
    # a stopped server's cores go back: the next one takes them
    third = phase.Server("third", 39003, dict(env, AFFINITY_OUT=str(tmp_path / "third")))
    try:
        third.launch()
        assert third.cores == sorted(set(cores[1:]))
    finally:
        third.stop()
