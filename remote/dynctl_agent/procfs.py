"""Processes and ports as /proc shows them: the one parser of /proc/<pid>/stat, liveness, listeners.

A process is named by (pid, start time in clock ticks): a recycled pid never passes for the process
it replaced. Zombies count as gone. psutil is used where the interpreter has it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time

try:  # sglang's own interpreter ships psutil; anything else may not
    import psutil  # type: ignore
except Exception:  # pragma: no cover - depends on the host
    psutil = None

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_BOOT = []


def stat(pid):
    """{ppid, pgid, sid, start (ticks after boot), state} of pid, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ")"
        return {"ppid": int(fields[1]), "pgid": int(fields[2]), "sid": int(fields[3]),
                "start": int(fields[19]), "state": fields[0]}
    except (OSError, IndexError, ValueError):
        return None


def table():
    """stat() of every process, by pid."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def start_time(pid):
    """Kernel start time of pid in clock ticks (guards against pid reuse), or None."""
    st = stat(pid)
    return None if st is None else st["start"]


def alive(pid):
    """True for a live, non-zombie process."""
    if pid <= 0:
        return False
    if psutil is not None:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    st = stat(pid)
    return st is not None and st["state"] not in ("Z", "X")


def same(pid, start):
    """pid is still the live (non-zombie) process that started at `start`."""
    st = stat(pid)
    return st is not None and st["state"] not in ("Z", "X") and st["start"] == start


def holder_alive(record):
    """The process a record names by "pid" and "pid_start" (a lock holder, a worker) still runs."""
    pid = int((record or {}).get("pid") or 0)
    return pid > 0 and same(pid, record.get("pid_start"))


def boot_time():
    """Epoch seconds of the boot (read once per process), or None."""
    if not _BOOT:
        try:
            with open("/proc/stat") as f:
                _BOOT.append(next(int(ln.split()[1]) for ln in f if ln.startswith("btime ")))
        except (OSError, StopIteration, ValueError):
            _BOOT.append(None)
    return _BOOT[0]


def ticks_to_epoch(ticks):
    boot = boot_time()
    return None if ticks is None or boot is None else boot + ticks / float(CLK_TCK)


def started_epoch(pid):
    """Epoch seconds when pid started, or None."""
    return ticks_to_epoch(start_time(pid))


def uptime(start_ticks):
    started = ticks_to_epoch(start_ticks)
    return None if started is None else max(0.0, time.time() - started)


def wait_start_time(pid):
    """The start time of a process just forked (its /proc entry may lag a moment), or None."""
    for _ in range(100):
        start = start_time(pid)
        if start is not None:
            return start
        time.sleep(0.01)
    return None


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def environ(pid):
    """pid's environment as it was exec'd ({name: value}), or None when it cannot be read."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return None
    out = {}
    for item in data.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            out[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out


def has_env(pid, name, value):
    """pid's environment holds name=value exactly."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return (b"\0%s=%s\0" % (name.encode(), value.encode())) in b"\0" + f.read() + b"\0"
    except OSError:
        return False


def reap(pid):
    """Collect our own child's exit status (the agent that started a server may still be its parent)."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if done != pid:
        return None
    return os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status


def wait_until(cond, timeout, step=0.02):
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


# --------------------------------------------------------------------------- ports


def listening_pids(port):
    """Pids listening on TCP `port` (any address); empty when none or not visible."""
    pids = set()
    if psutil is not None:
        try:
            for c in psutil.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                    pids.add(c.pid)
            return sorted(pids)
        except (psutil.Error, OSError):
            pass
    inodes = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(parts[9])
        except OSError:
            continue
    if not inodes:
        return []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir("/proc/%s/fd" % pid):
                link = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    pids.add(int(pid))
                    break
        except OSError:
            continue
    return sorted(pids)


def port_in_use(port, host="127.0.0.1"):
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def port_bindable(port):
    """No listener holds port on any address: a bind (never a listen) succeeds. ~50 us, where reading
    /proc/net/tcp or scanning every process's fds takes 10-20 ms."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "held"
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((addr, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return False
        finally:
            s.close()
    return True
