"""`watch`, the live feed of the TUI: ONE long-lived call per host that samples everything on the host.

It answers one JSON line per interval, so the client never opens a channel per refresh and a slow host
never piles up requests. Raw values only (Prometheus text, nvidia-smi CSV, log lines): the client parses
them with dynctl.base.parsers.serverlog, the same code `dynctl status` uses.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from dynctl.base import sglang
from dynctl_agent import gpuprocs, httpclient, lock, nvidia, procfs, releases, serverinfo, servers
from dynctl_agent.protocol import AgentError

_METRICS_CAP = 4 << 20
_LOG_SCAN = 256 << 10  # how far back the first sample looks for state marks
_LOG_CAP = 1 << 20  # most log bytes read per interval; a flood beyond that is skipped
# Lines the client needs even when the tail it is sent is cut: speculation transitions, the drain, and the
# patch's warnings that the threshold cannot act.
_MARKS = ("Speculation enabled", "Speculation disabled", "SIGTERM received", "is not armed:", "never fires:")
_MAX_MARKS = 200
# How long the first sample waits for nvidia-smi's first block (20-30 ms on an H200 with persistence mode on,
# more without it); one that comes later is in the next sample.
FIRST_GPU_WAIT_S = 1.5
_OWN_REQUESTS = tuple('"GET %s HTTP/1.1"' % p for p in ("/metrics", sglang.SERVER_INFO_PATHS[0], sglang.LOADS_PATH))


def _metrics(ctx, timeout):
    """The sglang: samples of /metrics, without histogram buckets (the client needs none of them)."""
    t0 = time.time()
    try:
        raw = httpclient.get("127.0.0.1", ctx.port, "/metrics", timeout, _METRICS_CAP).decode("utf-8", "replace")
    except httpclient.FAILURES as err:
        return {"ok": False, "error": httpclient.short(err)}
    return {"ok": True, "text": sglang.metric_lines(raw), "ms": round((time.time() - t0) * 1000, 1)}


def _loads(ctx, timeout):
    """/v1/loads?include=core (sglang >= 0.5.8): the scheduler's batch right now. The /metrics gauges are
    only written every decode_log_interval steps and, once idle, every 30 s (scheduler_runtime_checker_mixin
    check_memory), so they lag exactly when load moves."""
    try:
        data = httpclient.get_json("127.0.0.1", ctx.port, sglang.LOADS_PATH, timeout, 1 << 20, servers.api_keys(ctx))
    except httpclient.FAILURES as err:
        return {"ok": False, "error": httpclient.short(err)}
    loads = data.get("loads") if isinstance(data, dict) else None
    if not isinstance(loads, list):
        return {"ok": False, "error": "/v1/loads without a loads list"}
    keep = ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens",
            "token_usage", "gen_throughput")
    return {"ok": True, "loads": [{k: d.get(k) for k in keep} for d in loads if isinstance(d, dict)]}


def _server_info(ctx, timeout):
    try:
        data = httpclient.server_info("127.0.0.1", ctx.port, timeout, 8 << 20, servers.api_keys(ctx))
    except httpclient.FAILURES as err:
        return {"ok": False, "error": httpclient.short(err)}
    if not isinstance(data, dict):
        return {"ok": False, "error": "/server_info is not a JSON object"}
    out = {k: data[k] for k in sglang.SERVER_INFO_KEYS if k in data}
    states = data.get("internal_states")
    first = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    out["internal_state"] = {k: first[k] for k in sglang.INTERNAL_STATE_KEYS if k in first}
    if data.get("speculative_adaptive"):  # native: the cut its own config enforces, read from the file it names
        out["adaptive_threshold"], out["adaptive_problem"] = serverinfo.adaptive_threshold(data)
    return {"ok": True, "data": out}


class _ServerSampler:
    """The server as servers.locate decides it (ours, not ours, nobody), cheaply enough for every second.

    The full decision walks /proc and the port's sockets, so it is taken again only when the pidfile
    changed, the process it named is gone, or a few seconds have passed; in between, the answer stands.
    """

    FULL_EVERY = 5.0

    def __init__(self, ctx):
        self.ctx = ctx
        self.answer, self.key, self.at, self.pid_start = None, None, 0.0, None

    def _pidfile_key(self):
        try:
            st = os.stat(self.ctx.path(servers.PIDFILE))
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None

    def sample(self, now):
        key = self._pidfile_key()
        answer = self.answer
        if (answer is None or key != self.key or now - self.at >= self.FULL_EVERY
                or (answer["pid"] is not None and not procfs.same(answer["pid"], self.pid_start))):
            self.answer, self.key, self.at = self._decide(), key, now
        return dict(self.answer)

    def _decide(self):
        ctx = self.ctx
        loc = servers.locate(ctx)
        server, rec = loc["server"], loc["record"] or {}
        self.pid_start = server["start"] if server else None
        if server is None:
            out = {"pid": None, "alive": False, "source": None}
        else:
            from_pidfile = server["source"] == "pidfile"
            out = {"pid": server["pid"], "alive": True, "source": server["source"],
                   "started": procfs.started_epoch(server["pid"]),
                   "stopping": rec.get("stopping") if from_pidfile and not rec.get("stopped") else None,
                   "release": rec.get("release") if from_pidfile else None}
        out["log"] = servers.log_path(ctx, loc)  # an adopted server's own file (or none), else workdir's
        not_ours = servers.not_ours(ctx, loc)
        if not_ours is not None:
            out["not_ours"] = {k: not_ours[k] for k in ("kind", "pid", "cmdline", "text")}
        if loc["leftovers"]:
            out["leftovers"] = sorted(loc["leftovers"])
        return out


class _LogSampler:
    """New lines of the server log since the last sample; follows truncation and replacement."""

    PROOF = 64  # bytes before our position that must still be there, or the file was rewritten

    def __init__(self, path, max_lines):
        self.path = path
        self.max_lines = max_lines
        self.f = None
        self.ino = None
        self.pos = 0
        self.partial = b""
        self.proof = b""

    def _rewritten(self):
        """Truncated and refilled to the same size or beyond: the bytes we last read are gone."""
        if not self.proof:
            return False
        self.f.seek(self.pos - len(self.proof))
        return self.f.read(len(self.proof)) != self.proof

    def _open(self, at_end):
        self.close()
        f = open(self.path, "rb")
        st = os.fstat(f.fileno())
        self.f, self.ino, self.partial, self.proof = f, st.st_ino, b"", b""
        self.pos = max(0, st.st_size - _LOG_SCAN) if at_end else 0
        return self.pos > 0

    def close(self):
        if self.f is not None:
            self.f.close()
            self.f = None

    def sample(self, first=False):
        out = {"path": self.path, "lines": [], "marks": [], "decode": None, "dropped": 0, "skipped_bytes": 0,
               "reset": False}
        try:
            if self.f is None:
                cut = self._open(at_end=first)
                out["reset"] = not first
            else:
                st = os.stat(self.path)
                if st.st_ino != self.ino or st.st_size < self.pos or self._rewritten():  # a new server run
                    cut = self._open(at_end=False)
                    out["reset"] = True
                else:
                    cut = False
            size = os.fstat(self.f.fileno()).st_size
            if size - self.pos > _LOG_CAP:
                out["skipped_bytes"] = size - _LOG_CAP - self.pos
                self.pos, self.partial, self.proof, cut = size - _LOG_CAP, b"", b"", True
            self.f.seek(self.pos)
            chunk = self.f.read(size - self.pos)
        except OSError as err:
            self.close()
            out["error"] = "%s: %s" % (self.path, err.strerror or err)
            return out
        self.pos += len(chunk)
        if chunk:
            self.proof = (self.proof + chunk)[-self.PROOF:]
        data = self.partial + chunk
        end = data.rfind(b"\n") + 1
        self.partial = data[end:]
        lines = data[:end].decode("utf-8", "replace").splitlines()
        if cut and lines:
            lines = lines[1:]  # the first line starts mid-way
        # uvicorn logs every request at INFO; our own polling would fill the tail with itself
        lines = [ln for ln in lines if not any(q in ln for q in _OWN_REQUESTS)]
        for line in lines:
            if line.startswith("==== dynctl start "):  # the lifecycle's header: earlier marks are another run's
                out["marks"] = []
            if "Decode batch" in line:
                out["decode"] = line
            if any(m in line for m in _MARKS):
                out["marks"].append(line)
        out["marks"] = out["marks"][-_MAX_MARKS:]
        out["dropped"] += max(0, len(lines) - self.max_lines)
        out["lines"] = lines[-self.max_lines:] if self.max_lines else []
        return out


def _release(ctx):
    """The release in force, as the live view shows it."""
    manifest = releases.in_force(ctx)
    if manifest is None:
        return None
    out = {k: manifest.get(k) for k in ("strategy", "threshold", "effective_threshold", "sglang_version", "created",
                                        "who", "state")}
    out["id"] = manifest["id"]
    return out


def _lock(ctx):
    holder = lock.live_holder(ctx)
    return None if holder is None else {k: holder.get(k) for k in ("operation", "who", "client_host", "started", "op")}


def _number(value, name, low, high, kind=float):
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise AgentError("watch: %s must be a number, got %r" % (name, value), "usage")
    if not low <= number <= high:
        raise AgentError("watch: %s must be between %s and %s, got %s" % (name, low, high, number), "usage")
    return number


class _Stop(BrokenPipeError):
    """SIGTERM from the client closing its end: the same as a broken pipe, so main() ends quietly."""


def _sigterm(signum, frame):
    raise _Stop()


def watch(ctx, interval=1.0, log_lines=50, gpus=True, max_items=None, info_every=5.0, gpu_procs=False,
          info_timeout=None):
    """Yield one sample of the server, its GPUs and its log every `interval` seconds, on the host itself.

    /server_info is read every `info_every` seconds, and at the next sample again when it did not answer: sglang
    asks the scheduler, which answers between two steps, so a long step holds the answer past a sample's budget.
    `info_timeout`: how long the stream's first read of it may wait (a one-shot status waits for the answer; by
    default a read gets what is left of its sample's budget)."""
    interval = _number(interval, "interval", 0.05, 60.0)
    log_lines = _number(log_lines, "log_lines", 0, 5000, int)
    info_every = _number(info_every, "info_every", 0.0, 3600.0)
    info_timeout = None if info_timeout is None else _number(info_timeout, "info_timeout", 0.05, 60.0)
    max_items = None if max_items is None else _number(max_items, "max_items", 1, 10 ** 9, int)
    proc, log = _ServerSampler(ctx), _LogSampler(ctx.path(servers.LOG), log_lines)
    gpu = nvidia.Sampler(ctx, interval) if gpus else None
    # the live view's process list: a short nvidia-smi call every few seconds, only for a view that shows it
    holders = gpuprocs.GpuProcesses(ctx) if gpus and gpu_procs else None
    previous = None
    if threading.current_thread() is threading.main_thread():  # a closed stream ends us by SIGTERM
        previous = signal.signal(signal.SIGTERM, _sigterm)
    seq, slot, info_at, last_pid, last_http, loads_missing_at = 0, time.time(), None, None, None, None
    try:
        if gpu:  # its first block is read while the rest of the first sample is taken
            gpu.start(time.time())
        while True:
            start = time.time()
            budget = interval * 0.8
            item = {"ok": True, "seq": seq, "t": start, "utc_offset": time.localtime(start).tm_gmtoff,
                    "interval": interval, "port": ctx.port}
            item["process"] = proc.sample(start)
            pid = item["process"]["pid"]
            if pid is None:  # whatever answers on the port is not our server: its numbers are not ours either
                item["metrics"] = {"ok": False, "error": "no server of ours on port %d" % ctx.port}
            else:
                item["metrics"] = _metrics(ctx, max(0.05, budget * 0.4))
                if loads_missing_at is None or start - loads_missing_at >= 60:  # an older sglang: now and then
                    item["loads"] = _loads(ctx, max(0.05, start + budget * 0.6 - time.time()))
                    loads_missing_at = start if item["loads"].get("error", "").startswith("HTTP 404") else None
            if pid is not None and (info_at is None or start - info_at >= info_every or pid != last_pid
                                    or item["metrics"]["ok"] != last_http):
                wait = max(0.05, start + budget - time.time())
                if info_timeout is not None:
                    wait, info_timeout = max(wait, info_timeout), None
                item["server_info"] = _server_info(ctx, wait)
                if item["server_info"]["ok"]:
                    info_at = start
            last_pid, last_http = pid, item["metrics"]["ok"]
            # the first item waits for nvidia-smi's first answer (a block is due every interval after it)
            first_wait = max(0.0, start + FIRST_GPU_WAIT_S - time.time()) if seq == 0 else 0.0
            item["gpus"] = gpu.sample(start, wait=first_wait) if gpu else None
            procs = holders.sample(start) if holders else None
            if procs is not None:
                item["gpu_procs"] = procs
            path = item["process"].pop("log", log.path)
            if path != log.path:  # the server in question writes elsewhere (adopted), or no longer does
                log.close()
                log, moved = _LogSampler(path, log_lines), True
            else:
                moved = False
            item["log"] = log.sample(first=seq == 0 or moved) if path is not None else {
                "path": None, "lines": [], "marks": [], "decode": None, "dropped": 0, "skipped_bytes": 0,
                "reset": moved, "note": "the adopted server writes no log file dynctl can read"}
            item["release"] = _release(ctx)
            item["lock"] = _lock(ctx)
            item["sample_ms"] = round((time.time() - start) * 1000, 1)
            yield item
            seq += 1
            if max_items is not None and seq >= max_items:
                return
            slot += interval
            now = time.time()
            if slot < now:  # a slow sample: skip the missed slots instead of bursting to catch up
                slot = now
            time.sleep(slot - now)
    except _Stop:
        return
    finally:
        log.close()
        if gpu:
            gpu.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
