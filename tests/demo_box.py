"""Demo hosts for end-to-end tests: the simulated sglang server on a real sglang tree, reached as a real
box is (SSH to the test sshd, then `pct exec` into a container), driven through the `dynctl` CLI.

    config = demo_box()                                  # the fixture (tests/conftest.py): a private copy
    config = demo_box("0.5.14", via="local", time_scale=50, strategy="native")
    dynctl("deploy", "--threshold", "5", "--yes", config=config)
    tree_sha256(config)                                  # one digest of the whole sglang tree

Every test that needs a demo host takes it from `demo_box`; a module that shares one host between its
tests calls `make_demo_box` with the session's `demo_template` itself.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from dynctl.core import deploy as core
from dynctl.cli.common import HostSession, open_host
from dynctl.sim.hostsetup import prepare_demo_host
from sglang_trees import sglang_wheel
from sshd_harness import FakeHost, free_port, toml_value

CTID = 129
_copies = itertools.count(1)


def make_demo_box(sshd: FakeHost | None, template: Path, tmp_path: Path, version: str = "0.5.9", *,
                  ctid: int = CTID, pct: bool = True, time_scale: float = 20, strategy: str | None = None,
                  **env: str) -> Path:
    """Copy the prepared `template` and write a config whose default host `box` is the copy: in container `ctid`
    on the test sshd (pct=False: on the sshd itself), or on this machine without SSH when `sshd` is None."""
    n = next(_copies)
    base = tmp_path if sshd is None else sshd.make_ct(ctid) if pct else sshd.tmp
    root = base / f"demo-{tmp_path.name}-{n}"
    shutil.copytree(template, root, symlinks=True)
    entry = prepare_demo_host(root, sglang_version=version, port=free_port(),
                              cache_dir=sglang_wheel(version).parent, time_scale=time_scale)
    entry["env"].update(env)
    if strategy is not None:
        entry["strategy"] = strategy
    config = tmp_path / "dynctl.toml"
    if config.exists():  # a second box in one test
        config = tmp_path / f"dynctl-{n}.toml"
    if sshd is None:
        return write_config(config, {"box": entry}, default_host="box")
    entry["ssh"] = sshd.target
    if pct:
        entry["pct"] = ctid
    return sshd.write_config(config, {"box": entry}, default_host="box")


def write_config(path: Path, hosts: Mapping[str, Mapping[str, Any]], default_host: str | None = None) -> Path:
    """A dynctl TOML for hosts on this machine (no SSH)."""
    lines = [f"default_host = {toml_value(default_host)}"] if default_host else []
    for name, values in hosts.items():
        lines.append(f"\n[hosts.{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def dynctl(*args: str, config: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynctl", *args, "--config", str(config)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)


def demo_env(tmp_path: Path, home: Path) -> tuple[dict[str, str], Path]:
    """The environment of a `dynctl demo` run in `home`, and its data folder (XDG_DATA_HOME), whose download
    cache already holds the sglang 0.5.9 wheel."""
    data = tmp_path / "data"
    cache = data / "dynctl" / "demo" / "cache"
    cache.mkdir(parents=True)
    wheel = sglang_wheel("0.5.9")
    shutil.copy(wheel, cache / wheel.name)  # the demo downloads it otherwise; the test cache has it
    env = dict(os.environ, HOME=str(home), XDG_DATA_HOME=str(data))
    env.pop("DYNCTL_CONFIG", None)
    return env, data


def dynctl_in(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`dynctl ARGS` in the environment `env` (its own config, data and home)."""
    return subprocess.run([sys.executable, "-m", "dynctl", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=timeout)


def session(config: Path) -> HostSession:
    return open_host(None, str(config))


def server_info(config: Path) -> dict[str, Any]:
    return session(config).agent.call("server_info")["info"]


def server_pid(config: Path) -> int | None:
    return session(config).agent.call("server_find").get("pid")


def site_of(config: Path) -> Path:
    return Path(session(config).host.env["PYTHONPATH"])


def tree_sha256(config_or_site: Path) -> str:
    """One sha256 over every file of the sglang package (path and bytes), bytecode caches left out."""
    site = config_or_site if config_or_site.is_dir() else site_of(config_or_site)
    package = site / "sglang"
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if "__pycache__" in path.parts or path.is_dir():
            continue
        digest.update(str(path.relative_to(package)).encode() + b"\0")
        digest.update(path.read_bytes() if not path.is_symlink() else os.readlink(path).encode())
        digest.update(b"\0")
    return digest.hexdigest()


def start_baseline(config: Path) -> int:
    proc = dynctl("start", "--yes", config=config)
    assert proc.returncode == 0, proc.stderr
    pid = server_pid(config)
    assert pid
    return pid


def with_text(dplan: core.DeployPlan, path: str, text: str) -> None:
    """Replace the planned new text of one file (a deliberately broken release)."""
    for f in dplan.files:
        if f["path"] == path:
            f["text"] = text
            f["sha256_after"] = hashlib.sha256(text.encode()).hexdigest()
            return
    raise AssertionError(f"{path} is not in the plan")


def kill_servers_of(workdir: Path) -> None:
    """Kill what dynctl started from `workdir` (by the marker in its environment), nothing else."""
    rec = workdir / "server.json"
    marker = json.loads(rec.read_text()).get("marker") if rec.exists() else None
    if not marker:
        return
    for p in psutil.process_iter():
        try:
            if p.environ().get("DYNCTL_SERVER_ID") == marker:
                p.kill()
        except psutil.Error:
            continue
