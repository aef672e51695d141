"""Where should `dynctl bench`'s load generator run? Measures the same generator three ways.

  direct   in this process, straight to the server's port (the ground truth: no SSH in the path)
  agent    on the host, as the agent's `bench_level` verb over a real SSH connection (what dynctl does)
  forward  in this process, through `tests/ssh_tunnel.forward_local` (one direct-tcpip channel per stream)

The server is a separate process: the simulated SGLang host (`--server sim`, needs an sglang tree, see
--sim-tree) or the tests' TokenServer (`--server token`, fixed per-token interval). The SSH server is a
real OpenSSH sshd on loopback (tests/sshd_harness.py). CPU is getrusage of the process that runs the
generator (for `agent`, reported by the agent itself; `client_cpu_pct` is then this process's share).

Measured here (2 vCPU, loopback, Python 3.11), 256 streams:
  token server, 5,000 tok/s   direct 7.3 % CPU | agent 7.4 % host + 0.1 % client | forward 58 % client,
                              81 of ~2,000 requests failed (forwarder: select() on fds >= 1024)
  sim --time-scale 1 with the seed-calibrated cost model of the first release, ~380 tok/s (EAGLE-3):
                              agent 0.8 % host + 0.1 % client | forward 4.6 %, 98 failed (the simulator now
                              follows the H200 table: README "Measured" has the generator's cost there)
  concurrency 1, 12 ms/token: TTFT and ITL equal within 0.2 ms on all three paths (loopback has no RTT)

    /tmp/venv/bin/python benchmarks/bench_loadgen.py --server token --levels 1,256 --duration 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from ssh_tunnel import forward_local  # noqa: E402
from sshd_harness import start_fake_host  # noqa: E402

from dynctl.agent.client import AgentClient  # noqa: E402
from dynctl.bench.stats import summarize_level  # noqa: E402
from dynctl.base.config import HostConfig  # noqa: E402


def load_agent_module():
    sys.path.insert(0, str(ROOT / "remote"))
    from dynctl_agent import loadgen

    return loadgen


def cpu_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def start_token_server(interval: float) -> tuple[subprocess.Popen, int]:
    code = (
        "import sys,time; sys.path.insert(0,%r); from test_bench_server import TokenServer\n"
        "s=TokenServer(interval=float(sys.argv[1])).start(); print(s.port, flush=True)\n"
        "sys.stdin.read()\n" % str(ROOT / "tests")
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(interval)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc, port


def start_sim(tree: str, time_scale: float) -> tuple[subprocess.Popen, int]:
    from sshd_harness import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, str(ROOT)]), SGLANG_ENABLE_SPEC_V2="1")
    argv = [sys.executable, "-m", "dynctl.sim", "--time-scale", str(time_scale), "--sim-load-seconds", "0",
            "--model-path", "/models/sim", "--port", str(port), "--enable-metrics", "--max-running-requests", "256",
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/models/sim-eagle3",
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    import urllib.request

    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1).read()
            return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the simulated server did not come up")


def run_inprocess(agent_mod, port: int, level_kw: dict) -> tuple[dict, float, float]:
    cpu0, t0 = cpu_self(), time.monotonic()

    async def go():
        level = agent_mod.Level("127.0.0.1", port, None, level_kw["concurrency"], level_kw["input_len"],
                                      level_kw["output_len"], level_kw["duration"], None, level_kw["warmup"],
                                      0, 0.5, 300.0, 3600.0)
        await level.run()
        return level.result(0.0)

    raw = asyncio.run(go())
    wall = time.monotonic() - t0
    return raw, cpu_self() - cpu0, wall


def summarize(raw: dict, input_len: int) -> dict:
    return summarize_level(raw, input_len=input_len, duration_mode=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("token", "sim"), default="token")
    ap.add_argument("--sim-tree", help="a directory holding an unpacked sglang package (for --server sim)")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--interval", type=float, default=0.012, help="token server: seconds per token per stream")
    ap.add_argument("--levels", default="1,256")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--variants", default="direct,agent,forward")
    args = ap.parse_args()

    if args.server == "sim":
        if not args.sim_tree:
            ap.error("--server sim needs --sim-tree")
        server, port = start_sim(args.sim_tree, args.time_scale)
    else:
        server, port = start_token_server(args.interval)
    tmp = Path(tempfile.mkdtemp(prefix="bench-loadgen-"))
    fake = start_fake_host(tmp / "sshd")
    agent_mod = load_agent_module()
    rows = []
    try:
        ssh = fake.ssh()
        host = HostConfig(name="bench", port=port, python=sys.executable, workdir=str(tmp / "work"))
        agent = AgentClient(ssh, host)
        agent.call("ping")
        for c in [int(x) for x in args.levels.split(",")]:
            kw = {"concurrency": c, "input_len": args.input_len, "output_len": args.output_len,
                  "duration": args.duration, "warmup": c}
            for variant in args.variants.split(","):
                if variant == "direct":
                    raw, gen_cpu, wall = run_inprocess(agent_mod, port, kw)
                    client_cpu = gen_cpu
                elif variant == "forward":
                    with forward_local(ssh, "127.0.0.1", port) as (_, fport):
                        raw, gen_cpu, wall = run_inprocess(agent_mod, fport, kw)
                    client_cpu = gen_cpu  # generator + forwarder threads + paramiko, one process
                else:
                    cpu0, t0 = cpu_self(), time.monotonic()
                    raw = None
                    for item in agent.stream("bench_level", **kw):
                        if item.get("event") == "level":
                            raw = item
                    wall = time.monotonic() - t0
                    client_cpu = cpu_self() - cpu0
                    gen_cpu = raw["loadgen"]["cpu_s"]
                lv = summarize(raw, args.input_len)
                rows.append({
                    "variant": variant, "concurrency": c, "tok_s": round(lv["output_throughput"], 1),
                    "mean_ttft_ms": round(lv["mean_ttft_ms"], 2), "p99_ttft_ms": round(lv["p99_ttft_ms"], 2),
                    "mean_itl_ms": round(lv["mean_itl_ms"], 2), "p99_itl_ms": round(lv["p99_itl_ms"], 2),
                    "failed": lv["failed"], "loadgen_cpu_pct": round(100 * gen_cpu / wall, 1),
                    "client_cpu_pct": round(100 * client_cpu / wall, 1),
                })
                print(json.dumps(rows[-1]), flush=True)
    finally:
        fake.stop()
        server.terminate()
        server.wait(10)
    cols = list(rows[0])
    print("\n" + " | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[k]) for k in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
