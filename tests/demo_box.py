"""Demo hosts for end-to-end tests: the simulated sglang server on a real sglang tree, reached as a real
box is (SSH to the test sshd, then `pct exec` into a container), driven through the `dynctl` CLI.

    config = make_demo_box(sshd, template, tmp_path)     # a private copy of a prepared demo host
    dynctl("deploy", "--threshold", "5", "--yes", config=config)
    tree_sha256(config)                                  # one digest of the whole sglang tree

The fixtures `demo_template` and `demo_box` (tests/conftest.py) wrap these.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from dynctl import deploy as core
from dynctl.cli.common import HostSession, open_host
from dynctl.sim.hostsetup import prepare_demo_host
from sglang_trees import sglang_wheel
from sshd_harness import FakeHost, free_port

CTID = 129


def make_demo_box(sshd: FakeHost, template: Path, tmp_path: Path, version: str = "0.5.9", *, ctid: int = CTID,
                  pct: bool = True, **env: str) -> Path:
    """Copy the prepared `template` into container `ctid` and write a config whose default host `box` is it."""
    ct_root = sshd.make_ct(ctid)
    root = ct_root / f"demo-{tmp_path.name}"
    shutil.copytree(template, root, symlinks=True)
    entry = prepare_demo_host(root, sglang_version=version, port=free_port(),
                              cache_dir=sglang_wheel(version).parent, time_scale=20)
    entry["env"].update(env)
    entry["ssh"] = sshd.target
    if pct:
        entry["pct"] = ctid
    return sshd.write_config(tmp_path / "dynctl.toml", {"box": entry}, default_host="box")


def dynctl(*args: str, config: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynctl", *args, "--config", str(config)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)


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
