"""Stop on a real NVIDIA GPU: the agent must see the old server's GPU memory released through real nvidia-smi.

Runs only where `nvidia-smi -L` lists a GPU (elsewhere it is skipped, and says why). With
DYNCTL_GPU_CAPTURE=DIR it also writes the nvidia-smi outputs it saw and its timings into DIR
(that is how tests/fixtures/nvidia_smi/ was captured on an H200).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dynctl.core import lifecycle
from dynctl.base.parsers.nvidia_smi import APPS_QUERY, GPU_QUERY, parse_gpu_csv
from dynctl_agent.nvidia import parse_compute_apps
from lifecycle_harness import alive, make_box, wait_for


def _gpus() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln for ln in out.splitlines() if ln.startswith("GPU ")]


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _gpus(), reason="needs a real NVIDIA GPU: `nvidia-smi -L` lists none here"),
]

CAPTURE = os.environ.get("DYNCTL_GPU_CAPTURE")


def smi(*query: str) -> str:
    return subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def apps() -> str:
    return smi("--query-compute-apps=" + ",".join(APPS_QUERY))


def gpu_rows() -> str:
    return smi("--query-gpu=" + ",".join(GPU_QUERY))


def capture(name: str, text: str) -> None:
    if CAPTURE:
        Path(CAPTURE, name).write_text(text)


@pytest.mark.parametrize("variant", ["drains_but_a_gpu_child_leaks", "ignores_sigterm"])
def test_stop_waits_until_real_gpu_memory_is_released(tmp_path, variant):
    box = make_box(tmp_path)
    flags = ["--cuda-mib", "4096"]
    flags += ["--cuda-child", "2048"] if variant == "drains_but_a_gpu_child_leaks" else ["--ignore-sigterm"]
    try:
        capture("query_gpu_idle.txt", gpu_rows())
        capture("query_apps_idle.txt", apps())
        pid = box.start_ready(*flags, ready_timeout=300)["pid"]
        holders = {pid, *box.children().values()}
        wait_for(lambda: holders <= set(parse_compute_apps(apps())), 120,
                 f"nvidia-smi to list pids {sorted(holders)}")
        busy_apps, busy_gpu = apps(), gpu_rows()
        capture(f"query_apps_busy_{variant}.txt", busy_apps)
        capture(f"query_gpu_busy_{variant}.txt", busy_gpu)
        used_before = sum(g.mem_used_mib or 0 for g in parse_gpu_csv(busy_gpu))

        t0 = time.monotonic()
        result = lifecycle.stop_server(box.agent, grace=2.0)
        wall = time.monotonic() - t0
        after_apps, after_gpu = apps(), gpu_rows()
        capture(f"query_apps_after_{variant}.txt", after_apps)

        gpu = result["gpu"]
        assert gpu["checked"] is True, result
        assert set(gpu["held_before"]) == holders
        assert not holders & set(parse_compute_apps(after_apps))
        assert not any(alive(p) for p in holders)
        assert result["escalated"] is (variant == "ignores_sigterm")
        if variant == "drains_but_a_gpu_child_leaks":
            assert [p["pid"] for p in result["swept"]] == sorted(holders - {pid})
        used_after = sum(g.mem_used_mib or 0 for g in parse_gpu_csv(after_gpu))
        assert used_after < used_before - 4096  # the memory itself came back, not only the pid list
        if CAPTURE:
            report = {"variant": variant, "wall_s": round(wall, 3), "timings": result["timings"], "gpu": gpu,
                      "mem_used_mib_before": used_before, "mem_used_mib_after": used_after,
                      "swept": result["swept"], "escalated": result["escalated"]}
            with open(Path(CAPTURE, "gpu_stop_report.jsonl"), "a") as f:
                f.write(json.dumps(report) + "\n")
    finally:
        box.cleanup()
