"""Stop latencies of the agent's `server_stop` on loopback, against the real test server (tests/servers/).

For each variant, start a server through the agent, wait until ready, stop it, and read the agent's
own timings (measured on the host, not through the transport):

  sigterm→exit     SIGTERM sent → main pid gone (the test server drains for 0.1 s)
  exit→port free   main pid gone → sweep of its tree done → no listener on the port
  sweep            main pid gone → survivors SIGKILLed and gone
  stop call        the whole `server_stop` round trip seen by the client

Variants: plain; --children (two leaked children to sweep); --orphan-port (a leaked child that keeps
the listening socket, so the port frees only after the sweep); with --sim also the simulated SGLang
host (8 TP scheduler children, fake nvidia-smi: adds the GPU-release wait).

    /tmp/venv/bin/python benchmarks/bench_lifecycle.py [--rounds 10] [--sim] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from dynctl.core import lifecycle  # noqa: E402
from lifecycle_harness import make_box  # noqa: E402

VARIANTS = {"plain": (), "children": ("--children",), "orphan-port": ("--orphan-port",)}
FIELDS = ("sigterm_to_exit_s", "exit_to_port_free_s", "sweep_s", "exit_to_gpu_released_s", "call_s")


def measure(variant: str, flags: tuple[str, ...], rounds: int, tmp: Path) -> dict[str, dict[str, float]]:
    box = make_box(tmp / variant, **(sim_host(tmp) if variant == "sim" else {}))
    samples: dict[str, list[float]] = {f: [] for f in FIELDS}
    try:
        for _ in range(rounds):
            box.start_ready(*flags)
            t0 = time.perf_counter()
            result = lifecycle.stop_server(box.agent, grace=10)
            samples["call_s"].append(time.perf_counter() - t0)
            for f in FIELDS[:-1]:
                if f in result["timings"]:
                    samples[f].append(result["timings"][f])
    finally:
        box.cleanup()
    return {f: {"median_ms": statistics.median(v) * 1000, "max_ms": max(v) * 1000, "n": len(v)}
            for f, v in samples.items() if v}


def sim_host(tmp: Path) -> dict:
    from dynctl.sim.hostsetup import prepare_demo_host
    from sglang_trees import sglang_wheel

    entry = prepare_demo_host(tmp / "demo", "0.5.9", cache_dir=sglang_wheel("0.5.9").parent, time_scale=50)
    entry.pop("port")
    entry["launch"] = tuple(a.replace("{python}", entry["python"]) for a in entry["launch"])
    entry["args"] = tuple(entry["args"])
    return {k: v for k, v in entry.items() if k != "simulated"} | {"workdir": str(tmp / "sim-work")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sim", action="store_true", help="also the simulated SGLang host (needs the 0.5.9 wheel)")
    args = ap.parse_args()
    results = {}
    variants = dict(VARIANTS, sim=()) if args.sim else VARIANTS
    with tempfile.TemporaryDirectory(prefix="bench-lifecycle-") as tmp:
        for name, flags in variants.items():
            results[name] = measure(name, flags, args.rounds, Path(tmp))
    print(f"{'variant':<12} " + " ".join(f"{f.removesuffix('_s').replace('_to_', '→'):>22}" for f in FIELDS))
    for name, res in results.items():
        cells = [f"{res[f]['median_ms']:9.1f} ms (max {res[f]['max_ms']:6.1f})" if f in res else "-" for f in FIELDS]
        print(f"{name:<12} " + " ".join(f"{c:>22}" for c in cells))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
