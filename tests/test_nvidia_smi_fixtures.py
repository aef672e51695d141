"""nvidia-smi parsing against real output captured on an H200 (tests/fixtures/nvidia_smi/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynctl.base.parsers import MetricsFormatError
from dynctl.base.parsers.nvidia_smi import parse_gpu_csv, parse_nvidia_smi_csv
from dynctl_agent.nvidia import parse_compute_apps

FIX = Path(__file__).parent / "fixtures" / "nvidia_smi"
UUID = "GPU-6308ea44-dc94-b7d8-9744-960e07080844"


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def test_gpu_rows_idle_and_busy():
    (idle,) = parse_gpu_csv(fixture("query_gpu_idle.txt"))
    (busy,) = parse_gpu_csv(fixture("query_gpu_busy.txt"))
    assert (idle.index, idle.uuid, idle.name) == (0, UUID, "NVIDIA H200")
    assert (idle.mem_used_mib, idle.mem_total_mib, idle.util_pct) == (0, 143771, 0)
    assert busy.mem_used_mib == 4739


def test_wide_query_keeps_every_column():
    fields = ("index", "uuid", "name", "temperature.gpu", "utilization.gpu", "utilization.memory", "memory.used",
              "memory.total", "power.draw", "power.limit", "clocks.sm", "pstate")
    (row,) = parse_nvidia_smi_csv(fixture("query_gpu_wide_idle.txt"), fields)
    assert (row["temperature.gpu"], row["power.limit"], row["clocks.sm"], row["pstate"]) == ("37", "700.00", "345", "P0")


def test_header_output_is_not_mistaken_for_data():
    """`--format=csv` (with header and units) is not what dynctl asks for: refuse it instead of misreading."""
    with pytest.raises((MetricsFormatError, ValueError)):
        parse_gpu_csv(fixture("query_gpu_idle_with_header.txt"))


def test_agent_reads_the_same_rows():
    """The host agent's own stdlib parser (used by `server_stop` to wait for GPU release)."""
    assert parse_compute_apps(fixture("query_apps_idle.txt")) == {}
    assert parse_compute_apps(fixture("query_apps_one_process.txt")) == {759: 4706.0}
    assert parse_compute_apps(fixture("query_apps_two_processes.txt")) == {490: 4706.0, 538: 14.0}
    assert parse_compute_apps(fixture("query_apps_idle_with_header.txt")) == {}
    assert parse_compute_apps("GPU-x, 7, /usr/bin/python3 -c a,b, [N/A]\n") == {7: None}
