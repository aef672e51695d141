#!/usr/bin/env python3
"""Load / correctness client for an sglang server started with --skip-tokenizer-init.

Stdlib only (threads + http.client). Subcommands:
  prompts  --out F [--n 32 --vocab 32000 --seed 0]        fixed random token-id prompts (16..128 long)
  gen      --url U --prompts F --out F [--concurrency 8 --max-new-tokens 64]
           [--flip-threshold A,B --flip-every 2]             greedy outputs (temperature 0, ignore_eos);
                                                             with --flip-*, a thread alternates the
                                                             threshold through /set_internal_state
  compare  BASE.json OTHER.json ...                          first divergent position per prompt
  speed    --url U --concurrency 1,4,16,64 [--max-new-tokens 128 --duration 8 --out F]
                                                             closed-loop output tok/s per level
  score    --url U --prompts F OUT.json ...                   teacher-forced check of greedy outputs on a
                                                             (no-spec) server: for every generated token, the
                                                             gap between the top-1 logprob and the token's own
                                                             (0 = it was the greedy choice; a small gap = a
                                                             numerical near-tie; a large one = a wrong token)
  state    --url U [--set N]                                  threshold in /server_info (and set it)
  metrics  --url U                                           the sglang:spec_* lines of /metrics
"""
import argparse
import gzip
import json
import os
import random
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


# The patch's server argument and internal_states key (this script runs on the GPU box without dynctl).
THRESHOLD_KEY = "speculative_disable_batch_threshold"


def post(url, path, body, timeout=600):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(url, path, timeout=60):
    with urllib.request.urlopen(url + path, timeout=timeout) as r:
        data = r.read()
    try:
        return json.loads(data)
    except ValueError:
        return data.decode()


def generate(url, ids, max_new):
    out = post(url, "/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}})
    return out


def threshold_of(url):
    info = get(url, "/server_info")
    return [s.get(THRESHOLD_KEY, "absent") for s in info["internal_states"]]


def set_threshold(url, n):
    return post(url, "/set_internal_state", {"server_args": {THRESHOLD_KEY: n}})


def cmd_prompts(a):
    rng = random.Random(a.seed)
    ps = [[rng.randrange(3, a.vocab) for _ in range(rng.randint(16, 128))] for _ in range(a.n)]
    json.dump(ps, open(a.out, "w"))


def cmd_gen(a):
    prompts = json.load(open(a.prompts))
    stop = threading.Event()
    flips = []

    def flipper():
        vals = [int(x) for x in a.flip_threshold.split(",")]
        i = 0
        while not stop.wait(a.flip_every):
            i += 1
            v = vals[i % len(vals)]
            set_threshold(a.url, v)
            flips.append((round(time.time() - t0, 2), v, threshold_of(a.url)))

    t0 = time.time()
    th = None
    if a.flip_threshold:
        set_threshold(a.url, int(a.flip_threshold.split(",")[0]))
        th = threading.Thread(target=flipper, daemon=True)
        th.start()
    reps = max(1, a.repeat)
    n = len(prompts)
    results = [None] * (n * reps)
    metas = [None] * (n * reps)

    def one(j):
        r = generate(a.url, prompts[j % n], a.max_new_tokens)
        results[j] = r["output_ids"]
        metas[j] = {k: r["meta_info"].get(k) for k in ("completion_tokens", "spec_verify_ct",
                                                         "spec_accept_length", "e2e_latency")}

    # repeats (outputs kept in order, rep after rep) keep the load up long enough for flips
    with ThreadPoolExecutor(a.concurrency) as ex:
        list(ex.map(one, range(n * reps)))
    stop.set()
    if th:
        th.join()
    json.dump({"outputs": results, "meta": metas, "flips": flips,
               "seconds": round(time.time() - t0, 2)}, open(a.out, "w"))
    ver = [m["spec_verify_ct"] for m in metas if m and m.get("spec_verify_ct") is not None]
    print(f"gen {a.out}: {n} prompts x{reps} in {time.time() - t0:.1f}s; "
          f"flips {len(flips)}; spec_verify_ct per request {ver[:8]}")


def cmd_compare(a):
    base = json.load(open(a.files[0]))["outputs"]
    lines = []
    for f in a.files[1:]:
        other = json.load(open(f))["outputs"]
        firsts, same = [], 0
        for j, y in enumerate(other):  # a file with repeats is compared rep by rep
            x = base[j % len(base)]
            d = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
            if d is None and len(x) == len(y):
                same += 1
            else:
                firsts.append(d if d is not None else min(len(x), len(y)))
        line = (f"{f}: {same}/{len(other)} identical to {a.files[0]}; first divergent positions "
                f"{sorted(firsts)}")
        print(line)
        lines.append(line)
    return lines


def cmd_speed(a):
    prompts = json.load(open(a.prompts)) if a.prompts else None
    rng = random.Random(1)
    res = []
    generate(a.url, [5] * 32, 8)  # warm-up
    for c in [int(x) for x in a.concurrency.split(",")]:
        tokens, lat, n = [0], [], [0]
        lock = threading.Lock()
        deadline = time.time() + a.duration

        def worker(w):
            while time.time() < deadline:
                ids = prompts[rng.randrange(len(prompts))] if prompts else [rng.randrange(3, 32000)
                                                                           for _ in range(64)]
                t = time.time()
                r = generate(a.url, ids, a.max_new_tokens)
                with lock:
                    tokens[0] += r["meta_info"]["completion_tokens"]
                    lat.append(time.time() - t)
                    n[0] += 1

        t0 = time.time()
        with ThreadPoolExecutor(c) as ex:
            list(ex.map(worker, range(c)))
        el = time.time() - t0
        row = {"concurrency": c, "requests": n[0], "output_tokens": tokens[0], "seconds": round(el, 2),
               "output_tok_s": round(tokens[0] / el, 1),
               "mean_latency_s": round(sum(lat) / max(1, len(lat)), 3)}
        print(json.dumps(row), flush=True)
        res.append(row)
    if a.out:
        json.dump(res, open(a.out, "w"))
    return res


_COUNTERS = {
    "decode_tokens": ("sglang:realtime_tokens_total", 'mode="decode"'),
    "decode_steps": ("sglang:cuda_graph_passes_total", None),
    "graph_steps": ("sglang:cuda_graph_passes_total", 'mode="decode_cuda_graph"'),
    "disabled_steps": ("sglang:spec_disabled_steps_total", None),
    "running": ("sglang:num_running_reqs", None),
    "accept_length": ("sglang:spec_accept_length", None),
}


def read_metrics(url):
    """Sums of the series above from /metrics (counters are cumulative; gauges as read)."""
    text = get(url, "/metrics", timeout=30)
    out = {k: 0.0 for k in _COUNTERS}
    seen = set()
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ")[0] else (line.split(" ")[0], "", "")
        value = float(line.rsplit(" ", 1)[1])
        for key, (metric, label) in _COUNTERS.items():
            if name == metric and (label is None or label in rest):
                if key in ("running", "accept_length"):
                    if key not in seen:  # first series (TP rank 0)
                        out[key] = value
                        seen.add(key)
                else:
                    out[key] += value
    return out


def sweep_level(url, c, prompts, max_new_tokens, warmup, window, windows, rng_seed=1, logprob_every=0,
                on_measure=None):
    """Closed loop of `c` workers; after `warmup` s, `windows` back-to-back windows of `window` s each,
    measured with the server's own counters (generated tokens and decode steps per window) and the
    requests that completed in each; then the workers stop after their request in flight.
    `on_measure(start)`: called with True when the windows begin and False when they end."""
    rng = random.Random(rng_seed + c)
    stop = threading.Event()
    lock = threading.Lock()
    done = []  # (t_end, tokens, latency_s)
    errors = [0]

    def worker(w):
        r = random.Random(rng.random())
        n = 0
        while not stop.is_set():
            ids = prompts[r.randrange(len(prompts))]
            t = time.time()
            body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                           "ignore_eos": True}}
            n += 1
            if logprob_every and n % logprob_every == 0:
                body.update(return_logprob=True, top_logprobs_num=2)
            try:
                out = post(url, "/generate", body)
                toks = out["meta_info"]["completion_tokens"]
            except Exception:  # noqa: BLE001
                with lock:
                    errors[0] += 1
                continue
            with lock:
                done.append((time.time(), toks, time.time() - t))

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(c)]
    for th in threads:
        th.start()
    time.sleep(warmup)
    if on_measure:
        on_measure(True)
    marks = [(time.time(), read_metrics(url))]
    for _ in range(windows):
        time.sleep(window)
        marks.append((time.time(), read_metrics(url)))
    if on_measure:
        on_measure(False)
    stop.set()
    for th in threads:
        th.join(timeout=600)
    rows = []
    for (t0, m0), (t1, m1) in zip(marks, marks[1:]):
        dt = t1 - t0
        steps = m1["decode_steps"] - m0["decode_steps"]
        toks = m1["decode_tokens"] - m0["decode_tokens"]
        fin = [(tok, lat) for (te, tok, lat) in done if t0 <= te < t1]
        rows.append({
            "seconds": round(dt, 3),
            "decode_steps": steps,
            "tok_s": round(toks / dt, 1),
            "client_tok_s": round(sum(t for t, _ in fin) / dt, 1),
            "requests": len(fin),
            "step_ms": round(1000 * dt / steps, 3) if steps else None,
            "graph_share": round((m1["graph_steps"] - m0["graph_steps"]) / steps, 3) if steps else None,
            "spec_share": (round(1 - (m1["disabled_steps"] - m0["disabled_steps"]) / steps, 3)
                           if steps else None),
            "tokens_per_step": round(toks / steps, 2) if steps else None,
            "running": m1["running"],
            "accept_length": m1["accept_length"],
        })
    tok = [r["tok_s"] for r in rows]
    mean = sum(tok) / len(tok)
    lat = [l for (_, tk, l) in done if tk]
    toks_done = [tk for (_, tk, _l) in done if tk]
    return {
        "concurrency": c,
        "tok_s": round(mean, 1),
        "spread_pct": round(100 * (max(tok) - min(tok)) / mean, 1) if mean else None,
        "windows": rows,
        "client_tok_s": round(sum(r["client_tok_s"] for r in rows) / len(rows), 1),
        "tpot_ms": round(1000 * sum(lat) / sum(toks_done), 2) if toks_done else None,
        "errors": errors[0],
        "batch": round(sum(r["running"] for r in rows) / len(rows), 1),
        "spec_share": rows[-1]["spec_share"] if all(r["spec_share"] is not None for r in rows) else None,
        "step_ms": round(sum(r["step_ms"] or 0 for r in rows) / len(rows), 3),
        "tokens_per_step": round(sum(r["tokens_per_step"] or 0 for r in rows) / len(rows), 2),
        "accept_length": rows[-1]["accept_length"],
    }


def logprob_outputs(url, prompts, max_new_tokens, top=2, concurrency=8):
    """Greedy outputs with their logprobs and top-`top` logprobs, `concurrency` requests at a time."""
    def one(ids):
        out = post(url, "/generate", {"input_ids": ids, "return_logprob": True, "top_logprobs_num": top,
                                      "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                          "ignore_eos": True}})
        meta = out["meta_info"]
        return {"ids": [t[1] for t in meta["output_token_logprobs"]],
                "logprobs": [t[0] for t in meta["output_token_logprobs"]],
                "top": [[(v, i) for v, i, *_ in (row or [])] for row in meta["output_top_logprobs"]]}
    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(one, prompts))


def compare_logprobs(base, other):
    """Where two sets of logprob outputs differ: tokens, and the largest logprob gap on common tokens."""
    same_tokens, gap, n = 0, 0.0, 0
    for a, b in zip(base, other):
        k = 0
        while k < min(len(a["ids"]), len(b["ids"])) and a["ids"][k] == b["ids"][k]:
            gap = max(gap, abs(a["logprobs"][k] - b["logprobs"][k]),
                      max((abs(x[0] - y[0]) for x, y in zip(a["top"][k], b["top"][k])), default=0.0))
            k += 1
            n += 1
        same_tokens += k == len(a["ids"]) == len(b["ids"])
    return {"outputs": len(base), "identical_token_outputs": same_tokens, "tokens_compared": n,
            "max_logprob_gap": round(gap, 4)}


def trace_steps(url, out_dir, steps, prefix=None):
    """sglang's torch profiler (CPU and GPU) over the server's next `steps` forward steps; the trace's
    path once written whole, or None after a minute."""
    before = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    req = urllib.request.Request(url + "/start_profile", method="POST", data=json.dumps({
        "output_dir": out_dir, "num_steps": steps, "activities": ["CPU", "GPU"],
        "profile_prefix": prefix}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # answers in plain text
        r.read()
    traced = None
    deadline = time.time() + 60
    while time.time() < deadline and traced is None:
        new = [f for f in (os.listdir(out_dir) if os.path.isdir(out_dir) else [])
               if f not in before and f.endswith(".json.gz")]
        traced = os.path.join(out_dir, new[0]) if new else None
        time.sleep(0.1)
    while traced and time.time() < deadline:  # the export has finished once the gzip stream is whole
        try:
            with gzip.open(traced, "rb") as f:
                while f.read(1 << 20):
                    pass
            break
        except (EOFError, OSError):
            time.sleep(0.2)
    return traced


def steady_level(url, c, max_new_tokens, window, windows=3, prompt_len=16, vocab=32000, seed=7, profile=None,
                 sample=None, logprob_every=0):
    """Step cost at a fixed batch: `c` requests sent together, measured once all of them decode.

    No request joins or leaves during the window (no prefill interleaved), so the servers' own
    counters give the time of one decode step at batch size c: window / decode steps, per each of
    `windows` back-to-back parts (the spread is theirs). With `sample` (py-spy's argv, the
    scheduler's pid, seconds, rate, out), py-spy then samples the scheduler's Python stacks. With
    `profile` = {"dir": D, "steps": K}, sglang's torch profiler then records K steps of the same
    batch (CPU and GPU activity) into D. Every request runs to its length; returns the row.
    """
    rng = random.Random(seed + c)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(c)]
    errors = [0]

    def one(i):
        body = {"input_ids": prompts[i], "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                              "ignore_eos": True}}
        if logprob_every and i % logprob_every == 0:
            body.update(return_logprob=True, top_logprobs_num=2)
        try:
            post(url, "/generate", body)
        except Exception:  # noqa: BLE001
            errors[0] += 1

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(c)]
    t_start = time.time()
    for th in threads:
        th.start()
    m = read_metrics(url)
    while m["running"] < c and time.time() - t_start < 60:
        time.sleep(0.02)
        m = read_metrics(url)
    time.sleep(0.05)  # the last prefill's step out of the window
    marks = [(time.time(), read_metrics(url))]
    for _ in range(windows):
        time.sleep(window / windows)
        marks.append((time.time(), read_metrics(url)))
    (t0, m0), (t1, m1) = marks[0], marks[-1]
    per_window = [1000 * (tb - ta) / (mb["decode_steps"] - ma["decode_steps"])
                  for (ta, ma), (tb, mb) in zip(marks, marks[1:]) if mb["decode_steps"] > ma["decode_steps"]]
    sampled = None
    if sample:
        # Python stacks of the scheduler process at sample["rate"] Hz while the same batch decodes;
        # the steps decoded meanwhile normalise the samples to one step.
        s0 = read_metrics(url)["decode_steps"]
        r = subprocess.run(sample["argv"] + ["--duration", str(max(1, round(sample["seconds"]))), "--rate", str(sample["rate"]),
                                             "--format", "raw", "--nonblocking", "--output", sample["out"],
                                             "--pid", str(sample["pid"])], capture_output=True, text=True)
        sampled = {"out": sample["out"] if r.returncode == 0 else None, "rc": r.returncode,
                   "steps": int(read_metrics(url)["decode_steps"] - s0), "err": r.stderr[-400:]}
    traced = trace_steps(url, profile["dir"], profile["steps"], profile.get("prefix")) if profile else None
    running_end = read_metrics(url)["running"]
    deadline = time.time() + 120  # a server that stops answering costs this level, not the call
    for th in threads:
        th.join(timeout=max(0.1, deadline - time.time()))
    steps = m1["decode_steps"] - m0["decode_steps"]
    toks = m1["decode_tokens"] - m0["decode_tokens"]
    dt = t1 - t0
    return {
        "concurrency": c,
        "seconds": round(dt, 3),
        "steps": int(steps),
        "step_ms": round(1000 * dt / steps, 4) if steps else None,
        "step_ms_windows": [round(x, 4) for x in per_window],
        "spread_pct": (round(100 * (max(per_window) - min(per_window)) / (sum(per_window) / len(per_window)), 1)
                       if per_window else None),
        "tok_s": round(toks / dt, 1),
        "tokens_per_step": round(toks / steps, 3) if steps else None,
        "graph_share": round((m1["graph_steps"] - m0["graph_steps"]) / steps, 3) if steps else None,
        "spec_share": round(1 - (m1["disabled_steps"] - m0["disabled_steps"]) / steps, 3) if steps else None,
        "running": [m0["running"], m1["running"]],
        "running_after_profile": running_end,
        "errors": errors[0],
        "trace": traced,
        "sampled": sampled,
    }


def cmd_sweep(a):
    prompts = json.load(open(a.prompts))
    generate(a.url, prompts[0], 8)  # warm-up
    res = []
    for c in [int(x) for x in str(a.concurrency).split(",")]:
        row = sweep_level(a.url, c, prompts, a.max_new_tokens, a.warmup, a.window, a.windows,
                          logprob_every=a.logprob_every)
        print(json.dumps({k: v for k, v in row.items() if k != "windows"}), flush=True)
        res.append(row)
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)
    return res


def score_one(url, prompt, out):
    ids = prompt + out
    r = post(url, "/generate", {"input_ids": ids, "return_logprob": True,
                                "logprob_start_len": len(prompt) - 1, "top_logprobs_num": 1,
                                "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
    mi = r["meta_info"]
    tok, top = mi["input_token_logprobs"], mi["input_top_logprobs"]
    # align: entry k is the logprob of ids[start + k]; take the start whose token ids match
    n = len(tok)
    start = None
    for cand in (len(prompt) - 1, len(ids) - n, len(prompt)):
        if all(t is None or t[1] == ids[cand + k] for k, t in enumerate(tok) if cand + k < len(ids)):
            start = cand
            break
    if start is None:
        raise RuntimeError(f"cannot align {n} input logprobs with {len(ids)} ids")
    gaps = []
    for k in range(n):
        pos = start + k - len(prompt)  # index into `out`
        if pos < 0 or tok[k] is None or tok[k][0] is None or not top[k]:
            continue
        gaps.append((pos, top[k][0][0] - tok[k][0], top[k][0][1] == ids[start + k]))
    return gaps


def cmd_score(a):
    prompts = json.load(open(a.prompts))
    rows = []
    for f in a.files:
        outs = json.load(open(f))["outputs"]
        with ThreadPoolExecutor(8) as ex:
            res = list(ex.map(lambda j: score_one(a.url, prompts[j % len(prompts)], outs[j]),
                              range(len(outs))))
        allg = [g for r in res for g in r]
        off = [(j, p, round(g, 4)) for j, r in enumerate(res) for (p, g, top1) in r if not top1]
        row = {"file": os.path.basename(f), "tokens": len(allg), "not_top1": len(off),
               "max_gap": round(max((g for _, g, _ in allg), default=0.0), 4),
               "gaps_not_top1": sorted((g for _, _, g in off), reverse=True)[:12]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        json.dump(rows, open(a.out, "w"))
    return rows


def cmd_state(a):
    if a.set is not None:
        print("set ->", json.dumps(set_threshold(a.url, a.set))[:200])
    print("internal_states threshold:", threshold_of(a.url))


def cmd_metrics(a):
    m = get(a.url, "/metrics")
    for line in m.splitlines():
        if "spec_" in line or "decode_none" in line:
            print(line)


class Args(argparse.Namespace):
    """Call the subcommands from Python: client.cmd_gen(client.Args(url=..., ...))."""

    defaults = dict(concurrency=8, max_new_tokens=64, repeat=1, flip_threshold=None, flip_every=2.0,
                    duration=8.0, prompts=None, out=None, set=None, n=32, vocab=32000, seed=0,
                    warmup=1.5, window=1.5, windows=3, logprob_every=0)

    def __init__(self, **kw):
        super().__init__(**{**self.defaults, **kw})


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts"); p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=32); p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("gen"); p.add_argument("--url", required=True); p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True); p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64); p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--flip-threshold", default=None); p.add_argument("--flip-every", type=float, default=2.0)
    p = sub.add_parser("compare"); p.add_argument("files", nargs="+")
    p = sub.add_parser("speed"); p.add_argument("--url", required=True)
    p.add_argument("--concurrency", default="1,4,16,64"); p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--duration", type=float, default=8.0); p.add_argument("--prompts", default=None)
    p.add_argument("--out", default=None)
    p = sub.add_parser("sweep"); p.add_argument("--url", required=True); p.add_argument("--prompts", required=True)
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--max-new-tokens", type=int, default=128); p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--window", type=float, default=1.5); p.add_argument("--windows", type=int, default=3)
    p.add_argument("--logprob-every", type=int, default=0); p.add_argument("--out", default=None)
    p = sub.add_parser("score"); p.add_argument("--url", required=True); p.add_argument("--prompts", required=True)
    p.add_argument("--out", default=None); p.add_argument("files", nargs="+")
    p = sub.add_parser("state"); p.add_argument("--url", required=True); p.add_argument("--set", type=int, default=None)
    p = sub.add_parser("metrics"); p.add_argument("--url", required=True)
    a = ap.parse_args()
    globals()["cmd_" + a.cmd](a)


if __name__ == "__main__":
    main()
