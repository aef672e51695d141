"""A small real HTTP server shaped like sglang's launcher, for lifecycle tests.

Serves /health, /health_generate and /generate on 127.0.0.1:PORT, spawns children like sglang's
schedulers (optional), and has switches for the ways a real server goes wrong:
  --ignore-sigterm   SIGTERM does nothing (stop must escalate to SIGKILL)
  --crash-after S    raise after S seconds of "loading" (a Traceback in the log, exit 1)
  --hang             never becomes ready (health answers 503 forever)
  --children         spawn a plain child and one that setsid()s away (neither dies with us)
  --orphan-port      spawn a child that inherits the listening socket, leaves the session and
                     outlives us, so the port stays held after we exit
  --gpu-dir DIR      "hold GPU memory" as far as tests/servers/bin/nvidia-smi is concerned
  --cuda-mib N       hold N MiB of real GPU memory (torch, else cudaMalloc through libcudart)
  --cuda-child N     spawn a plain child that holds N MiB of GPU memory and ignores SIGTERM,
                     like a scheduler that outlives its parent (sglang#23627)
Unlike sglang, it does NOT kill its children on exit: it models the leak the sweep must clean up.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLEEPER = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(60)\n"


def log(msg: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stdout.write(f"[{stamp}] {msg}\n")
    sys.stdout.flush()


class State:
    ready = False
    draining = False
    tokens = 4


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, status: int, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path in ("/health", "/health_generate"):
            ok = State.ready and not State.draining
            self._send(200 if ok else 503, {})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path != "/generate":
            self._send(404, {"error": "not found"})
        elif not State.ready:
            self._send(503, {"error": "not ready"})
        else:
            n = min(State.tokens, int((body.get("sampling_params") or {}).get("max_new_tokens", 16)))
            self._send(200, {"text": " world" * n, "meta_info": {"completion_tokens": n}})

    def log_message(self, fmt: str, *args: object) -> None:
        log("INFO: " + fmt % args)


def hold_gpu_memory(mib: int) -> object:
    """Allocate and touch `mib` MiB on the first GPU; the returned handle keeps it allocated."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        buf = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
        buf.fill_(1)
        torch.cuda.synchronize()
        return buf
    import ctypes
    import ctypes.util

    for name in (ctypes.util.find_library("cudart"), "libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            lib = ctypes.CDLL(name) if name else None
        except OSError:
            continue
        if lib is not None:
            ptr = ctypes.c_void_p()
            rc = lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(mib << 20))
            if rc != 0:
                raise RuntimeError(f"cudaMalloc({mib} MiB) failed with error {rc}")
            return ptr
    raise RuntimeError("neither torch nor libcudart is available to allocate GPU memory")


def spawn_children(orphan_sock: socket.socket | None, children: bool) -> None:
    if children:
        plain = subprocess.Popen([sys.executable, "-c", SLEEPER])
        away = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
        log(f"children: plain={plain.pid} setsid={away.pid}")
    if orphan_sock is not None:
        fd = orphan_sock.fileno()
        holder = subprocess.Popen([sys.executable, "-c", SLEEPER, "port-holder"], pass_fds=(fd,),
                                  start_new_session=True)
        log(f"children: port-holder={holder.pid} (inherits fd {fd})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--start-delay", type=float, default=0.2)
    ap.add_argument("--drain", type=float, default=0.1)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--ignore-sigterm", action="store_true")
    ap.add_argument("--crash-after", type=float, default=None)
    ap.add_argument("--optional-traceback", action="store_true",
                    help="log a Traceback for an optional feature during start, then serve (as sglang does "
                         "when openai_harmony is missing)")
    ap.add_argument("--hang", action="store_true")
    ap.add_argument("--children", action="store_true")
    ap.add_argument("--orphan-port", action="store_true")
    ap.add_argument("--enable-metrics", action="store_true")
    ap.add_argument("--gpu-dir", default=None)
    ap.add_argument("--cuda-mib", type=int, default=0)
    ap.add_argument("--cuda-child", type=int, default=0)
    ap.add_argument("--hold-gpu-only", type=int, default=0, help=argparse.SUPPRESS)
    args, unknown = ap.parse_known_args(argv)
    if args.hold_gpu_only:  # the --cuda-child process
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _held = hold_gpu_memory(args.hold_gpu_only)  # noqa: F841 - keeps the memory allocated
        while True:
            time.sleep(60)
    State.tokens = args.tokens
    log(f"server_args: port={args.port} extra={unknown}")
    if args.gpu_dir:
        with open(os.path.join(args.gpu_dir, f"{os.getpid()}.pid"), "w") as f:
            f.write(str(os.getpid()))

    stop_at: list[float] = []

    def on_term(signum: int, frame: object) -> None:
        log("SIGTERM received, draining")
        State.draining = True
        stop_at.append(time.monotonic() + args.drain)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else on_term)

    held = hold_gpu_memory(args.cuda_mib) if args.cuda_mib else None
    if held is not None:
        log(f"holding {args.cuda_mib} MiB of GPU memory")
    if args.cuda_child:
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--port", "0",
                                  "--hold-gpu-only", str(args.cuda_child)])
        log(f"children: gpu-child={child.pid}")

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(64)
    sock.set_inheritable(args.orphan_port)
    spawn_children(sock if args.orphan_port else None, args.children)

    httpd = ThreadingHTTPServer((args.host, args.port), Handler, bind_and_activate=False)
    httpd.socket.close()
    httpd.socket = sock
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    log("Load weights begin")
    if args.optional_traceback:
        log("Can not initialize OpenAIServingResponses, error: Traceback (most recent call last):\n"
            '  File "serving_responses.py", line 30, in <module>\n'
            "ModuleNotFoundError: No module named 'openai_harmony'")
    t0 = time.monotonic()
    while not stop_at:
        elapsed = time.monotonic() - t0
        if args.crash_after is not None and elapsed >= args.crash_after:
            raise RuntimeError("simulated crash while loading weights: CUDA out of memory")
        if not State.ready and not args.hang and args.crash_after is None and elapsed >= args.start_delay:
            State.ready = True
            log("The server is fired up and ready to roll!")
        time.sleep(0.02)
    while time.monotonic() < stop_at[0]:
        time.sleep(0.02)
    log("drained, exiting")
    os._exit(0)


if __name__ == "__main__":
    main()
