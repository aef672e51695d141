"""The simulator's process tree and how it ends, following sglang 0.5.9:

* children are started by the main process and die with it (PR_SET_PDEATHSIG in the child);
* a child that fails sends SIGQUIT; the main process then kills the whole tree, itself included
  (engine.py:862-880 launch phase, tokenizer_manager.py:2506-2511 running phase);
* the end of a SIGTERM drain is `kill_process_tree(os.getpid(), include_parent=True)`: SIGKILL to every
  descendant, then to itself (utils/common.py:1129-1163), so the exit status is -SIGKILL.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

from dynctl.sim.child import CONFIG_ENV


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    ready_fd: int | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None


class SchedulerDied(RuntimeError):
    def __init__(self, rank: int, exit_code: int | None):
        super().__init__(f"Rank {rank} scheduler is dead. Please check if there are relevant logs.")
        self.rank = rank
        self.exit_code = exit_code


def set_ulimit(target: int = 65535) -> None:
    """utils/common.py set_ulimit: room for thousands of client connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(target, hard), hard))
        except ValueError:
            pass


def spawn(role: str, title: str, config: dict, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start `python -m dynctl.sim.child TITLE`; the title stays visible in ps even without setproctitle."""
    env = dict(os.environ)
    env[CONFIG_ENV] = json.dumps({**config, "role": role, "title": title, "parent_pid": os.getpid()})
    # Spawned from the main thread: PR_SET_PDEATHSIG fires when the spawning *thread* exits.
    return subprocess.Popen([sys.executable, "-m", "dynctl.sim.child", title], env=env, stdin=subprocess.DEVNULL,
                            pass_fds=pass_fds, close_fds=True)


def spawn_scheduler(config: dict) -> Child:
    read_fd, write_fd = os.pipe()
    title = f"sglang::scheduler{config['prefix'].replace(' ', '_')}"
    proc = spawn("scheduler", title, {**config, "ready_fd": write_fd}, pass_fds=(write_fd,))
    os.close(write_fd)
    return Child("scheduler", proc, read_fd)


def wait_ready(schedulers: list[Child]) -> list[dict]:
    """engine.py _wait_for_scheduler_ready: one ready message per rank, in rank order."""
    infos: list[dict] = []
    for rank, child in enumerate(schedulers):
        buffer = b""
        while b"\n" not in buffer:
            # select() is retried after signal handlers run (PEP 475), so SIGQUIT/SIGTERM act promptly.
            readable, _, _ = select.select([child.ready_fd], [], [], 0.5)
            if not readable:
                continue
            chunk = os.read(child.ready_fd, 4096)
            if not chunk:
                os.close(child.ready_fd)
                child.ready_fd = None
                child.proc.wait()
                raise SchedulerDied(rank, child.proc.returncode)
            buffer += chunk
        os.close(child.ready_fd)
        child.ready_fd = None
        infos.append(json.loads(buffer.decode()))
    return infos


def kill_process_tree(include_parent: bool) -> None:
    """SIGKILL every descendant, then (optionally) this process."""
    try:
        me = psutil.Process()
        children = me.children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    if include_parent:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1)  # not reached


def listening_fd(port: int) -> int | None:
    """The descriptor of this process's listening socket on `port` (to hand to the orphan fault)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:"):
            continue
        try:
            s = socket.socket(fileno=int(fd))
        except OSError:
            continue
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and s.getsockname()[1] == port:
                return int(fd)
        except OSError:
            continue
        finally:
            s.detach()
    return None
