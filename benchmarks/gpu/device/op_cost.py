#!/usr/bin/env python3
"""Host time of the tensor operations a plain-decode step issues, each against its alternative.

A small model's decode step is bounded by the scheduler's host time (pyspy_summary.py), so the
host cost of each torch call on the step's path matters: this times each on the GPU machine's CUDA
device, as the step issues it (batch sizes, dtypes, the FutureMap's buffers), in microseconds of
host time per call (the loop's wall time without the final synchronisation; the queue is drained
between rounds so it never fills), the median of ROUNDS rounds of CALLS calls.

  python3 op_cost.py [--out op_cost.json]

Rows: `index` (`buf[idx]`) against `index_select`; `index_put` (`buf[idx] = x`) against
`index_copy_`; the two-tensor advanced index of the KV slot table (as the plain step reads the slot
it writes) against one index_select of the flattened table; the dtype conversions and a no-op `.to`.
Run 50 (benchmarks/gpu/README.md) found the alternatives no cheaper: the advanced indexes stay.
"""
import argparse
import json
import statistics
import time

import torch

ROUNDS, CALLS = 7, 400


def host_us(fn):
    torch.cuda.synchronize()
    per = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for _ in range(CALLS):
            fn()
        per.append((time.perf_counter() - t) * 1e6 / CALLS)
        torch.cuda.synchronize()
    return round(statistics.median(per), 2), round(min(per), 2), round(max(per), 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device("cuda")
    pool, width = 512, 4096
    buf = torch.zeros(pool, dtype=torch.int64, device=dev)
    table = torch.arange(pool * width, dtype=torch.int32, device=dev).view(pool, width)
    rows = []
    for bs in (1, 16, 64, 256):
        idx = torch.randperm(pool, device=dev)[:bs].to(torch.int64)
        seq = torch.randint(1, width - 8, (bs,), dtype=torch.int64, device=dev)
        src = torch.randint(0, 32000, (bs,), dtype=torch.int64, device=dev)
        src32 = src.to(torch.int32)
        flat = seq.add(idx, alpha=width)
        assert torch.equal(table.view(-1).index_select(0, flat).long(), table[idx, seq].to(torch.int64))
        assert torch.equal(buf.index_select(0, idx), buf[idx])
        ops = {
            "index buf[idx]": lambda: buf[idx],
            "index_select": lambda: buf.index_select(0, idx),
            "index_put buf[idx] = x": lambda: buf.__setitem__(idx, src),
            "index_copy_": lambda: buf.index_copy_(0, idx, src),
            "slots table[idx, seq].to(int64)": lambda: table[idx, seq].to(torch.int64),
            "slots flat index_select .long()": lambda: table.view(-1).index_select(0, seq.add(idx, alpha=width)).long(),
            "int64 -> int32 .to": lambda: src.to(torch.int32),
            "int32 -> int64 .to": lambda: src32.to(torch.int64),
            "int64 .to(int64) (no-op)": lambda: src.to(torch.int64),
            "seq + 1": lambda: seq + 1,
        }
        for name, fn in ops.items():
            med, lo, hi = host_us(fn)
            rows.append({"bs": bs, "op": name, "host_us": med, "min": lo, "max": hi})
            print(f"bs {bs:3d}  {name:34s} {med:7.2f} us  [{lo:.2f}-{hi:.2f}]", flush=True)
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rounds": ROUNDS,
           "calls": CALLS, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
