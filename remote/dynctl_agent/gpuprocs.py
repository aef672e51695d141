"""Who holds each GPU, for the live view's process list (as nvitop shows it): pid, user, memory, command.

nvidia-smi's compute-apps query every EVERY_S seconds (20-30 ms a call), not every sample; the owner and the
command line come from /proc, redacted. A pid nvidia-smi names that /proc does not show (a host pid seen
from a container) is listed with user and command unknown.
"""

from __future__ import annotations

import subprocess

from dynctl.base import sglang
from dynctl_agent import hostinfo, procfs

EVERY_S = 5.0


class GpuProcesses:
    def __init__(self, ctx):
        self.ctx = ctx
        self.exe = hostinfo.nvidia_smi_path(ctx)
        self.at = None
        self.latest = None

    def sample(self, now):
        """{"ok", "csv", "owners": {pid: {"user", "command"}}, "t"}, refreshed every EVERY_S; None without nvidia-smi."""
        if self.exe is None:
            return None
        if self.at is not None and now - self.at < EVERY_S:
            return self.latest
        self.at = now
        try:
            proc = subprocess.run(sglang.apps_query_argv(self.exe), capture_output=True, text=True, timeout=5,
                                  stdin=subprocess.DEVNULL, env=hostinfo.server_env(self.ctx))
        except (OSError, subprocess.TimeoutExpired) as err:
            self.latest = {"ok": False, "error": "nvidia-smi: %s" % err, "t": now}
            return self.latest
        if proc.returncode != 0:
            self.latest = {"ok": False, "error": "nvidia-smi exited %d" % proc.returncode, "t": now}
            return self.latest
        owners = {}
        for line in proc.stdout.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 4 and parts[1].isdigit():
                owners[parts[1]] = _owner(int(parts[1]))
        self.latest = {"ok": True, "csv": proc.stdout, "owners": owners, "t": now}
        return self.latest


def _owner(pid):
    uids = procfs.uids(pid)
    command = " ".join(sglang.redact_argv(procfs.cmdline(pid)))[:200] or None
    return {"user": None if uids is None else procfs.user_name(uids[0]), "command": command}
