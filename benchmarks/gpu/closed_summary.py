#!/usr/bin/env python3
"""Closed-loop throughput and where its prefills go: the profile phase's `closed-<label>.json` rows and
each level's server metrics (`closed-<label>-c<N>-metrics-{start,end}.txt`) of one or more calls -> one
results file.

  .venv/bin/python benchmarks/gpu/closed_summary.py RUN_DIR [RUN_DIR ...] --version V \\
      --model hidden=2048,layers=24,params_b=1.21 --out F [--same nospec2:no_spec --same patched2:threshold_0]

(the project's environment: it reads the metrics with dynctl's own Prometheus parser)

Per level and mode (`--same` pools a second server of a mode into it, as in steady_summary.py):
- `tok_s`: the mean output tok/s over every round of every server of the mode, `tok_s_spread_pct`
  (max - min) / mean over those rounds, and the ratio to the no-spec servers' mean;
- from the servers' own counters (end minus start of each level's windows, summed over the mode's
  servers and rounds): `prefill_passes` by CUDA-graph mode (`sglang:cuda_graph_passes_total`, the
  prefill_* modes), `prefill_forward_ms_per_req` (the `prefill_forward` stage of
  `sglang:per_stage_req_latency_seconds`, sum over count) and `ttft_ms` (time to first token, sum over
  count): what a closed loop spends beyond the decode steps that the steady levels time.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # steady_summary.py; dynctl's metrics parser
from steady_summary import read_runs, run_file_text  # noqa: E402

from dynctl.base.parsers.prometheus import parse_prometheus  # noqa: E402

PASSES = "sglang:cuda_graph_passes_total"
STAGE = "sglang:per_stage_req_latency_seconds"
TTFT = "sglang:time_to_first_token_seconds"


def counters(run, label, c):
    """What the server `label` counted during level c's windows: prefill passes by graph mode, the
    prefill_forward stage (seconds, requests) and time to first token (seconds, requests)."""
    texts = [run_file_text(run, f"closed-{label}-c{c}-metrics-{when}.txt") for when in ("start", "end")]
    if None in texts:
        return None
    start, end = (parse_prometheus(text) for text in texts)

    def delta(name, **match):
        """The series of `name` whose labels match, end minus start, summed."""
        before = {tuple(sorted(s.labels.items())): s.value for s in start.get(name, [])}
        return sum(s.value - before.get(tuple(sorted(s.labels.items())), 0.0) for s in end.get(name, [])
                   if all(s.labels.get(k) == v for k, v in match.items()))

    modes = sorted({s.labels.get("mode", "") for s in end.get(PASSES, [])})
    return {"prefill_passes": {m: int(round(delta(PASSES, mode=m))) for m in modes if m.startswith("prefill")},
            "prefill_forward": (delta(STAGE + "_sum", stage="prefill_forward"),
                                delta(STAGE + "_count", stage="prefill_forward")),
            "ttft": (delta(TTFT + "_sum"), delta(TTFT + "_count"))}


def main():
    def with_counters(run, label, row):
        row["counters"] = counters(run, label, row["concurrency"])

    a, model, rows = read_runs("closed", with_counters)
    levels = sorted({r["concurrency"] for rs in rows.values() for r in rs})
    # a server's counters cover every round of a level, so each (run, server, level) counts once
    seen = set()

    def at(mode, c):
        return [r for r in rows.get(mode, []) if r["concurrency"] == c]

    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    tok_s, spread, ratio, passes, prefill_ms, ttft = {}, {}, {}, {}, {}, {}
    for mode in sorted(rows):
        for field in (tok_s, spread, ratio, passes, prefill_ms, ttft):
            field[mode] = []
        for c in levels:
            values = [r["tok_s"] for r in at(mode, c) if r.get("tok_s")]
            m = mean(values)
            base = mean([r["tok_s"] for r in at(a.base, c) if r.get("tok_s")])
            tok_s[mode].append(round(m, 1) if m else None)
            spread[mode].append(round(100 * (max(values) - min(values)) / m, 1) if m else None)
            ratio[mode].append(round(m / base, 3) if m and base else None)
            counted, fwd, first = {}, [0.0, 0.0], [0.0, 0.0]
            for r in at(mode, c):
                key = (r["run"], r["server"], c)
                if r["counters"] is None or key in seen:
                    continue
                seen.add(key)
                for graph_mode, n in r["counters"]["prefill_passes"].items():
                    counted[graph_mode] = counted.get(graph_mode, 0) + n
                fwd = [x + y for x, y in zip(fwd, r["counters"]["prefill_forward"])]
                first = [x + y for x, y in zip(first, r["counters"]["ttft"])]
            passes[mode].append({k: v for k, v in sorted(counted.items()) if v})
            prefill_ms[mode].append(round(1e3 * fwd[0] / fwd[1], 2) if fwd[1] else None)
            ttft[mode].append(round(1e3 * first[0] / first[1], 1) if first[1] else None)
    summary = {"levels": levels, "tok_s": tok_s, "tok_s_spread_pct": spread, "tok_s_ratio_vs_" + a.base: ratio,
               "prefill_passes": passes, "prefill_forward_ms_per_req": prefill_ms, "ttft_ms": ttft,
               "model": model, "method": "closed loop: c streams, 128 new tokens a request, prefills mixed in; "
                                         "tok/s per round; prefill counters = end - start of the level's windows"}
    json.dump({"version": a.version, "runs": [os.path.basename(os.path.normpath(r)) for r in a.runs],
               "summary": summary, "rows": rows}, open(a.out, "w"), indent=1)
    for mode in sorted(rows):
        print(f"{mode:16s} " + " ".join(
            f"c{c}={t}({x}, prefill {p} ms/req, {g})"
            for c, t, x, p, g in zip(levels, tok_s[mode], ratio[mode], prefill_ms[mode], passes[mode])))


if __name__ == "__main__":
    main()
