"""Starting and stopping the simulated sglang server as a real subprocess, for the test_sim_* and bench files.

Servers bind random 127.0.0.1 ports, are started in their own session, and are torn down by pid (the
whole tree, the orphan fault's grandchild included). The fixtures `site_059`, `patched_site_059` and
`start_sim` (tests/conftest.py) wrap these.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
from polling import wait_for
from sglang_trees import install_sglang
from sshd_harness import free_port

from dynctl.patching import TARGET_FILES, plan_patch

SPEC_ARGS = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/models/draft",
             "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


def install_patched(version: str, site: Path) -> Path:
    """A tree patched by dynctl's own patch engine (the planner; files written directly)."""
    package = install_sglang(version, site)
    originals = {p: (package / p).read_text(encoding="utf-8") if (package / p).exists() else None
                 for p in TARGET_FILES(version)}
    for change in plan_patch(version, originals).changes:
        (package / change.path).write_text(change.after, encoding="utf-8")
    return package


class Sim:
    """One `python -m dynctl.sim` process and what it wrote."""

    def __init__(self, site: Path, argv: list[str], workdir: Path, env: dict[str, str] | None = None,
                 port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"sim-{self.port}.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("DYNCTL_SIM_", "SGLANG_"))}
        environ.update({"PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"})
        environ.update(env or {})
        self.argv = [sys.executable, "-m", "dynctl.sim", *argv, "--port", str(self.port)]
        self.log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, env=environ, cwd=workdir, stdin=subprocess.DEVNULL,
                                     stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True)
        self._tree: set[int] = set()

    @property
    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, timeout: float = 30) -> "Sim":
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"simulator exited {self.proc.returncode} before ready:\n{self.log[-4000:]}")
            return "The server is fired up and ready to roll!" in self.log
        wait_for(ready, timeout, "the simulator to be ready")
        self.remember_tree()
        return self

    def wait_exit(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"simulator still running after {timeout} s:\n{self.log[-3000:]}") from None

    def remember_tree(self) -> set[int]:
        with contextlib.suppress(psutil.Error):
            self._tree |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        return self._tree

    def children(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.proc.pid).children(recursive=True)
        return []

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 30), **kw)

    def stop(self) -> None:
        """Kill whatever is left of this server, by pid."""
        pids = self.remember_tree() | {self.proc.pid}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.log_file.close()


def listeners(port: int) -> list[int]:
    """Every process holding a listening socket on `port` (psutil.net_connections names only one
    process per socket, and the orphan fault shares the server's socket)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in proc.net_connections(kind="tcp")):
                found.append(proc.pid)
    return sorted(found)
