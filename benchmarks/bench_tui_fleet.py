"""The fleet screen's cost in a real terminal (tmux): `dynctl tui --host GROUP` with 32 hosts, each fed one
`watch` item per second in the agent's exact shape through PushFeed, the gateway read once a second.

Target: ≤ 5 % of a core at 1 Hz with 32 hosts.

    .venv/bin/python benchmarks/bench_tui_fleet.py [--hosts 32] [--seconds 20] [--size 160x45]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_tui import Tmux  # noqa: E402


def child(hosts: int) -> None:
    from tui_harness import PushFeed, RecordingActions
    from watch_items import decode_line, item

    from dynctl.tui.fleet import create_fleet_app

    names = [f"gpu{i:02d}" for i in range(hosts)]

    def feed_factory(on_update: Any) -> PushFeed:
        feed = PushFeed(names, on_update)

        def pump() -> None:
            seq, next_t = 0, time.time()
            while True:
                now = time.time()
                for k, name in enumerate(names):
                    running = 1 + int(15 * abs(((seq + 7 * k) % 60) - 30) / 30)
                    feed.push_item(item(now, seq, running, log=[decode_line(now, running, running * 90.0)]), name)
                seq += 1
                next_t += 1.0
                time.sleep(max(0.0, next_t - time.time()))

        threading.Thread(target=pump, daemon=True).start()
        return feed

    gateways = {n: {"status": "ready", "load": 3} for n in names}
    create_fleet_app("bench", names, feed_factory, lambda name: RecordingActions(name, []),
                     gateways=lambda: gateways).run()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--size", default="160x45")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    import tempfile

    size = tuple(int(x) for x in args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        tm = Tmux(Path(tmp), size)  # type: ignore[arg-type]
        try:
            proc = tm.start([sys.executable, __file__, "--child", str(args.hosts)])
            tm.wait_for("tok/s")
            time.sleep(4.0)  # imports and first layout are start-up, not the steady 1 Hz cost
            t0, c0 = time.monotonic(), proc.cpu_times()
            rss = 0
            while time.monotonic() < t0 + args.seconds:
                rss = max(rss, proc.memory_info().rss)
                time.sleep(0.5)
            t1, c1 = time.monotonic(), proc.cpu_times()
            cpu = (c1.user + c1.system - c0.user - c0.system) / (t1 - t0) * 100
        finally:
            tm.stop()
    print(f"fleet screen, {args.hosts} hosts at 1 Hz, {args.size}: CPU {cpu:.1f} % of one core, RSS max "
          f"{rss / 2**20:.0f} MB over {t1 - t0:.0f} s (target ≤ 5 %)")
    return 0 if cpu <= 5 else 1


if __name__ == "__main__":
    sys.exit(main())
