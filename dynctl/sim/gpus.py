"""The simulated GPUs: which exist, and how much memory each simulator process holds on which one.

Each scheduler process writes `<gpu dir>/procs/<pid>.json` as its "allocations" grow; the main process
writes `activity.json` (utilisation). The fake nvidia-smi (`nvidia_smi.py`) reads them and counts only
processes that are still alive, so memory is "freed" exactly when the process holding it dies.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dynctl.sim import nvidia_smi

MIB = 1024 * 1024


def process_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[19]


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


class GpuBoard:
    def __init__(self, state_dir: Path | None):
        self.state_dir = state_dir
        self.inventory = nvidia_smi.read_inventory(state_dir)

    @property
    def gpus(self) -> list[dict]:
        return self.inventory["gpus"]

    def total_gib(self, index: int) -> float:
        gpu = next((g for g in self.gpus if g["index"] == index), None)
        if gpu is None:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return gpu["memory_total_mib"] / 1024

    def hold(self, gpu_index: int, gib: float, name: str) -> None:
        """Publish that this process now holds `gib` GiB on GPU `gpu_index`."""
        if self.state_dir is None:
            return
        procs = self.state_dir / "procs"
        procs.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        _write_json(procs / f"{pid}.json", {"pid": pid, "start_time": process_start_time(pid),
                                            "gpu_index": gpu_index, "used_mib": int(gib * 1024), "name": name})

    def set_activity(self, utilization: int) -> None:
        if self.state_dir is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        _write_json(self.state_dir / "activity.json", {"pid": pid, "start_time": process_start_time(pid),
                                                       "utilization": int(utilization), "updated": time.time()})

    def prune_dead(self) -> None:
        """Drop the files of processes that are gone (nvidia-smi ignores them anyway)."""
        if self.state_dir is None:
            return
        for path in (self.state_dir / "procs").glob("*.json"):
            try:
                entry = json.loads(path.read_text())
                if nvidia_smi.process_alive(int(entry["pid"]), entry.get("start_time")):
                    continue
            except (OSError, ValueError, KeyError):
                pass
            path.unlink(missing_ok=True)
