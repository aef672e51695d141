"""The live TUI's cost and delay, run for real in tmux (a real terminal, the normal Textual driver).

  cpu/rss   the TUI process (% of one core, RSS) at 1 Hz with 1 and with 8 hosts, each host fed one
            `watch` item per second in the agent's exact shape (sglang Prometheus text, 8 GPUs of
            nvidia-smi CSV, log lines) through PushFeed, so parsing and drawing are both counted;
            the first seconds (imports, first layout) are left out
  lag       a change on the server to the screen: a real HTTP server with sglang-format /metrics,
            the real agent `watch` verb over the Local transport at --interval 1.0, the TUI in tmux;
            the batch size is changed at a random phase of the sampling and `tmux capture-pane` is
            polled every 10 ms until the new number is on the screen (so ±10 ms)

Targets: ≤ 5 % CPU and ≤ 150 MB RSS with one host, lag ≤ 1.5 s.

    /tmp/venv/bin/python benchmarks/bench_tui.py [--seconds 20] [--lag-samples 12] [--size 120x40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import psutil  # noqa: E402

# ----------------------------------------------------------------------------- the TUI processes


def child_push(hosts: int) -> None:
    """The TUI with `hosts` hosts, each fed one synthetic watch item per second (a slow load wave)."""
    from tui_harness import PushFeed, RecordingActions
    from watch_items import decode_line, item, transition_line

    from dynctl.tui.app import create_app

    names = [f"gpu{i:02d}" for i in range(hosts)]

    def feed_factory(on_update: Any) -> PushFeed:
        feed = PushFeed(names, on_update)

        def pump() -> None:
            seq, was_on = 0, {}
            next_t = time.time()
            while True:
                now = time.time()
                for k, name in enumerate(names):
                    running = 1 + int(15 * abs(((seq + 7 * k) % 60) - 30) / 30)
                    spec = running <= 5
                    marks = [transition_line(now, spec, running, 5)] if was_on.get(name, spec) != spec else []
                    was_on[name] = spec
                    feed.push_item(item(now, seq, running, log=[decode_line(now, running, running * 90.0)] + marks,
                                        marks=marks), name)
                seq += 1
                next_t += 1.0
                time.sleep(max(0.0, next_t - time.time()))

        threading.Thread(target=pump, daemon=True).start()
        return feed

    create_app(names, feed_factory, lambda name: RecordingActions(name, [])).run()


def child_live(port: int, workdir: str) -> None:
    """The TUI on one real host: LiveFeed → Local transport → the agent's watch verb → the HTTP server."""
    from dynctl.base.config import HostConfig
    from tui_harness import RecordingActions

    from dynctl.live.feed import LiveFeed
    from dynctl.tui.app import create_app

    host = HostConfig(name="bench", python=sys.executable, workdir=workdir, port=port)
    create_app(["bench"], lambda on_update: LiveFeed([host], on_update, interval=1.0),
               lambda name: RecordingActions(name, [])).run()


# ----------------------------------------------------------------------------- tmux driving


class Tmux:
    def __init__(self, tmp: Path, size: tuple[int, int]) -> None:
        self.env = dict(os.environ, TMUX_TMPDIR=str(tmp))
        self.size = size
        self.session = f"bench{os.getpid()}"

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", *args], env=self.env, capture_output=True, text=True, check=True).stdout

    def start(self, argv: list[str]) -> psutil.Process:
        """Runs `argv` (python, a script, --child…) in the pane; the script's process, once it runs."""
        script = Path(argv[1]).name
        w, h = self.size
        command = " ".join(["env", "TERM=xterm-256color", *(_q(a) for a in argv)])
        self.tmux("-f", "/dev/null", "new-session", "-d", "-s", self.session, "-x", str(w), "-y", str(h), command)
        pane = int(self.tmux("display-message", "-p", "-t", self.session, "#{pane_pid}").strip())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the pane's shell may exec python or run it as a child
            for p in [psutil.Process(pane), *psutil.Process(pane).children(recursive=True)]:
                if script in " ".join(p.cmdline()) and "--child" in " ".join(p.cmdline()):
                    return p
            time.sleep(0.05)
        raise RuntimeError("the TUI process did not start")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.session)

    def wait_for(self, text: str, timeout: float = 20.0, poll: float = 0.01) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.screen():
                return time.time()
            time.sleep(poll)
        raise RuntimeError(f"{text!r} never appeared on the screen:\n{self.screen()}")

    def stop(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.session], env=self.env, capture_output=True)


def _q(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


# ----------------------------------------------------------------------------- measurements


def measure_cpu(hosts: int, seconds: float, size: tuple[int, int], warmup: float = 4.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        tm = Tmux(Path(tmp), size)
        proc = tm.start([sys.executable, __file__, "--child-push", str(hosts)])
        try:
            tm.wait_for("tok/s")
            time.sleep(warmup)  # imports and first layout are start-up, not the steady 1 Hz cost
            t0, c0 = time.monotonic(), proc.cpu_times()
            rss_max = 0
            end = t0 + seconds
            while time.monotonic() < end:
                rss_max = max(rss_max, proc.memory_info().rss)
                time.sleep(0.5)
            t1, c1 = time.monotonic(), proc.cpu_times()
            cpu = (c1.user + c1.system - c0.user - c0.system) / (t1 - t0) * 100
            return {"hosts": hosts, "seconds": round(t1 - t0, 1), "cpu_percent": round(cpu, 2),
                    "rss_mb": round(proc.memory_info().rss / 2**20, 1), "rss_max_mb": round(rss_max / 2**20, 1)}
        finally:
            tm.stop()


def measure_lag(samples: int, size: tuple[int, int]) -> dict[str, Any]:
    from watch_server import SglangLikeServer, record_as_server

    lags: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, SglangLikeServer() as server:
        workdir = Path(tmp) / "work"
        workdir.mkdir()
        record_as_server(workdir)  # this process serves the HTTP
        tm = Tmux(Path(tmp), size)
        proc = tm.start([sys.executable, __file__, "--child-live", str(server.port), str(workdir)])
        try:
            tm.wait_for("batch    2")
            agent = next(p for p in proc.children(recursive=True) if str(workdir) in " ".join(p.cmdline()))
            a0, t0 = agent.cpu_times(), time.monotonic()
            value = 2
            for _ in range(samples):
                time.sleep(random.uniform(0.2, 1.2))  # a random phase against the 1 s sampling
                value = 9 if value == 2 else 2
                server.state["running"] = value
                changed = time.time()
                lags.append(tm.wait_for(f"batch {value:>4}") - changed)
            a1, t1 = agent.cpu_times(), time.monotonic()
            agent_cpu = (a1.user + a1.system - a0.user - a0.system) / (t1 - t0) * 100
        finally:
            tm.stop()
    ordered = sorted(lags)
    return {"samples": len(lags), "lag_median_s": round(statistics.median(ordered), 3),
            "lag_p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 3), "lag_max_s": round(ordered[-1], 3),
            "lag_min_s": round(ordered[0], 3), "agent_cpu_percent": round(agent_cpu, 2),
            "metrics_requests": server.requests.count("/metrics")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--lag-samples", type=int, default=12)
    parser.add_argument("--size", default="120x40")
    parser.add_argument("--json")
    parser.add_argument("--child-push", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-live", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_push:
        child_push(args.child_push)
        return 0
    if args.child_live:
        child_live(int(args.child_live[0]), args.child_live[1])
        return 0
    if shutil.which("tmux") is None:
        print("tmux is needed (apt-get install -y tmux)", file=sys.stderr)
        return 2
    size = tuple(int(x) for x in args.size.split("x"))
    assert len(size) == 2
    results: dict[str, Any] = {"size": args.size, "cpu_count": os.cpu_count()}
    for hosts in (1, 8):
        r = measure_cpu(hosts, args.seconds, size)  # type: ignore[arg-type]
        results[f"hosts_{hosts}"] = r
        print(f"{hosts} host(s) at 1 Hz, {args.size}: CPU {r['cpu_percent']:.1f} % of one core, "
              f"RSS {r['rss_mb']:.0f} MB (max {r['rss_max_mb']:.0f}) over {r['seconds']} s")
    lag = measure_lag(args.lag_samples, size)  # type: ignore[arg-type]
    results["lag"] = lag
    print(f"server change → screen ({lag['samples']} changes, interval 1 s): median {lag['lag_median_s']:.2f} s, "
          f"p90 {lag['lag_p90_s']:.2f} s, max {lag['lag_max_s']:.2f} s; host agent CPU {lag['agent_cpu_percent']:.1f} %")
    one = results["hosts_1"]
    ok = one["cpu_percent"] <= 5 and one["rss_max_mb"] <= 150 and lag["lag_max_s"] <= 1.5
    print("targets (≤5 % CPU, ≤150 MB with one host; lag ≤1.5 s):", "met" if ok else "NOT met")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
