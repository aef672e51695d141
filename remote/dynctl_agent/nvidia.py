"""The GPUs through nvidia-smi: which compute processes hold memory, and a looping sample for the live view."""

from __future__ import annotations

import subprocess
import threading
import time

from dynctl.base import sglang
from dynctl_agent import hostinfo


def compute_pids(smi, env=None):
    """{pid: used MiB} of the compute processes nvidia-smi lists; None when it cannot say."""
    try:
        proc = subprocess.run(sglang.apps_query_argv(smi), capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_compute_apps(proc.stdout) if proc.returncode == 0 else None


def parse_compute_apps(text):
    """{pid: used MiB or None} from the APPS_QUERY rows (noheader, nounits)."""
    pids = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[1].isdigit():
            try:
                pids[int(parts[1])] = float(parts[-1])
            except ValueError:  # [N/A] in some containers and MIG setups
                pids[int(parts[1])] = None
    return pids


class Sampler:
    """One long-lived `nvidia-smi --query-gpu ... -lms` read by a thread that keeps the last full block.

    NVML stays initialised between samples: a fresh call costs 20-30 ms on an H200 with persistence mode
    on (measured), more without it; the loop costs 0.05 % of a core at 1 Hz (measured)."""

    RETRY_EVERY = 30.0

    def __init__(self, ctx, interval):
        self.exe = hostinfo.nvidia_smi_path(ctx)
        self.env = hostinfo.server_env(ctx)
        self.ms = max(100, int(interval * 1000))
        self.lock = threading.Lock()
        self.latest = None
        self.error = None if self.exe else "nvidia-smi not found on the server's PATH"
        self.proc = None
        self.started = 0.0
        self.first = threading.Event()  # set once the first block is in, or nvidia-smi has ended

    def _start(self, now):
        self.started = now
        try:
            self.proc = subprocess.Popen(
                [self.exe, "--query-gpu=" + ",".join(sglang.GPU_QUERY + ("count",)), sglang.CSV_FORMAT,
                 "-lms", str(self.ms)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
            )
        except OSError as err:
            self.error = "nvidia-smi: %s" % (err.strerror or err)
            return
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc):
        # One block per period, one line per GPU in index order: a block ends when the index starts over.
        # It is published as soon as it has as many GPUs as each row's `count` says (the GPUs in the system),
        # so the first block is read without waiting for the second; the rows go on without that column.
        block, last, size, noise = [], None, None, []
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").strip()
            head = line.split(",", 1)[0]
            if not head.isdigit():
                noise.append(line)
                continue
            count = ""
            if line.count(",") >= len(sglang.GPU_QUERY):  # the count column came back after the queried ones
                line, _, count = line.rpartition(",")
                line, count = line.rstrip(), count.strip()
            index = int(head)
            if last is not None and index <= last:
                if size is None or len(block) != size:
                    self._publish(block)
                size, block = len(block), []
            if count.isdigit():
                size = int(count)
            last = index
            block.append(line)
            if size is not None and len(block) == size:
                self._publish(block)
        proc.wait()
        with self.lock:
            self.error = ("nvidia-smi exited %s: %s" % (proc.returncode, " ".join(noise)[-300:])).strip(": ")
        self.first.set()

    def _publish(self, block):
        with self.lock:
            self.latest = {"ok": True, "csv": "\n".join(block) + "\n", "t": time.time()}
            self.error = None
        self.first.set()

    def start(self, now):
        """Start nvidia-smi now, so that its first block is read while the rest of the first sample is taken."""
        if self.exe is not None and self.proc is None:
            self._start(now)

    def sample(self, now, wait=0.0):
        """The latest block; the first sample waits up to `wait` seconds for nvidia-smi's first answer."""
        if self.exe is None:
            return {"ok": False, "error": self.error}
        if (self.proc is None or self.proc.poll() is not None) and now - self.started >= self.RETRY_EVERY:
            self._start(now)
        if wait > 0 and self.proc is not None:
            self.first.wait(wait)
        with self.lock:
            if self.latest is not None and now - self.latest["t"] < max(5.0, 3 * self.ms / 1000.0):
                return dict(self.latest)
            return {"ok": False, "error": self.error or "waiting for nvidia-smi"}

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
