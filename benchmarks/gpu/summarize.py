#!/usr/bin/env python3
"""Turn one GPU run's sweeps (sweeps-<phase>-<version>.json from phase.py) into the committed result file.

    python3 benchmarks/gpu/summarize.py RUN_DIR --version 0.5.12.post1 --threshold 8 \
        --draft-mode skip --out benchmarks/gpu/results/0.5.12.post1.json

RUN_DIR holds what the device returned (sweeps-*.json, results-*.tar.gz with score.json, soak.json and
the server logs). The result keeps every level of every mode measured, and a `summary` that tools read:
{"concurrency": [...], "N": N, "tok_s": {"no_spec": [...], "eagle3": [...], "threshold_0": [...],
"threshold_-1": [...], "threshold_N": [...]}} (one number per level, same order), with the spread of
each number and the ratios the targets are stated in.
"""
import argparse
import glob
import io
import json
import os
import tarfile

FIELDS = ("tok_s", "spread_pct", "client_tok_s", "tpot_ms", "batch", "spec_share", "accept_length",
          "step_ms", "tokens_per_step", "errors")


def _member(tars, name):
    for t in tars:
        for m in t.getmembers():
            if m.name.endswith(name):
                return json.load(io.TextIOWrapper(t.extractfile(m)))
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--version", required=True)
    ap.add_argument("--threshold", type=int, required=True, help="N, dynctl's recommendation in that run")
    ap.add_argument("--draft-mode", choices=["skip", "warm"], required=True,
                    help="which patched server the summary's threshold_0/threshold_N rows come from")
    ap.add_argument("--labels", default="",
                    help="sweep labels of the threshold rows, t0,tm1,tN (default <draft-mode>-t0,warm-tm1,"
                         "<draft-mode>-tN)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    sweeps = {}
    for f in sorted(glob.glob(os.path.join(a.run_dir, "sweeps-*.json"))):
        sweeps.update(json.load(open(f)))
    tars = [tarfile.open(f) for f in glob.glob(os.path.join(a.run_dir, "results-*.tar.gz"))]
    n, mode = a.threshold, a.draft_mode
    t0, tm1, tn = a.labels.split(",") if a.labels else (f"{mode}-t0", "warm-tm1", f"{mode}-t{n}")
    rows = {"no_spec": "nospec", "eagle3": "eagle3", "threshold_0": t0, "threshold_-1": tm1, "threshold_N": tn}
    missing = [v for v in rows.values() if v not in sweeps]
    if missing:
        raise SystemExit(f"{a.run_dir}: no sweep for {missing}; have {sorted(sweeps)}")
    levels = [r["concurrency"] for r in sweeps["nospec"]]
    by = {k: {r["concurrency"]: r for r in sweeps[v]} for k, v in rows.items()}
    tok = {k: [by[k][c]["tok_s"] for c in levels] for k in rows}
    spread = {k: [by[k][c]["spread_pct"] for c in levels] for k in rows}

    def ratio(num, den):
        return [round(x / y, 3) if y else None for x, y in zip(num, den)]

    first = sweeps["nospec"][0].get("windows") or [{}]
    windows, seconds = len(first), round(first[0].get("seconds", 0), 1)
    best = [max(x, y) for x, y in zip(tok["no_spec"], tok["eagle3"])]
    ratios = {"threshold_N / max(no_spec, eagle3)": ratio(tok["threshold_N"], best),
              "threshold_0 / no_spec": ratio(tok["threshold_0"], tok["no_spec"]),
              "threshold_-1 / eagle3": ratio(tok["threshold_-1"], tok["eagle3"])}
    targets = {"threshold_N / max(no_spec, eagle3)": 0.95, "threshold_0 / no_spec": 0.95,
               "threshold_-1 / eagle3": 0.97}
    worst = {k: {"ratio": min(v), "at_concurrency": levels[v.index(min(v))], "target": targets[k]}
             for k, v in ratios.items()}
    result = {
        "sglang": a.version,
        "note": a.note,
        "gpu": "1 x NVIDIA H200 (141 GB), driver 580.159.04, torch 2.11.0+cu130",
        "model": {"target": "synthetic Llama, hidden 4096, 32 layers, 32/8 heads, intermediate 11008, "
                            "vocab 32000, bf16 (5.9 B parameters)",
                  "draft": "EAGLE-3 (LlamaForCausalLMEagle3), one layer, accept length 2.8-3.0 at 3 steps"},
        "flags": ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--skip-tokenizer-init",
                  "--disable-radix-cache", "--max-running-requests", "256", "--max-total-tokens", "72000",
                  "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                  "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                  "CUDA graphs on (bs 1..256)"],
        "method": "closed loop of C workers on /generate, 128 new tokens, greedy; after a warm-up, "
                  f"{windows} back-to-back windows of {seconds} s per level measured with the server's own counters "
                  "(sglang:realtime_tokens_total{mode=decode}, sglang:cuda_graph_passes_total); tok_s is the "
                  "mean of the windows and spread_pct (max-min)/mean across them",
        "draft_mode_in_summary": mode,
        "summary": {"concurrency": levels, "N": n, "tok_s": tok, "spread_pct": spread, "ratios": ratios,
                    "worst": worst},
        "modes": {label: [{k: r.get(k) for k in ("concurrency",) + FIELDS} for r in rs]
                  for label, rs in sorted(sweeps.items())},
        "correctness": _member(tars, "score.json"),
        "soak": _member(tars, "soak.json"),
    }
    if result["soak"] and result["soak"].get("load"):
        result["soak"]["load"].pop("windows", None)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    for k, v in worst.items():
        print(f"{k}: worst {v['ratio']} at c{v['at_concurrency']} (target {v['target']})")


if __name__ == "__main__":
    main()
