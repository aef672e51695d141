"""What a deploy costs beyond the server's own restart, over SSH + pct on loopback against the demo host.

For each round: `deploy --threshold N` then `rollback` (alternating thresholds so every deploy restarts),
timed on the client. Reported per operation:
  total        client wall time, planning included
  server       the server's own part: stop (SIGTERM drain) + start→ready, as the host measured it
  overhead     total - start→ready   (target: <= 1.5 s)
  overhead_all total - stop - start→ready (dynctl's own cost: inspect, plan, validate, switch, verify)
  round trips  agent calls (each one SSH exec; a streamed follow counts once)

    /tmp/venv/bin/python benchmarks/bench_deploy.py [--rounds 3] [--time-scale 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from dynctl.core import deploy as core  # noqa: E402
from dynctl.base import events  # noqa: E402
from dynctl.cli.common import open_host  # noqa: E402
from dynctl.core.lifecycle import restart_server, server_argv  # noqa: E402
from dynctl.sim.hostsetup import prepare_demo_host  # noqa: E402
from dynctl.transport import close_all  # noqa: E402
from sglang_trees import sglang_wheel  # noqa: E402
from sshd_harness import start_fake_host  # noqa: E402


class StepClock:
    def __init__(self) -> None:
        self.steps: dict[str, float] = {}

    def __call__(self, event: events.Event) -> None:
        if isinstance(event, events.StepDone):
            self.steps[event.step] = self.steps.get(event.step, 0.0) + event.elapsed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-deploy-"))
    fh = start_fake_host(tmp / "sshd", marker=f"bench-deploy-{time.time_ns()}")
    try:
        root = fh.make_ct(129) / "demo"
        entry = prepare_demo_host(root, port=free_port(), cache_dir=sglang_wheel("0.5.9").parent,
                                  time_scale=args.time_scale)
        entry.update(ssh=fh.target, pct=129)
        config = fh.write_config(tmp / "dynctl.toml", {"box": entry}, default_host="box")
        s = open_host(None, str(config))
        restart_server(s.agent, server_argv(s.host))
        rows = []
        for i in range(args.rounds):
            for op in ("deploy", "rollback"):
                close_all()
                s = open_host(None, str(config))
                clock = StepClock()
                t0 = time.perf_counter()
                if op == "deploy":
                    plan = core.plan_deploy(s.agent, s.host, 5 + i)
                    core.deploy(s.agent, plan, clock)
                else:
                    core.rollback(s.agent, s.host, on_event=clock)
                total = time.perf_counter() - t0
                start_ready = clock.steps.get("start", 0) + clock.steps.get("ready", 0)
                stop = clock.steps.get("stop", 0)
                rows.append({"op": op, "total_s": total, "stop_s": stop, "start_ready_s": start_ready,
                             "overhead_s": total - start_ready, "overhead_all_s": total - start_ready - stop,
                             "round_trips": s.agent.round_trips})
        close_all()
        open_host(None, str(config)).agent.call("server_stop", grace=10)
    finally:
        close_all()
        fh.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'op':<9}{'total':>8}{'stop':>8}{'start→ready':>13}{'overhead':>10}{'dynctl own':>12}{'trips':>7}")
    for r in rows:
        print(f"{r['op']:<9}{r['total_s']:8.2f}{r['stop_s']:8.2f}{r['start_ready_s']:13.2f}"
              f"{r['overhead_s']:10.2f}{r['overhead_all_s']:12.2f}{r['round_trips']:7d}")
    for op in ("deploy", "rollback"):
        own = [r["overhead_all_s"] for r in rows if r["op"] == op]
        over = [r["overhead_s"] for r in rows if r["op"] == op]
        print(f"median {op}: overhead {statistics.median(over):.2f} s, dynctl's own {statistics.median(own):.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
