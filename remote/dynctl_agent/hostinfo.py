"""The host as the server's interpreter sees it: its environment, sglang's location, workdir and port."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

from dynctl.base import sglang
from dynctl_agent import procfs
from dynctl_agent.protocol import AgentError

def server_env(ctx):
    """The host's environment plus the configured `env`; values may refer to $VARS of the host."""
    env = dict(os.environ)
    for key, value in ctx.env.items():
        env[key] = os.path.expandvars(value)
    return env


def run_python(ctx, code, *args, timeout=60):
    """Run a snippet with the server's interpreter and environment; returns (rc, out, err)."""
    try:
        proc = subprocess.run(
            [ctx.python, "-c", code] + [str(a) for a in args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=server_env(ctx),
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise AgentError("python interpreter %s not found on %s" % (ctx.python, ctx.name), "preflight")
    except PermissionError:
        raise AgentError("python interpreter %s is not executable on %s" % (ctx.python, ctx.name), "preflight")
    except subprocess.TimeoutExpired:
        raise AgentError("%s did not answer within %ss" % (ctx.python, timeout), "failed")
    return proc.returncode, proc.stdout, proc.stderr


def program(name):
    """The text of a program of this package that runs with the server's interpreter (`python -c`): it is a
    file here like every module, read when it is needed."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py"), encoding="utf-8") as f:
        return f.read()


def find_sglang(ctx):
    """{"python", "python_version", "sglang": {"version", "package_dir"} or None} of the server's interpreter."""
    rc, out, err = run_python(ctx, program("find_sglang"), sglang.__file__)
    if rc != 0:
        raise AgentError("%s failed while looking for sglang: %s" % (ctx.python, err.strip()[-500:]), "preflight")
    return json.loads(out.strip().splitlines()[-1])


def nvidia_smi_path(ctx):
    return shutil.which("nvidia-smi", path=server_env(ctx).get("PATH"))


def inspect_host(ctx):
    found = find_sglang(ctx)
    try:
        usage = shutil.disk_usage(ctx.workdir if os.path.isdir(ctx.workdir) else os.path.dirname(ctx.workdir) or "/")
        free = usage.free
    except OSError:
        free = None
    workdir = {
        "path": ctx.workdir,
        "exists": os.path.isdir(ctx.workdir),
        "writable": os.access(ctx.workdir, os.W_OK) if os.path.isdir(ctx.workdir) else _creatable(ctx.workdir),
        "free_bytes": free,
    }
    listeners = [{"pid": pid, "cmdline": procfs.cmdline(pid)} for pid in procfs.listening_pids(ctx.port)]
    return {
        "hostname": socket.gethostname(),
        "python": found["python"],
        "python_version": found["python_version"],
        "sglang": found["sglang"],
        "workdir": workdir,
        "nvidia_smi": nvidia_smi_path(ctx),
        "psutil": procfs.psutil is not None,
        "port": ctx.port,
        "port_listeners": listeners,
        "port_in_use": bool(listeners) or procfs.port_in_use(ctx.port),
        "agent_pid": os.getpid(),
    }


def _creatable(path):
    parent = os.path.dirname(path.rstrip("/")) or "/"
    while not os.path.isdir(parent) and parent != "/":
        parent = os.path.dirname(parent)
    return os.access(parent, os.W_OK)

