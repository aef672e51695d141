#!/usr/bin/env python3
"""A fake `nvidia-smi` for the simulated GPU host: the real tool's CSV queries, answered from the state the
simulator's processes publish. Only live processes hold memory: once a scheduler process is gone (or a
zombie), its GPU memory is free, as the driver frees it when the process exits.

Stdlib only: `dynctl.sim.hostsetup` copies this file to <demo root>/bin/nvidia-smi with STATE_DIR filled in.
Supported: `--query-gpu=FIELDS`, `--query-compute-apps=FIELDS`, `--format=csv[,noheader][,nounits]`,
`-i/--id`, `-l/--loop SEC`, `-lms/--loop-ms MS`, `-L`, and a plain summary table.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

STATE_DIR = os.environ.get("DYNCTL_SIM_GPU_DIR", "")  # replaced when installed
DRIVER_VERSION = "570.133.20"
CUDA_VERSION = "12.8"
H200 = {"name": "NVIDIA H200", "memory_total_mib": 143771, "power_limit_w": 700.0}


def default_inventory(count: int = 8) -> dict:
    return {"driver_version": DRIVER_VERSION, "cuda_version": CUDA_VERSION, "gpus": [
        {"index": i, "uuid": f"GPU-5e1a7c{i:02x}-51d1-4a3e-9c2b-{0xd0a000000000 + i:012x}", "name": H200["name"],
         "memory_total_mib": H200["memory_total_mib"], "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
         "power_limit_w": H200["power_limit_w"]} for i in range(count)]}


def read_inventory(state_dir: Path | None) -> dict:
    if state_dir is not None:
        try:
            return json.loads((state_dir / "gpus.json").read_text())
        except (OSError, ValueError):
            pass
    return default_inventory()


def process_alive(pid: int, start_time: str | None) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return False
    # Field 22 (start time) guards against a recycled pid.
    return start_time is None or fields[19] == start_time


def _process_name(pid: int, fallback: str) -> str:
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return fallback
    return argv0 or fallback


def live_processes(state_dir: Path | None) -> list[dict]:
    if state_dir is None:
        return []
    procs = []
    for path in sorted((state_dir / "procs").glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if process_alive(int(entry["pid"]), entry.get("start_time")):
            entry["process_name"] = _process_name(int(entry["pid"]), entry.get("name", "python"))
            procs.append(entry)
    return procs


def utilization(state_dir: Path | None) -> int:
    if state_dir is None:
        return 0
    try:
        activity = json.loads((state_dir / "activity.json").read_text())
    except (OSError, ValueError):
        return 0
    if not process_alive(int(activity["pid"]), activity.get("start_time")) or time.time() - activity["updated"] > 5:
        return 0
    return int(activity.get("utilization", 0))


# field -> (header name, unit)
GPU_FIELDS = {
    "index": ("index", ""), "uuid": ("uuid", ""), "name": ("name", ""), "count": ("count", ""),
    "driver_version": ("driver_version", ""), "pci.bus_id": ("pci.bus_id", ""),
    "memory.total": ("memory.total", "MiB"), "memory.used": ("memory.used", "MiB"),
    "memory.free": ("memory.free", "MiB"), "memory.reserved": ("memory.reserved", "MiB"),
    "utilization.gpu": ("utilization.gpu", "%"), "utilization.memory": ("utilization.memory", "%"),
    "temperature.gpu": ("temperature.gpu", ""), "power.draw": ("power.draw", "W"),
    "power.limit": ("power.limit", "W"), "clocks.sm": ("clocks.current.sm", "MHz"),
    "clocks.current.sm": ("clocks.current.sm", "MHz"), "clocks.mem": ("clocks.current.memory", "MHz"),
    "clocks.current.memory": ("clocks.current.memory", "MHz"), "pstate": ("pstate", ""),
    "compute_mode": ("compute_mode", ""), "persistence_mode": ("persistence_mode", ""),
}
APP_FIELDS = {
    "pid": ("pid", ""), "process_name": ("process_name", ""), "name": ("process_name", ""),
    "used_memory": ("used_gpu_memory", "MiB"), "used_gpu_memory": ("used_gpu_memory", "MiB"),
    "gpu_uuid": ("gpu_uuid", ""), "gpu_bus_id": ("gpu_bus_id", ""), "gpu_name": ("gpu_name", ""),
}


def gpu_rows(state_dir: Path | None) -> list[dict]:
    inventory = read_inventory(state_dir)
    procs = live_processes(state_dir)
    util = utilization(state_dir)
    rows = []
    for gpu in inventory["gpus"]:
        used = sum(int(p["used_mib"]) for p in procs if int(p["gpu_index"]) == gpu["index"])
        busy = util if used else 0
        total = gpu["memory_total_mib"]
        power_limit = gpu.get("power_limit_w", 700.0)
        rows.append({
            "index": gpu["index"], "uuid": gpu["uuid"], "name": gpu["name"], "count": len(inventory["gpus"]),
            "driver_version": inventory.get("driver_version", DRIVER_VERSION), "pci.bus_id": gpu["pci_bus_id"],
            "memory.total": total, "memory.used": used, "memory.reserved": 551,
            "memory.free": max(0, total - used - 551), "utilization.gpu": busy,
            "utilization.memory": busy * 3 // 5, "temperature.gpu": 31 + busy * 30 // 100,
            "power.draw": f"{75.0 + (power_limit - 75.0) * 0.75 * busy / 100 + (45.0 if used else 0.0):.2f}",
            "power.limit": f"{power_limit:.2f}", "clocks.sm": 1980 if used else 345,
            "clocks.current.sm": 1980 if used else 345, "clocks.mem": 3201 if used else 1593,
            "clocks.current.memory": 3201 if used else 1593, "pstate": "P0",
            "compute_mode": "Default", "persistence_mode": "Enabled",
        })
    return rows


def app_rows(state_dir: Path | None) -> list[dict]:
    gpus = {g["index"]: g for g in read_inventory(state_dir)["gpus"]}
    rows = []
    for proc in live_processes(state_dir):
        gpu = gpus.get(int(proc["gpu_index"]))
        if gpu is None:
            continue
        rows.append({"pid": proc["pid"], "process_name": proc["process_name"], "name": proc["process_name"],
                     "used_memory": int(proc["used_mib"]), "used_gpu_memory": int(proc["used_mib"]),
                     "gpu_uuid": gpu["uuid"], "gpu_bus_id": gpu["pci_bus_id"], "gpu_name": gpu["name"]})
    return rows


def render_csv(rows: list[dict], fields: list[str], known: dict, header: bool, units: bool) -> str:
    lines = []
    if header:
        lines.append(", ".join(known[f][0] + (f" [{known[f][1]}]" if known[f][1] else "") for f in fields))
    for row in rows:
        cells = []
        for f in fields:
            value = row[f]
            unit = known[f][1]
            cells.append(f"{value} {unit}" if unit and not units else str(value))
        lines.append(", ".join(cells))
    return "".join(line + "\n" for line in lines)


def render_table(state_dir: Path | None) -> str:
    inv = read_inventory(state_dir)
    rows = gpu_rows(state_dir)
    apps = app_rows(state_dir)
    bar = "+-----------------------------------------------------------------------------------------+"
    out = [time.strftime("%a %b %d %H:%M:%S %Y"), bar,
           f"| NVIDIA-SMI {inv.get('driver_version', DRIVER_VERSION)}             Driver Version: "
           f"{inv.get('driver_version', DRIVER_VERSION)}     CUDA Version: {inv.get('cuda_version', CUDA_VERSION)}     |",
           "|  (simulated by dynctl)                                                                  |", bar]
    for r in rows:
        out.append(f"| {r['index']:>3}  {r['name']:<24} {r['pci.bus_id']:<16} {r['memory.used']:>7}MiB / "
                   f"{r['memory.total']:>6}MiB {r['utilization.gpu']:>4}%  {r['power.draw']:>7}W / "
                   f"{r['power.limit']}W |")
    out.append(bar)
    out.append("| Processes:                                                                              |")
    if not apps:
        out.append("|  No running processes found                                                             |")
    for a in apps:
        gpu = next((r["index"] for r in rows if r["uuid"] == a["gpu_uuid"]), "?")
        out.append(f"| {gpu:>4}   N/A  N/A  {a['pid']:>8}  C   {a['process_name'][:40]:<40} {a['used_memory']:>8}MiB |")
    out.append(bar)
    return "\n".join(out) + "\n"


class UsageError(Exception):
    pass


def _parse(argv: list[str]) -> dict:
    opts = {"query_gpu": None, "query_apps": None, "format": None, "ids": None, "loop": None, "list": False}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")

        def take() -> str:
            nonlocal i
            if eq:
                return value
            i += 1
            if i >= len(argv):
                raise UsageError(f'Option "{arg}" requires a value.')
            return argv[i]

        if name == "--query-gpu":
            opts["query_gpu"] = take()
        elif name == "--query-compute-apps":
            opts["query_apps"] = take()
        elif name == "--format":
            opts["format"] = take()
        elif name in ("-i", "--id"):
            opts["ids"] = {int(x) for x in take().split(",")}
        elif name in ("-l", "--loop"):
            opts["loop"] = float(take())
        elif name in ("-lms", "--loop-ms"):
            opts["loop"] = float(take()) / 1000.0
        elif name in ("-L", "--list-gpus"):
            opts["list"] = True
        else:
            raise UsageError('Invalid combination of input arguments. Please run "nvidia-smi -h" for help.')
        i += 1
    return opts


def _fields(spec: str, known: dict, kind: str) -> list[str]:
    fields = [f.strip() for f in spec.split(",") if f.strip()]
    for f in fields:
        if f not in known:
            raise UsageError(f'Field "{f}" is not a valid field to query.\n\n'
                             f"See 'nvidia-smi --help-query-{kind}' for more information.")
    return fields


def run(argv: list[str], state_dir: Path | None) -> int:
    try:
        opts = _parse(argv)
        fmt = [f.strip() for f in (opts["format"] or "").split(",") if f.strip()]
        if (opts["query_gpu"] or opts["query_apps"]) and "csv" not in fmt:
            raise UsageError('--format is required with a query; use --format=csv[,noheader][,nounits].')
        gpu_fields = _fields(opts["query_gpu"], GPU_FIELDS, "gpu") if opts["query_gpu"] else None
        app_fields = _fields(opts["query_apps"], APP_FIELDS, "compute-apps") if opts["query_apps"] else None
    except (UsageError, ValueError) as err:
        sys.stdout.write(f"{err}\n")
        return 2
    header, units = "noheader" not in fmt, "nounits" in fmt
    while True:
        if opts["list"]:
            text = "".join(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})\n"
                           for g in read_inventory(state_dir)["gpus"])
        elif gpu_fields:
            rows = [r for r in gpu_rows(state_dir) if opts["ids"] is None or r["index"] in opts["ids"]]
            text = render_csv(rows, gpu_fields, GPU_FIELDS, header, units)
        elif app_fields:
            text = render_csv(app_rows(state_dir), app_fields, APP_FIELDS, header, units)
        else:
            text = render_table(state_dir)
        sys.stdout.write(text)
        sys.stdout.flush()
        if opts["loop"] is None:
            return 0
        time.sleep(max(0.05, opts["loop"]))


def main() -> int:
    state = Path(STATE_DIR) if STATE_DIR else None
    try:
        return run(sys.argv[1:], state)
    except (KeyboardInterrupt, BrokenPipeError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
