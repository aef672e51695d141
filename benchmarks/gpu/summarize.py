#!/usr/bin/env python3
"""Turn one GPU run's sweeps (sweeps-<phase>-<version>.json from phase.py) into the committed result file.

    python3 benchmarks/gpu/summarize.py RUN_DIR --version 0.5.12.post1 --threshold 8 \
        --draft-mode skip --out benchmarks/gpu/results/0.5.12.post1.json

RUN_DIR holds what the device returned (sweeps-*.json, results-*.tar.gz with score.json, soak.json and
the server logs). The result keeps every level of every mode measured, and a `summary` that tools read:
{"concurrency": [...], "N": N, "tok_s": {"no_spec": [...], "eagle3": [...], "threshold_0": [...],
"threshold_-1": [...], "threshold_N": [...]}} (one number per level, same order), with the spread of
each number, the ratios the targets are stated in, the seconds per forward pass of each row (`step_ms`,
same shape as `tok_s`) and the target's shape (`model`: hidden, layers, heads, kv_heads, inter, vocab,
params_b).

The rows must come from one call of phase.py: every row carries its run id, release and model shape
(device/runinfo.py), and a folder whose rows name more than one run, another release than --version or
two model shapes is refused (exit 2), as is a results tarball of another run. Runs returned before rows
carried these have no shape to read: give it with --model-shape, or the summary says it is unknown.
"""
import argparse
import glob
import io
import json
import os
import sys
import tarfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "device"))
import runinfo  # noqa: E402

FIELDS = ("tok_s", "spread_pct", "client_tok_s", "tpot_ms", "batch", "spec_share", "accept_length",
          "step_ms", "tokens_per_step", "errors")


def _member(tars, name):
    for t in tars:
        for m in t.getmembers():
            if m.name.endswith(name):
                return json.load(io.TextIOWrapper(t.extractfile(m)))
    return None


def refuse(run_dir, why):
    print(f"summarize.py: {run_dir}: {why}; not summarized (one call of phase.py per result file)",
          file=sys.stderr)
    raise SystemExit(2)


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
    ap.add_argument("--model-shape", default="",
                    help="the target's shape for a run whose rows do not carry it: hidden=4096,layers=32,"
                         "heads=32,kv_heads=8,inter=11008,vocab=32000[,params_b=5.93]")
    a = ap.parse_args()
    given = None
    if a.model_shape:
        try:
            given = runinfo.parse_shape(a.model_shape)
        except ValueError as err:
            ap.error(f"--model-shape: {err}")
    sweeps = {}
    for f in sorted(glob.glob(os.path.join(a.run_dir, "sweeps-*.json"))):
        for label, rs in json.load(open(f)).items():
            if label in sweeps:
                refuse(a.run_dir, f"sweep {label!r} is in two sweeps files (the second: {os.path.basename(f)})")
            sweeps[label] = rs
    try:
        run = runinfo.one_run(sweeps, a.version)
    except ValueError as err:
        refuse(a.run_dir, str(err))
    tars = [tarfile.open(f) for f in sorted(glob.glob(os.path.join(a.run_dir, "results-*.tar.gz")))]
    tar_run = _member(tars, "/run.json")
    if run is not None and tar_run is not None and tar_run.get("run_id") != run["run_id"]:
        refuse(a.run_dir, f"the results tarball is of run {tar_run.get('run_id')}, the sweeps of run {run['run_id']}")
    if run is None and tar_run is not None:
        refuse(a.run_dir, f"the results tarball is of run {tar_run.get('run_id')}, the sweeps carry no run id")
    if run is not None and given is not None and given != run["model"]:
        refuse(a.run_dir, f"--model-shape {json.dumps(given)} but the rows were measured on {json.dumps(run['model'])}")
    shape = run["model"] if run is not None else given
    if shape is not None:
        model = dict(shape, source="config.json" if run is not None else "--model-shape")
    else:
        model = dict({k: None for k, _ in runinfo.SHAPE_KEYS}, params_b=None, source="unknown")
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
    step = {k: [by[k][c].get("step_ms") for c in levels] for k in rows}

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
        "run_id": run["run_id"] if run else None,
        "note": a.note,
        "gpu": "1 x NVIDIA H200 (141 GB), driver 580.159.04, torch 2.11.0+cu130",
        "model": {"target": (f"synthetic Llama, hidden {shape['hidden']}, {shape['layers']} layers, "
                             f"{shape['heads']}/{shape['kv_heads']} heads, intermediate {shape['inter']}, "
                             f"vocab {shape['vocab']}, bf16 ({shape['params_b']:.1f} B parameters)"
                             if shape else "synthetic Llama, shape unknown (not recorded by this run)"),
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
                    "worst": worst, "step_ms": step, "model": model},
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
