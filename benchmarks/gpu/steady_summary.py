#!/usr/bin/env python3
"""Step cost at fixed batch sizes: the profile phase's `steady-<label>.json` rows of one or more calls
-> one results file with the `summary` shape of the sweep results plus `step_ms` per mode.

  steady_summary.py RUN_DIR [RUN_DIR ...] --version V --model hidden=2048,layers=24,params_b=1.2 --out F

Each RUN_DIR is one call (its modes were measured level by level in turn, on the same minutes of the
machine); a mode measured in several calls keeps each call's row, and `summary` gives per level the
mean step time, its spread across the calls and windows ((max - min) / mean, percent), and the ratio
to the no-spec server's mean step time at that level. `--same LABEL:MODE` pools a second server of a
mode into it (a call that ran two no-spec servers, or two of one patched tree, to see how far servers
of the same code differ): its rows join the mode's, each keeping the server's label in "server".
`summary` also gives the ratio round by round (`paired_ratios`): its median, range and count; and
the same from the servers' own log intervals, where the call's server logs are there (`log_steps`).
"""
import argparse
import glob
import json
import os
import re
import statistics
import tarfile


def tarball_files(run):
    """(basename, read) of each file in a call's results tarballs (`results-*.tar.gz`); read() gives
    its bytes while the iteration is at it."""
    for tarball in sorted(glob.glob(os.path.join(run, "results-*.tar.gz"))):
        with tarfile.open(tarball) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    yield os.path.basename(member.name), lambda member=member, tar=tar: tar.extractfile(member).read()


def run_file_text(run, name):
    """The text of the file `name` of a call's folder: the unpacked file, or else its copy in the call's
    results tarball (which trim_run.py leaves as the only copy of the bulky files); None when neither
    has it."""
    path = os.path.join(run, name)
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    return next((read().decode() for base, read in tarball_files(run) if base == name), None)


def mode_name(label):
    """The results' name for a profile phase's server label ("t5": threshold 5; "<tree>-t0": another
    patch build)."""
    if label == "nospec":
        return "no_spec"
    tree, _, t = label.rpartition("-")
    if t[:1] == "t" and t[1:].lstrip("-").isdigit():
        return f"threshold_{t[1:]}" + (f"_{tree}" if tree else "")
    return label


def pooled(rows, same, error):
    """`rows` (mode -> rows) with each `--same LABEL:MODE` server's rows moved into MODE's; `error`
    (argparse's) refuses a label that no call measured."""
    for pair in same:
        label, _, mode = pair.partition(":")
        if label not in rows or mode not in rows:
            error(f"--same {pair}: no rows labelled {label if label not in rows else mode} "
                  f"(labels: {', '.join(sorted(rows))})")
        rows[mode] += rows.pop(label)
    return rows


def read_runs(kind, each=None):
    """The command line shared with closed_summary.py, and the rows of its runs' `<kind>-<label>.json`
    files by mode (each stamped with its run and server; `each(run, label, row)` adds to a row):
    (args, model, rows), the second servers pooled."""
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--version", required=True)
    ap.add_argument("--model", required=True, help="k=v,... (hidden, layers, heads, kv_heads, inter, params_b)")
    ap.add_argument("--base", default="no_spec")
    ap.add_argument("--out", required=True)
    ap.add_argument("--same", action="append", default=[], metavar="LABEL:MODE",
                    help="pool the rows of server LABEL into MODE (a results name such as no_spec)")
    a = ap.parse_args()
    model = {}
    for kv in a.model.split(","):
        k, _, v = kv.partition("=")
        model[k] = float(v) if "." in v else int(v)
    rows = {}
    for run in a.runs:
        for path in sorted(glob.glob(os.path.join(run, f"{kind}-*.json"))):
            label = os.path.basename(path)[len(kind) + 1:-len(".json")]
            for r in json.load(open(path)):
                r["run"], r["server"] = os.path.basename(os.path.normpath(run)), label
                if each:
                    each(run, label, r)
                rows.setdefault(label, []).append(r)
    if not rows:
        ap.error(f"no {kind}-<label>.json in {', '.join(a.runs)}")
    return a, model, pooled({mode_name(label): rs for label, rs in rows.items()}, a.same, ap.error)


def paired_ratios(rows, levels, base):
    """Per mode and level, the step ratio to `base` measured round by round: a server's k-th row at a
    level of one call against the base rows of the same call, level and round (their mean where two
    base servers were pooled). A call that measures each level several times in alternating order
    (the profile phase's LEVELS=16,16,16,16 gives AB BA AB BA) pairs measurements minutes apart by
    seconds, so the machine's drift between rounds cancels; the median and the [min, max] of those
    ratios, and how many there were. A mode with no pair at a level gets None there."""
    def rounds(rs):
        seen, out = {}, {}
        for r in rs:
            if not r.get("step_ms"):
                continue
            key = (r["run"], r["server"], r["concurrency"])
            k = seen[key] = seen.get(key, -1) + 1
            out.setdefault((r["run"], r["concurrency"], k), []).append(r["step_ms"])
        return out

    base_at = {key: sum(v) / len(v) for key, v in rounds(rows.get(base, [])).items()}
    out = {}
    for label in sorted(rows):
        mine = rounds(rows[label])
        med, rng, n = [], [], []
        for c in levels:
            ratios = sorted(x / base_at[key] for key, xs in mine.items() if key[1] == c and key in base_at for x in xs)
            n.append(len(ratios))
            if not ratios:
                med.append(None)
                rng.append(None)
                continue
            mid = len(ratios) // 2
            med.append(round(ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2, 3))
            rng.append([round(ratios[0], 3), round(ratios[-1], 3)])
        out[label] = {"median": med, "range": rng, "pairs": n}
    return out


_DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+), #token: (\d+),.*?(?:accept len: ([\d.]+),.*?)?"
                          r"gen throughput \(token/s\): ([\d.]+), #queue-req: (\d+)")


def log_occurrences(text):
    """A server log's decode steps by the scheduler's own clock: each "Decode batch" line covers the
    last log interval (40 steps), so its step time is running x accept len / gen throughput. Lines
    of one steady measurement run with the same batch and a growing #token; the first line of each
    (it holds the idle time and the prefill before it) is dropped. [(batch, [step ms, ...]), ...] in
    log order, measurements of fewer than 3 intervals left out."""
    out, prev = [], None
    for m in _DECODE_LINE.finditer(text):
        c, tokens, tput, queued = int(m[1]), int(m[2]), float(m[4]), int(m[5])
        if prev and prev == (c, True) and tokens > last_tokens and not queued and tput > 0:
            out[-1][1].append(1000 * c * float(m[3] or 1) / tput)
        elif not prev or prev[0] != c or tokens <= last_tokens or queued:
            out.append((c, []))
        prev, last_tokens = (c, not queued), tokens
    return [(c, steps) for c, steps in out if len(steps) >= 3]


def log_name(label):
    """The profile phase's server log of a steady label ("t0" is the server "patched")."""
    return "patched" if label == "t0" else label[:-len("-t0")] if label.endswith("-t0") else label


def log_steps(runs, rows, levels, base):
    """Per mode and level from the servers' own log intervals: the median step (ms) over every
    interval, and the per-measurement ratio to `base` (median interval of a server's k-th measurement
    at a level against the base's k-th in the same call): its median and [min, max]."""
    occ = {}
    for label, rs in rows.items():
        for run, server in sorted({(r["run"], r["server"]) for r in rs}):
            path = next((p for p in runs if os.path.basename(os.path.normpath(p)) == run), None)
            text = run_file_text(path, log_name(server) + ".log") if path else None
            for c, steps in log_occurrences(text or ""):
                if c in levels:
                    occ.setdefault(label, {}).setdefault((run, server, c), []).append(steps)
    out = {}
    for label, by in occ.items():
        med, ratio, rng = [], [], []
        for c in levels:
            mine = [s for (run, server, cc), ms in by.items() if cc == c for m in ms for s in m]
            med.append(round(statistics.median(mine), 3) if mine else None)
            pairs = []
            for (run, server, cc), ms in by.items():
                theirs = next((b for (r2, _, c2), b in occ.get(base, {}).items() if r2 == run and c2 == c), [])
                if cc == c:
                    pairs += [statistics.median(m) / statistics.median(b) for m, b in zip(ms, theirs)]
            ratio.append(round(statistics.median(pairs), 3) if pairs else None)
            rng.append([round(min(pairs), 3), round(max(pairs), 3)] if pairs else None)
        out[label] = {"step_ms": med, "paired": ratio, "range": rng}
    return out


def main():
    a, model, rows = read_runs("steady")
    levels = sorted({r["concurrency"] for rs in rows.values() for r in rs})

    def at(label, c):
        windows = [w for r in rows.get(label, []) if r["concurrency"] == c for w in r.get("step_ms_windows") or []]
        means = [r["step_ms"] for r in rows.get(label, []) if r["concurrency"] == c and r.get("step_ms")]
        return windows, means

    step_ms, spread, ratio = {}, {}, {}
    for label in sorted(rows):
        step_ms[label], spread[label], ratio[label] = [], [], []
        for c in levels:
            windows, means = at(label, c)
            mean = sum(means) / len(means) if means else None
            step_ms[label].append(round(mean, 3) if mean else None)
            spread[label].append(round(100 * (max(windows) - min(windows)) / mean, 1) if windows and mean else None)
            _, base = at(a.base, c)
            ratio[label].append(round(mean / (sum(base) / len(base)), 3) if mean and base else None)
    paired = paired_ratios(rows, levels, a.base)
    logs = log_steps(a.runs, rows, levels, a.base)
    summary = {"levels": levels, "step_ms": step_ms, "step_spread_pct": spread, "step_ratio_vs_" + a.base: ratio,
               "step_ratio_paired_vs_" + a.base: {k: v["median"] for k, v in paired.items()},
               "step_ratio_paired_range": {k: v["range"] for k, v in paired.items()},
               "step_ratio_pairs": {k: v["pairs"] for k, v in paired.items()},
               "step_ms_log": {k: v["step_ms"] for k, v in logs.items()},
               "step_ratio_log_paired_vs_" + a.base: {k: v["paired"] for k, v in logs.items()},
               "step_ratio_log_paired_range": {k: v["range"] for k, v in logs.items()},
               "model": model, "method": "steady: c requests decoding together, no prefill in the window; "
                                         "step = window / sglang:cuda_graph_passes_total delta"}
    json.dump({"version": a.version, "runs": [os.path.basename(os.path.normpath(r)) for r in a.runs],
               "summary": summary, "rows": rows}, open(a.out, "w"), indent=1)
    for label in sorted(rows):
        print(f"{label:16s} " + " ".join(f"c{c}={m}({x}; paired {pm} {pr})" for c, m, x, pm, pr in zip(
            levels, step_ms[label], ratio[label], paired[label]["median"], paired[label]["range"])))
        if label in logs:
            print(f"{'  from logs':16s} " + " ".join(f"c{c}={m}(paired {pm} {pr})" for c, m, pm, pr in zip(
                levels, logs[label]["step_ms"], logs[label]["paired"], logs[label]["range"])))


if __name__ == "__main__":
    main()
