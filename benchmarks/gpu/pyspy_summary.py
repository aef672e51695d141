#!/usr/bin/env python3
"""Where a decode step's CPU time goes: py-spy's raw (folded) samples of a scheduler, per step.

The profile phase (`device/phase.py profile`, `PYSPY_LEVELS`) samples the scheduler process of each
server at 1 kHz for one second while a fixed batch decodes, and records how many decode steps ran
meanwhile. Samples are CPU time (py-spy leaves out a thread's idle samples, so time blocked in a
synchronisation is not counted). This script turns a run's `pyspy-<label>-c<N>.txt` files into
microseconds of CPU per decode step; the closed loop's files (`pyspy-closed-<label>-c<N>.txt`, round 0
of each level, prefills mixed in) count the decode steps of the seconds sampled, and are compared with
`closed-<base>`:

  pyspy_summary.py RESULTS_DIR [--base nospec] [--top 18] [--json OUT] [--children FUNC ...]

- `inclusive`: per function (`Class.method (file)`), the CPU time of the samples with it on the stack;
- `self`: the leaf frames' time;
- for every label against `--base`: the inclusive functions whose time differs most;
- with `--children Scheduler.run_batch`: per file, the time of each function that FUNC calls;
- with `--lines FUNC`: per source line of FUNC (and the function that line calls), its time;
- with `--busy`: samples inside `Event.synchronize` left out, so that what remains is the host's work
  per step and not its wait for the GPU (the two servers' busy time differs by what the step costs
  when the host bounds it).
"""
import argparse
import glob
import json
import os
import re
from collections import defaultdict

RATE_HZ = 1000


def frames(raw):
    """['a (f.py:1)', 'b (g.py:2)'] -> ['a (f.py)', 'b (g.py)'] (line numbers dropped so a function is one row)."""
    return [re.sub(r":\d+\)$", ")", f) for f in raw]


WAIT = "Event.synchronize (torch/cuda/streams.py)"


def stacks(path, busy=False):
    """(frames with their line numbers, count) per line of a raw py-spy file; with `busy`, without the
    samples that wait in Event.synchronize."""
    for line in open(path, errors="replace"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            raw = [f for f in stack.split(";") if f]
            if not (busy and WAIT in frames(raw)):
                yield raw, int(count)


def load(path, busy=False):
    return [(frames(raw), n) for raw, n in stacks(path, busy)]


def lines(path, steps, func, busy=False):
    """CPU per step of each source line of `func` ('Class.method'), keyed 'LINE -> callee'."""
    us = 1e6 / RATE_HZ / max(1, steps)
    out = defaultdict(float)
    for raw, n in stacks(path, busy):
        for i, f in enumerate(raw):
            if f.startswith(func + " "):
                at = re.search(r":(\d+)\)$", f)
                callee = raw[i + 1].split(" (")[0] if i + 1 < len(raw) else "<self>"
                out[f"{at.group(1) if at else '?'} -> {callee}"] += n * us
                break
    return dict(out)


def per_step(samples, steps):
    us = 1e6 / RATE_HZ / max(1, steps)
    incl, leaf = defaultdict(float), defaultdict(float)
    total = 0
    for fr, n in samples:
        total += n
        for f in set(fr):
            incl[f] += n * us
        if fr:
            leaf[fr[-1]] += n * us
    return {"cpu_us_per_step": round(total * us, 1), "inclusive": dict(incl), "self": dict(leaf)}


def children(samples, steps, parent):
    """CPU per step of each frame called directly by `parent` ('<self>' for parent's own lines)."""
    us = 1e6 / RATE_HZ / max(1, steps)
    out = defaultdict(float)
    for fr, n in samples:
        for i, f in enumerate(fr):
            if f.startswith(parent):
                out[fr[i + 1] if i + 1 < len(fr) else "<self>"] += n * us
                break
    return dict(out)


def closed_steps(row):
    """Decode steps in the seconds py-spy sampled a closed-loop level: its first window's steps (the
    servers' counter; from the window's length and step time in rows without the count), scaled to
    the sampled seconds, which start with the first window."""
    w = (row.get("windows") or [{}])[0]
    n = w.get("decode_steps")
    if n is None and w.get("step_ms"):
        n = 1000 * w["seconds"] / w["step_ms"]
    if not n or not w.get("seconds"):
        return 0
    seconds = (row.get("sampled") or {}).get("seconds", w["seconds"])
    return round(n * seconds / w["seconds"])


def sampled_steps(results):
    """{py-spy file name: decode steps it covers}: steady levels record theirs; closed-loop levels sample
    in round 0 (`pyspy-closed-<label>-c<N>.txt`)."""
    steps = {}
    for f in glob.glob(os.path.join(results, "steady-*.json")):
        for row in json.load(open(f)):
            s = row.get("sampled") or {}
            if s.get("out"):
                steps[os.path.basename(s["out"])] = s["steps"]
    for f in glob.glob(os.path.join(results, "closed-*.json")):
        if f.endswith("-profile-summary.json"):
            continue
        for row in json.load(open(f)):
            if not row.get("round") and row.get("label"):
                name = os.path.basename((row.get("sampled") or {}).get("out")
                                        or f"pyspy-closed-{row['label']}-c{row['concurrency']}.txt")
                steps[name] = closed_steps(row)
    return steps


def base_of(label, base):
    """The mode a label is compared with: a closed-loop file with the closed loop's file of `base`."""
    if label.startswith("closed-") and not base.startswith("closed-"):
        return "closed-" + base
    return base


def rounded(table, top):
    return {k: round(v, 1) for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:top]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--base", default="nospec")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--json")
    ap.add_argument("--children", nargs="*", default=[])
    ap.add_argument("--lines", nargs="*", default=[])
    ap.add_argument("--busy", action="store_true")
    a = ap.parse_args()
    steps = sampled_steps(a.results)
    out = {}
    for path in sorted(glob.glob(os.path.join(a.results, "pyspy-*-c*.txt"))):
        name = os.path.basename(path)
        label, c = re.match(r"pyspy-(.+)-c(\d+)\.txt$", name).groups()
        samples = load(path, a.busy)
        prof = per_step(samples, steps.get(name, 0))
        prof["steps_sampled"] = steps.get(name, 0)
        prof["children"] = {f: rounded(children(samples, steps.get(name, 0), f), a.top) for f in a.children}
        prof["lines"] = {f: rounded(lines(path, steps.get(name, 0), f, a.busy), a.top) for f in a.lines}
        out.setdefault(c, {})[label] = prof
    report = {}
    for c, labels in sorted(out.items(), key=lambda kv: int(kv[0])):
        level = {}
        for label, prof in labels.items():
            base_label = base_of(label, a.base)
            base = labels.get(base_label)
            row = {"cpu_us_per_step": prof["cpu_us_per_step"], "steps_sampled": prof["steps_sampled"],
                   "inclusive": rounded(prof["inclusive"], a.top), "self": rounded(prof["self"], a.top),
                   "children": prof["children"], "lines": prof["lines"]}
            if base is not None and label != base_label:
                names = set(prof["inclusive"]) | set(base["inclusive"])
                d = {n: prof["inclusive"].get(n, 0.0) - base["inclusive"].get(n, 0.0) for n in names}
                row["vs_" + base_label] = {k: round(v, 1) for k, v in sorted(d.items(), key=lambda kv: -abs(kv[1]))[:a.top]}
            level[label] = row
        report["c" + c] = level
    text = json.dumps(report, indent=1)
    if a.json:
        open(a.json, "w").write(text + "\n")
    for c, level in report.items():
        for label, row in level.items():
            print(f"{c} {label}: {row['cpu_us_per_step']} us of scheduler CPU per step ({row['steps_sampled']} steps)")
            for k, v in list(row.get("vs_" + base_of(label, a.base), {}).items())[:10]:
                print(f"    {v:+8.1f} us  {k}")
            for f, kids in row["children"].items():
                print(f"    in {f}: " + ", ".join(f"{k.split(' (')[0]} {v}" for k, v in list(kids.items())[:8]))
            for f, at in row["lines"].items():
                print(f"    lines of {f}: " + ", ".join(f"{k} {v}" for k, v in list(at.items())[:8]))


if __name__ == "__main__":
    main()
