"""How the simulated server starts, drains, dies and fails: real processes, real signals."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from polling import alive, wait_for
from sim_harness import SPEC_ARGS, listeners

pytestmark = pytest.mark.slow

FAST = ["--time-scale", "20", "--sim-load-seconds", "1", "--model-path", "/models/m"]


def nvidia_smi(gpu_dir: Path, *args: str) -> str:
    script = Path(__file__).resolve().parent.parent / "dynctl" / "sim" / "nvidia_smi.py"
    env = {**os.environ, "DYNCTL_SIM_GPU_DIR": str(gpu_dir)}
    return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                          check=True).stdout


def test_unknown_flag_fails_like_sglang_argparse(site_059, start_sim):
    sim = start_sim(site_059, [*FAST, "--no-such-flag", "3"])
    assert sim.wait_exit() == 2
    log = sim.log
    assert log.startswith("usage: launch_server.py [-h] --model-path MODEL_PATH")
    assert log.rstrip().endswith("launch_server.py: error: unrecognized arguments: --no-such-flag 3")


def test_missing_required_model_path_is_exit_2(site_059, start_sim):
    sim = start_sim(site_059, ["--time-scale", "20"])
    assert sim.wait_exit() == 2
    assert "error: the following arguments are required: --model-path" in sim.log


def test_without_sglang_installed_it_fails_like_python_m(tmp_path, start_sim):
    sim = start_sim(tmp_path, FAST)  # PYTHONPATH holds no sglang
    assert sim.wait_exit() == 1
    assert "No module named 'sglang'" in sim.log


def test_process_tree_titles_and_port_opening_only_after_loading(site_059, start_sim):
    sim = start_sim(site_059, ["--time-scale", "10", "--sim-load-seconds", "3", "--model-path", "/m", "--tp", "2"])
    wait_for(lambda: "Load weight begin." in sim.log, 20, "loading to start")
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", sim.port)) != 0, "the port opened while the model was loading"
    sim.wait_ready()
    titles = sorted(" ".join(p.cmdline()) for p in sim.children())
    assert len(titles) == 3
    assert sum("sglang::scheduler_TP" in t for t in titles) == 2 and any("sglang::detokenizer" in t for t in titles)
    assert listeners(sim.port) == [sim.proc.pid]


def test_health_is_503_until_warmup_then_200(site_059, start_sim):
    sim = start_sim(site_059, ["--time-scale", "2", "--sim-load-seconds", "0.2", "--model-path", "/m"])

    def listening():
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", sim.port)) == 0
    wait_for(listening, 20, "the port to open")
    with sim.client() as c:
        # warm-up takes 0.5 s at this scale; the server logs "fired up" as it turns healthy, so a 200 seen
        # before that line is a health check that answered early
        assert c.get("/health").status_code == 503 or "fired up" in sim.log
        sim.wait_ready()
        assert c.get("/health").status_code == 200


def test_sigterm_drains_an_in_flight_stream_then_kills_the_tree(patched_site_059, start_sim, tmp_path):
    gpu_dir = tmp_path / "gpu"
    sim = start_sim(patched_site_059, ["--time-scale", "5", "--sim-load-seconds", "0.5", "--sim-gpu-dir",
                                       str(gpu_dir), "--model-path", "/m", "--tp", "2", *SPEC_ARGS],
                    env={"SGLANG_ENABLE_SPEC_V2": "1"}).wait_ready()
    tree = sim.remember_tree()
    used = [int(line.split(", ")[1]) for line in
            nvidia_smi(gpu_dir, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits").splitlines()]
    assert all(mib > 100_000 for mib in used[:2]) and used[2:] == [0] * 6  # TP 2 holds GPUs 0 and 1
    received: list[str] = []
    # the drained stream outlives the checks below by seconds (the server exits at its first watchdog
    # tick, once a second here, that finds nothing in flight)
    with httpx.Client(base_url=sim.url, timeout=60) as c:
        with c.stream("POST", "/generate", json={"text": "x", "stream": True,
                                                  "sampling_params": {"max_new_tokens": 4000}}) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    received.append(line)
                    break
            sim.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "SIGTERM received" in sim.log, 10, "the SIGTERM log line")
            with httpx.Client(base_url=sim.url, timeout=30) as other:
                assert other.get("/health").status_code == 503
                # Draining still accepts new requests (sglang 0.5.9 does not refuse them).
                late = other.post("/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 5}})
                assert late.status_code == 200 and len(late.json()["output_ids"]) == 5
            received += [line for line in lines if line.startswith("data: ")]
    assert received[-1] == "data: [DONE]"
    final = json.loads(received[-2][len("data: "):])
    assert len(final["output_ids"]) == 4000 and final["meta_info"]["finish_reason"]["type"] == "length"
    assert sim.wait_exit() == -signal.SIGKILL  # kill_process_tree(include_parent=True)
    wait_for(lambda: not any(alive(pid) for pid in tree), 10, "the children to die")
    assert "Gracefully exiting... Remaining number of requests 0" in sim.log
    assert nvidia_smi(gpu_dir, "--query-compute-apps=pid,used_memory", "--format=csv,noheader") == ""
    assert nvidia_smi(gpu_dir, "--query-gpu=memory.used", "--format=csv,noheader,nounits") == "0\n" * 8


def test_children_die_with_a_killed_parent_and_free_gpu_memory(site_059, start_sim, tmp_path):
    gpu_dir = tmp_path / "gpu"
    sim = start_sim(site_059, [*FAST, "--tp", "4", "--sim-gpu-dir", str(gpu_dir)]).wait_ready()
    tree = sim.remember_tree()
    apps = nvidia_smi(gpu_dir, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits")
    assert {int(line.split(", ")[0]) for line in apps.splitlines()} == {
        p.pid for p in sim.children() if "scheduler" in " ".join(p.cmdline())}
    sim.proc.kill()
    sim.proc.wait()
    wait_for(lambda: not any(alive(pid) for pid in tree), 10, "PR_SET_PDEATHSIG to kill the children")
    assert nvidia_smi(gpu_dir, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader") == ""


def test_a_dead_scheduler_fails_the_health_check_and_sigterm_then_forces_the_exit(site_059, start_sim):
    sim = start_sim(site_059, FAST).wait_ready()
    scheduler = next(p for p in sim.children() if "scheduler" in " ".join(p.cmdline()))
    scheduler.kill()
    with sim.client() as c:
        # HEALTH_CHECK_TIMEOUT (20 s) / time scale 20: no output arrives, so 503 after ~1 s.
        assert c.get("/health").status_code == 503
    assert "Health check failed. Server couldn't get a response from detokenizer" in sim.log
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.wait_exit(10) == -signal.SIGKILL
    assert "Signal SIGTERM received while health check failed. Force exiting." in sim.log


def test_fault_crash_after_kills_the_server_with_a_scheduler_traceback(site_059, start_sim):
    sim = start_sim(site_059, [*FAST, "--sim-crash-after", "1"])
    # the crash comes at 1 s or as soon as the scheduler is ready, whichever is later: the server may die
    # before it says ready, so the test waits for its children, not for ready
    wait_for(lambda: len(sim.children()) >= 2, 20, "the server's children")
    tree = sim.remember_tree()
    assert sim.wait_exit(20) == -signal.SIGKILL
    log = sim.log
    assert "Scheduler hit an exception: Traceback (most recent call last):" in log
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in log
    assert "It usually means one child failed." in log
    wait_for(lambda: not any(alive(pid) for pid in tree), 10, "the children to die")


def test_fault_hang_on_start_never_opens_the_port(site_059, start_sim):
    sim = start_sim(site_059, [*FAST, "--sim-load-seconds", "0.2"], env={"DYNCTL_SIM_HANG_ON_START": "1"})
    wait_for(lambda: "Load weight begin." in sim.log, 20, "loading to start")
    deadline = time.monotonic() + 0.6  # many times the whole simulated start-up
    while time.monotonic() < deadline:
        assert sim.proc.poll() is None
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", sim.port)) != 0
        time.sleep(0.05)
    assert "fired up" not in sim.log


def test_fault_ignore_sigterm_keeps_serving(site_059, start_sim):
    sim = start_sim(site_059, [*FAST, "--sim-ignore-sigterm"]).wait_ready()
    sim.proc.send_signal(signal.SIGTERM)
    with sim.client() as c:
        deadline = time.monotonic() + 0.75  # three watchdog periods at this scale
        while time.monotonic() < deadline:
            assert c.get("/health").status_code == 200
    assert sim.proc.poll() is None and "SIGTERM received" not in sim.log


def test_fault_orphan_child_keeps_the_port_after_the_server_dies(site_059, start_sim):
    sim = start_sim(site_059, [*FAST, "--sim-orphan-child", "--sim-orphan-lifetime", "60"]).wait_ready()

    def orphans() -> list[int]:
        # the orphan double-forks: its short-lived first child (the server's child) holds the socket too
        found = []
        for pid in listeners(sim.port):
            with contextlib.suppress(psutil.Error):
                if pid != sim.proc.pid and psutil.Process(pid).ppid() != sim.proc.pid:
                    found.append(pid)
        return found

    def settled() -> list[int]:
        # the orphan holds the socket from its fork, before it leaves the server's session, and its first
        # child exits a moment later: wait for the orphan in its own session beside the server alone
        found = orphans()
        return found if (len(found) == 1 and len(listeners(sim.port)) == 2
                         and os.getsid(found[0]) != os.getsid(sim.proc.pid)) else []

    orphan = wait_for(settled, 10, "the orphan alone beside the server, in a session of its own")[0]
    try:
        proc = psutil.Process(orphan)
        assert proc.ppid() != sim.proc.pid and os.getsid(orphan) != os.getsid(sim.proc.pid)
        sim.proc.kill()
        sim.proc.wait()
        assert listeners(sim.port) == [orphan] and alive(orphan)
    finally:
        os.kill(orphan, signal.SIGKILL)


def test_fault_slow_health(site_059, start_sim):
    sim = start_sim(site_059, [*FAST, "--sim-slow-health", "0.6"]).wait_ready()
    with sim.client() as c:
        start = time.monotonic()
        assert c.get("/health").status_code == 200
        assert time.monotonic() - start >= 0.6  # the switch really slows /health down
        assert c.get("/model_info").status_code == 200
