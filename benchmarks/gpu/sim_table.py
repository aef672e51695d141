#!/usr/bin/env python3
"""Turn a GPU run's committed result file into the step-cost table the demo host's simulator runs on.

    python3 benchmarks/gpu/sim_table.py benchmarks/gpu/results/0.5.12.post1.json \
        [--steady benchmarks/gpu/results/0.5.12.post1-5.9b-steady.json] \
        [--out dynctl/sim/gpu_table.json] [--check]

The run directory is found under `results/runs/` as the one whose sweeps are the result file's modes (its
name starts with the run's date); the prompts the sweeps sent are read from its results tarball. `--check`
compares with the file at --out instead of writing it (exit 1 on a difference). Re-run after every GPU run
that replaces the result file; tests/test_sim_table.py checks that the committed table is this script's
output for the committed result file.

How a level's measurement becomes a decode step cost. In a closed loop of C streams each request is one
prefill and then decode steps until its `new_tokens` are out (the first one comes from the prefill). The
server's counters give decode tokens per second (`tok_s`) and seconds per forward pass (`step_ms`), and
that pass count includes the prefill passes interleaved with decoding (sglang 0.5.12 counts both in
`sglang:cuda_graph_passes_total`), so `step_ms` is not the cost of a decode step. Per second of a level:

    1 = D * decode + R * prompt_tokens * prefill_per_token

with R = tok_s / (new_tokens - 1) requests and D = tok_s / (C * L) decode steps of C requests yielding L
tokens each (L = 1, or the accept length where the step speculates). The batch of a decode step is the
concurrency: in the threshold-0 rows, whose prefill share of passes is measured (`spec_share`), decode
tokens per decode pass come out at C. `prefill_per_token` is what one more token costs a forward pass; the
plain decode steps at the two largest batches, where the forward is compute bound, fix it: their decode
costs must differ by that per-token cost times the batch difference. Solving the line above for `decode`
then gives every level's decode step cost, and a simulator that charges these costs reproduces `tok_s`
level by level by construction, prefills included once.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

from steady_summary import run_file_text

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_OUT = os.path.join(REPO, "dynctl", "sim", "gpu_table.json")

# The simulator's step kinds and the sweep each one is measured by.
KINDS = {
    "plain": ("nospec", "no --speculative-algorithm: every decode step is a plain decode"),
    "speculate": ("eagle3", "pristine EAGLE-3: every decode step drafts and verifies"),
    "skip": ("skip-t0", "the patched server at threshold 0: every decode step is one the threshold "
                        "disabled (the patch's default draft mode for this model, `skip`)"),
}

COLUMNS = {
    "batch": "running requests in the decode step: the level's concurrency (the closed loop kept it full)",
    "decode_ms": "derived: milliseconds of one decode step at this batch, prefills taken out (see `derivation`)",
    "tok_s": "measured: generated tokens per second at this concurrency (server counters, mean of 3 windows)",
    "spread_pct": "measured: (max - min) / mean of tok_s across the 3 windows",
    "step_ms": "measured: window / forward passes, decode and interleaved prefill passes together",
    "accept_length": "measured: sglang:spec_accept_length at the end of the level (speculate rows only)",
    "step_ratio": ("measured: a disabled step's cost over a plain decode step's at this batch, every request "
                   "decoding together (the steady file of `source.steady`; skip rows of a table built with it)"),
}

DERIVATION = ("per second of a level: 1 = tok_s / (batch * L) * decode_ms / 1000 + tok_s / (new_tokens - 1) * "
              "prompt_tokens_mean * prefill_ms_per_token / 1000, L = accept_length for speculate rows, else 1; "
              "prefill_ms_per_token is also what one more request adds to a plain decode step between the two "
              "largest batches, where the forward is compute bound")


class TableError(RuntimeError):
    """The result file or its run directory cannot give a table; the message names the file and the gap."""


def find_run_dir(results_path: str, modes: dict) -> str:
    """The run directory under results/runs whose sweeps are exactly the result file's modes."""
    runs = os.path.join(os.path.dirname(os.path.abspath(results_path)), "runs")
    for run in sorted(glob.glob(os.path.join(runs, "*"))):
        sweeps = {}
        for path in sorted(glob.glob(os.path.join(run, "sweeps-*.json"))):
            with open(path) as f:
                sweeps.update(json.load(f))
        if sweeps and all(name in sweeps and [r["tok_s"] for r in sweeps[name]] == [r["tok_s"] for r in rows]
                          for name, rows in modes.items()):
            return run
    raise TableError(f"{results_path}: no run directory under {runs} has sweeps equal to its modes "
                     f"{sorted(modes)}; the table needs the run's date and prompts")


def prompt_tokens_mean(run_dir: str) -> float:
    """Mean length of the prompts the sweeps drew from (results/prompts.json in the run's tarball)."""
    text = run_file_text(run_dir, "prompts.json")
    if text is None:
        raise TableError(f"{run_dir}: no results/prompts.json in its results-*.tar.gz")
    prompts = json.loads(text)
    return sum(len(p) for p in prompts) / len(prompts)


def build_table(results: dict, results_name: str, run_name: str, prompt_tokens: float,
                steady: dict | None = None, steady_name: str | None = None) -> dict:
    """With `steady` (a steady step-cost file of steady_summary.py, same model shape), a disabled step costs
    the plain step of the table times the steady file's threshold_0 / no_spec ratio at that batch: the
    patch of that later run, measured per step, instead of the sweep's closed-loop disabled rows."""
    modes = results["modes"]
    missing = [mode for mode, _ in KINDS.values() if mode not in modes]
    if missing:
        raise TableError(f"{results_name}: no sweep for {missing}; it has {sorted(modes)}")
    found = re.search(r"(\d+) new tokens", results.get("method", ""))
    if not found:
        raise TableError(f"{results_name}: `method` does not say how many new tokens a request asked for")
    new_tokens = int(found.group(1))
    date = re.match(r"\d{4}-\d{2}-\d{2}", os.path.basename(run_name))
    if not date:
        raise TableError(f"{run_name}: the run directory's name does not start with its date (YYYY-MM-DD)")
    flags = results.get("flags", [])
    steps = int(flags[flags.index("--speculative-num-steps") + 1])
    draft_tokens = int(flags[flags.index("--speculative-num-draft-tokens") + 1])

    eagle = modes["eagle3"]
    accept = sum(r["accept_length"] for r in eagle) / len(eagle)
    decoded = new_tokens - 1  # the first token of a request comes out of its prefill
    per_request = prompt_tokens / decoded

    plain = sorted(modes["nospec"], key=lambda r: r["concurrency"])
    (c1, t1), (c2, t2) = [(r["concurrency"], r["tok_s"]) for r in plain[-2:]]
    # decode(c) = c/tok_s - c * per_request * k  and  decode(c2) - decode(c1) = k * (c2 - c1)
    prefill_s_per_token = (c2 / t2 - c1 / t1) / ((c2 - c1) * (1 + per_request))

    ratios = None
    if steady is not None:
        summary = steady["summary"]
        shape = {k: summary["model"].get(k) for k in ("hidden", "layers")}
        wanted = {k: results.get("model", {}).get(k) for k in ("hidden", "layers")}
        if None not in wanted.values() and shape != wanted:
            raise TableError(f"{steady_name}: model {shape} is not the results' {wanted}")
        ratios = dict(zip(summary["levels"], summary["step_ratio_vs_no_spec"]["threshold_0"]))

    def rows(kind: str) -> list[dict]:
        if kind == "skip" and ratios is not None:
            plain_rows = {r["batch"]: r for r in rows("plain")}
            missing = sorted(set(plain_rows) - set(ratios))
            if missing:
                raise TableError(f"{steady_name}: no threshold_0 step ratio at batches {missing}")
            return [{"batch": b, "decode_ms": round(r["decode_ms"] * ratios[b], 4), "step_ratio": ratios[b]}
                    for b, r in sorted(plain_rows.items())]
        out = []
        for r in sorted(modes[KINDS[kind][0]], key=lambda r: r["concurrency"]):
            c, tok_s = r["concurrency"], r["tok_s"]
            tokens = accept if kind == "speculate" else 1.0
            seconds = c * tokens / tok_s * (1 - tok_s * per_request * prefill_s_per_token)
            if seconds <= 0:
                raise TableError(f"{results_name}: {KINDS[kind][0]} at concurrency {c} leaves no time for decoding")
            row = {"batch": c, "decode_ms": round(1000 * seconds, 4), "tok_s": tok_s,
                   "spread_pct": r["spread_pct"], "step_ms": r["step_ms"]}
            if kind == "speculate":
                row["accept_length"] = round(r["accept_length"], 3)
            out.append(row)
        return out

    def kind_entry(kind: str, mode: str, what: str) -> dict:
        if kind == "skip" and ratios is not None:
            return {"sweep": "nospec x steady threshold_0/no_spec",
                    "what": ("a step the threshold disabled: the plain step at this batch times the step ratio "
                             "measured per step on the same model shape (source.steady)"),
                    "rows": rows(kind)}
        return {"sweep": mode, "what": what, "rows": rows(kind)}

    model = results.get("model", {})
    steady_source = None
    if steady is not None:
        steady_source = {"results": os.path.relpath(steady_name, REPO), "runs": steady.get("runs"),
                         "sglang": steady.get("version"), "model": steady["summary"]["model"],
                         "method": steady["summary"].get("method")}
    return {
        "about": ("Decode step costs of the demo host's simulator (dynctl/sim/costmodel.py), derived from GPU "
                  "measurements. Generated by benchmarks/gpu/sim_table.py; do not edit by hand."),
        "source": {
            "results": os.path.relpath(results_name, REPO),
            "run": os.path.relpath(run_name, REPO),
            "date": date.group(0),
            "sglang": results["sglang"],
            "gpu": results["gpu"],
            "model": model,
            "flags": flags,
            "method": results["method"],
            "recommended_threshold": results.get("summary", {}).get("N"),
            **({"steady": steady_source} if steady_source else {}),
        },
        "workload": {"prompt_tokens_mean": round(prompt_tokens, 3), "new_tokens": new_tokens},
        "speculation": {"steps": steps, "draft_tokens": draft_tokens, "accept_length": round(accept, 4),
                        "accept_length_from": "mean of the speculate rows' accept_length"},
        "prefill_ms_per_token": round(1000 * prefill_s_per_token, 6),
        "derivation": DERIVATION,
        "columns": COLUMNS,
        "kinds": {kind: kind_entry(kind, mode, what) for kind, (mode, what) in KINDS.items()},
        "releases": release_table(),
    }


def release_table() -> dict:
    """Which sglang releases the simulated host serves patched (measured on a GPU or not) or native, from
    patches/variants.toml: the simulator runs the same step costs for every patched release."""
    sys.path.insert(0, REPO)  # dynctl's own reading of the table and its strategy rule
    from dynctl.patching.recipe import releases
    from dynctl.patching.versions import shortfall, strategy_for

    def said(name, release):
        if release.measured:
            short = shortfall(name)
            return "patched, measured on a GPU" + (f"; {short}" if short else "")
        taken = ('strategy = "auto" takes it: no native route before 0.5.14' if strategy_for(name) == "patch"
                 else 'only with strategy = "patch"')
        return f"patched, not measured on a GPU ({taken}; these step costs stand in for it)"

    patched = {name: said(name, release) for name, release in releases().items()}
    return {
        "patched": patched,
        "native": ("sglang 0.5.14 and later without a measured patch variant (and any of them with strategy = "
                   "\"native\"): native adaptive speculation, whose steps 0 the simulator runs as a verify of "
                   "one token per request (dynctl/sim/speculation.py)"),
        "from": "patches/variants.toml",
    }


def render(table: dict) -> str:
    return json.dumps(table, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a committed GPU result file, e.g. benchmarks/gpu/results/0.5.12.post1.json")
    ap.add_argument("--out", default=DEFAULT_OUT, help="where the table goes (default: the simulator's own)")
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    ap.add_argument("--steady", help="a steady step-cost file (steady_summary.py) of the same model shape: "
                                     "disabled steps cost the plain step times its threshold_0/no_spec ratio")
    a = ap.parse_args(argv)
    try:
        with open(a.results) as f:
            results = json.load(f)
        run_dir = find_run_dir(a.results, results.get("modes", {}))
        steady = None
        if a.steady:
            with open(a.steady) as f:
                steady = json.load(f)
        text = render(build_table(results, os.path.abspath(a.results), run_dir, prompt_tokens_mean(run_dir),
                                  steady, a.steady and os.path.abspath(a.steady)))
    except (OSError, ValueError, KeyError, TableError) as err:
        print(f"sim_table: {err}", file=sys.stderr)
        return 2
    if a.check:
        try:
            with open(a.out) as f:
                same = f.read() == text
        except OSError:
            same = False
        if not same:
            print(f"sim_table: {a.out} is not what {a.results} gives; run without --check to regenerate",
                  file=sys.stderr)
            return 1
        return 0
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, a.out)
    kinds = json.loads(text)["kinds"]
    print(f"{a.out}: " + ", ".join(f"{kind} at {len(v['rows'])} batch sizes" for kind, v in kinds.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
