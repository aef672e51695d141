"""The GPU benchmark's SERVER_CORES: each server it launches runs on cores of its own, and its child
processes inherit them.

A stand-in `sglang.launch_server` (sglang itself needs a GPU) is launched by phase.py's own Server,
a real process whose affinity the kernel reports; it starts a child as sglang starts its scheduler.
"""

from __future__ import annotations

import os
import textwrap

from test_gpu_summarize import phase  # noqa: F401  (the fixture)

STAND_IN = """
import multiprocessing, os, signal
def report(who):
    print(who, "cores", *sorted(os.sched_getaffinity(0)), flush=True)
def child():
    report("child")
    signal.pause()
if __name__ == "__main__":
    multiprocessing.Process(target=child).start()
    report("server")
    signal.pause()
"""


def _cores(server, who):
    """The cores the stand-in's `who` (server or child) reported in its log, once it has."""
    assert server.wait_log(rf"^{who} cores", 30), server.tail(20)
    line = server.grep(rf"^{who} cores")[0]
    return {int(c) for c in line.split()[2:]}


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
    first = phase.Server("first", 39001, env)
    second = phase.Server("second", 39002, env)
    try:
        first.launch()
        second.launch()  # no cores left beside the load's: runs unpinned
        want = set(cores[1:])
        assert first.cores == sorted(want)
        assert _cores(first, "server") == want
        assert _cores(first, "child") == want
        assert second.cores is None
        assert _cores(second, "server") == set(cores)
    finally:
        first.stop()
        second.stop()
    # a stopped server's cores go back: the next one takes them
    third = phase.Server("third", 39003, env)
    try:
        third.launch()
        assert third.cores == sorted(set(cores[1:]))
    finally:
        third.stop()
