#!/usr/bin/env python3
"""Where a decode step's time goes: a summary of one torch-profiler trace of K steps (stdlib only).

Reads the Chrome trace that sglang's `/start_profile` writes (`*.trace.json.gz`) and reports, per step:
- `wall_us`: from the first GPU activity to the last, divided by the steps;
- `gpu_busy_us` (the union of kernel, memcpy and memset intervals) and `gpu_idle_us` (the rest of the
  wall time: the GPU waiting for the CPU);
- `kernels`: GPU time and count per kernel name (inside CUDA graphs too: CUPTI reports them);
- `runtime`: CUDA runtime calls on the CPU (launches, copies, synchronisations), count and time;
- `cpu_ops`: top-level aten operators (what the scheduler and worker do in torch between graph
  replays), count and time;
- `threads`: CPU time of the top-level operators per thread.

  trace_summary.py TRACE.json.gz --steps K [--top 25]        prints the JSON summary
  trace_summary.py --diff A.json B.json                       per-step differences of two summaries
"""
import argparse
import gzip
import json
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def union_us(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def top_level(events):
    """The operators not nested inside another of the same thread (so time is not counted twice)."""
    out = []
    by_thread = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for key, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        end = -1.0
        for e in evs:
            if e["ts"] >= end:
                out.append((key, e))
                end = e["ts"] + e.get("dur", 0)
    return out


def summarize(path, steps, top=25):
    events = [e for e in load(path) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu or steps <= 0:
        return {"trace": path, "error": "no GPU activity in the trace"}
    first = min(e["ts"] for e in gpu)
    last = max(e["ts"] + e["dur"] for e in gpu)
    wall = last - first
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    kernels = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        k = kernels[e["name"][:120]]
        k[0] += 1
        k[1] += e["dur"]
    runtime = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            r = runtime[e["name"]]
            r[0] += 1
            r[1] += e["dur"]
    ops = defaultdict(lambda: [0, 0.0])
    threads = defaultdict(float)
    for key, e in top_level([e for e in events if e.get("cat") == "cpu_op"]):
        o = ops[e["name"]]
        o[0] += 1
        o[1] += e["dur"]
        threads[str(key[1])] += e["dur"]

    def per_step(table):
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
        return {name: {"n": round(n / steps, 2), "us": round(t / steps, 2)} for name, (n, t) in rows}

    return {
        "trace": path,
        "steps": steps,
        "wall_us": round(wall / steps, 1),
        "gpu_busy_us": round(busy / steps, 1),
        "gpu_idle_us": round((wall - busy) / steps, 1),
        "gpu_activities_per_step": round(len(gpu) / steps, 1),
        "kernels": per_step(kernels),
        "runtime": per_step(runtime),
        "cpu_ops": per_step(ops),
        "cpu_op_us": round(sum(t for _, t in ops.values()) / steps, 1),
        "cpu_ops_per_step": round(sum(n for n, _ in ops.values()) / steps, 1),
        "threads": {k: round(v / steps, 1) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])[:6]},
    }


def diff(a, b, top=15):
    """b minus a, per step: the totals, then the names whose time differs most."""
    out = {k: round(b[k] - a[k], 1) for k in ("wall_us", "gpu_busy_us", "gpu_idle_us", "cpu_op_us",
                                               "cpu_ops_per_step", "gpu_activities_per_step")}
    for table in ("kernels", "runtime", "cpu_ops"):
        names = set(a[table]) | set(b[table])
        d = {n: (b[table].get(n, {"n": 0, "us": 0})["us"] - a[table].get(n, {"n": 0, "us": 0})["us"],
                 b[table].get(n, {"n": 0})["n"] - a[table].get(n, {"n": 0})["n"]) for n in names}
        rows = sorted(d.items(), key=lambda kv: -abs(kv[1][0]))[:top]
        out[table] = {n: {"us": round(us, 2), "n": round(cnt, 2)} for n, (us, cnt) in rows if abs(us) >= 0.5}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--diff", nargs=2)
    a = ap.parse_args()
    if a.diff:
        print(json.dumps(diff(*(json.load(open(p)) for p in a.diff)), indent=1))
    else:
        print(json.dumps(summarize(a.trace, a.steps, a.top), indent=1))


if __name__ == "__main__":
    main()
