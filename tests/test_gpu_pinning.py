"""The GPU benchmark's SERVER_CORES: each server it launches runs on cores of its own, and its child
processes inherit them; the benchmark's own process (the load) leaves those cores while the server holds them.

A stand-in `sglang.launch_server` (sglang itself needs a GPU) is launched by phase.py's own Server,
a real process whose affinity the kernel reports; it starts a child as sglang starts its scheduler.
"""

from __future__ import annotations

import json
import os
import textwrap

from test_gpu_summarize import phase  # noqa: F401  (the fixture)

STAND_IN = """
import multiprocessing, os, signal
def report(who):  # one write: the server and its child share the log, each line must stay whole
    os.write(1, (" ".join([who, "cores", *map(str, sorted(os.sched_getaffinity(0)))]) + "\\n").encode())
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
        second.launch()  # no cores left beside the load's: runs unpinned, on the cores no server holds
        want = set(cores[1:])
        assert first.cores == sorted(want)
        assert _cores(first, "server") == want
        assert _cores(first, "child") == want
        assert os.sched_getaffinity(0) == {cores[0]}  # the load leaves the server's cores
        assert second.cores is None
        assert _cores(second, "server") == {cores[0]}
    finally:
        first.stop()
        second.stop()
    assert os.sched_getaffinity(0) == set(cores)  # and takes them back once it stopped
    # a stopped server's cores go back: the next one takes them
    third = phase.Server("third", 39003, env)
    try:
        third.launch()
        assert third.cores == sorted(set(cores[1:]))
    finally:
        third.stop()


def test_a_server_takes_whole_physical_cores(phase, monkeypatch):  # noqa: F811
    """With two threads per core (cpu c and c+4 on one core), a server never shares a physical core with
    the load or another server, and N rounds up to whole cores."""
    monkeypatch.setattr(phase, "_thread_siblings", lambda c: {c % 4, c % 4 + 4})
    monkeypatch.setattr(phase.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(phase, "_PINNED", [])
    monkeypatch.setenv("SERVER_CORES", "2")
    assert phase._cores_for_next_server() == [3, 7]
    monkeypatch.setenv("SERVER_CORES", "3")
    assert phase._cores_for_next_server() == [1, 2, 5, 6]
    assert phase._cores_for_next_server() is None  # core 0 and its sibling stay with the load
    assert phase._unpinned_cores() == {0, 4}


def test_thread_siblings_are_read_from_the_kernel(phase):  # noqa: F811
    for cpu in sorted(os.sched_getaffinity(0)):
        siblings = phase._thread_siblings(cpu)
        assert cpu in siblings
        assert all(cpu in phase._thread_siblings(s) for s in siblings)


def test_a_slot_shift_gives_each_server_the_cores_of_the_one_further_on(phase, monkeypatch):  # noqa: F811
    """Slots go by launch order (the highest cores first); SERVER_SLOT_SHIFT=1 launches the plan one
    place on, so its first server gets the cores its second one gets without the shift."""
    monkeypatch.setattr(phase, "_thread_siblings", lambda c: {c})
    monkeypatch.setattr(phase.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(phase.os, "sched_setaffinity", lambda pid, cores: None)
    monkeypatch.setenv("SERVER_CORES", "2")
    launched = []
    monkeypatch.setattr(phase.Server, "launch", lambda self: (launched.append(self.name),
                                                              setattr(self, "cores", phase._cores_for_next_server())))
    monkeypatch.setattr(phase.Server, "wait_ready", lambda self: True)
    probed = []
    monkeypatch.setattr(phase, "core_probe", lambda servers: probed.append(sorted(s.name for s in servers)))

    def slots(shift):
        monkeypatch.setattr(phase, "_PINNED", [])
        monkeypatch.setenv("SERVER_SLOT_SHIFT", str(shift))
        launched.clear()
        ready = phase.launch_all([phase.Server(n, 39100 + i) for i, n in enumerate(("a", "b", "c"))])
        return launched[:], {name: s.cores for name, s in ready.items()}

    assert slots(0) == (["a", "b", "c"], {"a": [6, 7], "b": [4, 5], "c": [2, 3]})
    assert slots(1) == (["b", "c", "a"], {"b": [6, 7], "c": [4, 5], "a": [2, 3]})
    assert slots(4) == slots(1)  # modulo the plan's length
    assert probed == [["a", "b", "c"]] * 4


def test_the_core_probe_times_every_pinned_core_alone_and_together(phase, monkeypatch):  # noqa: F811
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "the test needs two cores: one for a server's slot, one for the load"
    os.makedirs(phase.RES, exist_ok=True)
    monkeypatch.setattr(phase, "_OWN_CORES", set(cores))
    monkeypatch.setattr(phase, "_PINNED", [cores[1:]])
    server = phase.Server("t0", 39200)
    server.cores = cores[1:]
    probe = phase.core_probe([server], loops=20_000)
    assert list(probe) == ["t0", "load"]
    assert probe["t0"]["cores"] == cores[1:] and probe["load"]["cores"] == [cores[0]]
    for slot in probe.values():
        assert len(slot["alone_ms"]) == len(slot["together_ms"]) == len(slot["cores"])
        assert all(ms > 0 for ms in slot["alone_ms"] + slot["together_ms"])
    written = json.loads(open(os.path.join(phase.RES, "core-probe.json")).read())
    assert written == {"loops": 20_000, "slots": probe}


def test_shared_cores_put_every_server_on_the_first_ones_cores(phase, monkeypatch):  # noqa: F811
    """SERVER_CORES_SHARED=1: the second and third servers take the first one's cores, the load keeps
    the rest, and the cores go back to the load only once the last of them stopped."""
    monkeypatch.setattr(phase, "_thread_siblings", lambda c: {c})
    monkeypatch.setattr(phase.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(phase, "_PINNED", [])
    monkeypatch.setenv("SERVER_CORES", "3")
    monkeypatch.setenv("SERVER_CORES_SHARED", "1")
    servers = [phase.Server(n, 39300 + i) for i, n in enumerate(("a", "b", "c"))]
    for s in servers:
        s.cores = phase._cores_for_next_server()
    assert [s.cores for s in servers] == [[5, 6, 7]] * 3
    assert phase._unpinned_cores() == {0, 1, 2, 3, 4}
    for s in servers[:2]:
        phase._PINNED.remove(s.cores)
    assert phase._unpinned_cores() == {0, 1, 2, 3, 4}
    phase._PINNED.remove(servers[2].cores)
    assert phase._unpinned_cores() == set(range(8))


def test_the_core_probe_times_shared_cores_once(phase, monkeypatch):  # noqa: F811
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "the test needs two cores: one for the servers' slot, one for the load"
    os.makedirs(phase.RES, exist_ok=True)
    monkeypatch.setattr(phase, "_OWN_CORES", set(cores))
    monkeypatch.setattr(phase, "_PINNED", [cores[1:], cores[1:]])
    servers = [phase.Server("nospec", 39210), phase.Server("t0", 39211)]
    for s in servers:
        s.cores = cores[1:]
    probe = phase.core_probe(servers, loops=20_000)
    assert list(probe) == ["nospec", "load"]
