"""nvidia-smi's CSV (`--format=csv,noheader,nounits`): the GPUs and the processes that hold them."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass

from dynctl.base import sglang
from dynctl.base.parsers import MetricsFormatError, number

GPU_QUERY = sglang.GPU_QUERY
APPS_QUERY = sglang.APPS_QUERY


# What nvidia-smi prints in place of a value it cannot give (driver-dependent spellings).
_NOT_A_VALUE = {"[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]", "[insufficient permissions]",
                "[gpu is lost]", "[gpu requires reset]", ""}


@dataclass(frozen=True)
class GpuStat:
    index: int
    uuid: str | None
    name: str | None
    util_pct: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None


def _value(raw: str) -> str | None:
    raw = raw.strip()
    return None if raw.lower() in _NOT_A_VALUE else raw


@dataclass(frozen=True)
class GpuProcess:
    gpu_uuid: str | None
    pid: int
    process_name: str | None
    used_mib: float | None


def parse_nvidia_smi_csv(text: str, fields: Sequence[str]) -> list[dict[str, str | None]]:
    """Rows of `--format=csv,noheader,nounits` output as dicts; unavailable values are None.

    Process names may contain commas, which nvidia-smi does not quote: the surplus columns are
    folded back into `process_name`.
    """
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cols = next(csv.reader([line], skipinitialspace=True))
        if len(cols) > len(fields) and "process_name" in fields:
            at = list(fields).index("process_name")
            extra = len(cols) - len(fields)
            cols = cols[:at] + [", ".join(cols[at:at + extra + 1])] + cols[at + extra + 1:]
        if len(cols) != len(fields):
            raise MetricsFormatError(
                f"nvidia-smi line {lineno}: expected {len(fields)} columns ({','.join(fields)}), got {len(cols)}: {line!r}"
            )
        rows.append({f: _value(c) for f, c in zip(fields, cols)})
    return rows


def parse_gpu_csv(text: str) -> list[GpuStat]:
    """`nvidia-smi --query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total` rows."""
    gpus = []
    for row in parse_nvidia_smi_csv(text, GPU_QUERY):
        index = number(row["index"], int)
        if index is None:
            raise MetricsFormatError(f"nvidia-smi: GPU row without an index: {row}")
        gpus.append(GpuStat(index, row["uuid"], row["name"], number(row["utilization.gpu"], float),
                            number(row["memory.used"], float), number(row["memory.total"], float)))
    return sorted(gpus, key=lambda g: g.index)


def parse_compute_apps_csv(text: str) -> list[GpuProcess]:
    """`nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory` rows (pid may be a host pid in a
    container): the processes holding each GPU, as the live view lists them."""
    procs = []
    for row in parse_nvidia_smi_csv(text, APPS_QUERY):
        pid = number(row["pid"], int)
        if pid is None:
            continue
        procs.append(GpuProcess(row["gpu_uuid"], pid, row["process_name"], number(row["used_memory"], float)))
    return procs
