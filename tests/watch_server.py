"""A tiny real HTTP server on 127.0.0.1 that answers /metrics and /server_info the way sglang 0.5.9 does,
plus a fake `nvidia-smi` for the GPU-less box: the fixtures of the watch-verb tests and the lag benchmark.

Only the formats are sglang's and nvidia-smi's; the values are whatever the test sets in `state`.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from watch_items import metrics_text

# /metrics also carries histograms, whose buckets the agent must drop (tokenizer_manager metrics).
_HISTOGRAM = (
    "# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.\n"
    "# TYPE sglang:time_to_first_token_seconds histogram\n"
    'sglang:time_to_first_token_seconds_sum{model_name="glm-5"} 1.5\n'
    'sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="glm-5"} 0.0\n'
    'sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="glm-5"} 3.0\n'
    'sglang:time_to_first_token_seconds_count{model_name="glm-5"} 3.0\n'
    "# HELP python_gc_objects_collected_total Objects collected during gc\n"
    "# TYPE python_gc_objects_collected_total counter\n"
    'python_gc_objects_collected_total{generation="0"} 123.0\n'
)


class SglangLikeServer:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {"running": 2, "threshold": 5, "spec": True, "tps": 190.0,
                                      "version": "0.5.9", "metrics_delay": 0.0, "metrics_status": 200,
                                      "loads": None,  # None: no /v1/loads (before 0.5.8); else the live batch
                                      "info_delay": 0.0}
        self.requests: list[str] = []
        # cleared: /server_info is held unanswered until it is set again (a scheduler stuck in a long step)
        self.info_answers = threading.Event()
        self.info_answers.set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep the test output clean
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.requests.append(self.path)
                s = outer.state
                if self.path == "/metrics":
                    if s["metrics_delay"]:
                        time.sleep(s["metrics_delay"])
                    if s["metrics_status"] != 200:
                        self._send(s["metrics_status"], b"Not Found", "text/plain")
                        return
                    body = metrics_text(s["running"], threshold=s["threshold"], spec=s["spec"], tps=s["tps"]) + _HISTOGRAM
                    self._send(200, body.encode(), "text/plain; version=0.0.4; charset=utf-8")
                elif self.path == "/v1/loads?include=core" and s["loads"] is not None:
                    # entrypoints/v1_loads.py get_loads: per-DP core metrics read from the scheduler now
                    running, waiting = s["loads"]
                    load = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                            "num_used_tokens": 100 * running, "max_total_num_tokens": 800000,
                            "token_usage": 100 * running / 800000, "gen_throughput": s["tps"],
                            "cache_hit_rate": 0.0, "utilization": 0.0, "max_running_requests": 256,
                            "num_total_reqs": running + waiting}
                    body = {"timestamp": "2026-11-29T12:00:00+00:00", "version": s["version"], "dp_rank_count": 1,
                            "loads": [load], "aggregate": {}}
                    self._send(200, json.dumps(body).encode(), "application/json")
                elif self.path == "/server_info":
                    outer.info_answers.wait()
                    if s["info_delay"]:  # the slowness under test: an answer that comes, late
                        time.sleep(s["info_delay"])
                    info = {"version": s["version"], "model_path": "/models/glm-5", "tp_size": 8,
                            "speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                            "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
                            "speculative_disable_batch_threshold": 5, "disable_overlap_schedule": False,
                            "huge_unrelated_field": "x" * 1000,
                            "internal_states": [{"speculative_disable_batch_threshold": s["threshold"],
                                                 "avg_spec_accept_length": 2.6, "last_gen_throughput": s["tps"],
                                                 "memory_usage": {"weight": 70.1}}]}
                    self._send(200, json.dumps(info).encode(), "application/json")
                else:
                    self._send(404, b'{"detail":"Not Found"}', "application/json")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                # the agent hangs up on a slow answer by design; that is not an error worth a traceback
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> SglangLikeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.info_answers.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def record_as_server(workdir: Path, pid: int | None = None, **extra: Any) -> dict[str, Any]:
    """Write workdir/server.json the way `dynctl start` does for `pid` (default: this process, which serves
    the HTTP), so the agent decides the listener is ours; returns the record."""
    pid = os.getpid() if pid is None else pid
    with open(f"/proc/{pid}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0") if a]
    record = {"pid": pid, "pid_start": start, "argv": argv, "marker": None, **extra}
    (workdir / "server.json").write_text(json.dumps(record))
    return record


# Prints what `nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits -lms N` prints: one
# line per GPU per period in index order (as measured on an H200 with
# driver 580.159.04). Values come from a JSON file the test rewrites; its pid goes to `<state>.pid`.
_FAKE_NVIDIA_SMI = r'''#!{python}
import json, os, sys, time
state_path = {state!r}
with open(state_path + ".pid", "w") as f:
    f.write("%d %d" % (os.getpid(), os.getppid()))
args = sys.argv[1:]
query = next(a.split("=", 1)[1] for a in args if a.startswith("--query-gpu="))
loop_ms = int(args[args.index("-lms") + 1]) if "-lms" in args else None
while True:
    with open(state_path) as f:
        gpus = json.load(f)
    now = time.time()
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)) + ".%03d" % (now % 1 * 1000)
    for i, g in enumerate(gpus):
        values = {{"timestamp": stamp, "index": str(i), "uuid": "GPU-%08x-0000" % i, "name": "NVIDIA H200",
                  "utilization.gpu": str(g["util"]), "memory.used": str(g["used"]), "memory.total": "143771",
                  "count": str(len(gpus))}}
        sys.stdout.write(", ".join(values[q] for q in query.split(",")) + "\n")
    sys.stdout.flush()
    if loop_ms is None:
        break
    time.sleep(loop_ms / 1000.0)
'''


def install_fake_nvidia_smi(bindir: Path, gpus: list[dict[str, Any]]) -> Path:
    """Write the fake into `bindir` and its state next to it; return the state file (rewrite it to change GPUs)."""
    bindir.mkdir(parents=True, exist_ok=True)
    state = bindir / "gpus.json"
    state.write_text(json.dumps(gpus))
    exe = bindir / "nvidia-smi"
    exe.write_text(_FAKE_NVIDIA_SMI.format(python=sys.executable, state=str(state)))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return state


def path_with(bindir: Path) -> str:
    return f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
