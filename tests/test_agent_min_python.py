"""The agent on its oldest interpreter, Python 3.9 (README: "Host Python"): Debian 12's pypy3 speaks 3.9.

The upload byte-compiles every module of the archive with the host's own interpreter and refuses when one
does not compile, so a real upload and a few verbs through it are the check, not a grep for syntax.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dynctl.agent import archive
from dynctl.agent.client import AgentClient
from dynctl.base.config import HostConfig
from dynctl.transport.local import Local

MIN_PYTHON = (3, 9)


@pytest.fixture(scope="module")
def oldest_python() -> str:
    exe = shutil.which("pypy3")
    if exe is None:
        pytest.fail("pypy3 not found: apt-get install -y pypy3 (the agent's oldest supported Python, 3.9)")
    version = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert tuple(int(p) for p in version.split(".")) == MIN_PYTHON, f"{exe} is Python {version}"
    return exe


def test_the_agent_installs_and_answers_on_python_3_9(oldest_python, tmp_path):
    agent = AgentClient(Local(), HostConfig(name="old", python=oldest_python, workdir=str(tmp_path / "work"),
                                            port=1))
    assert agent.call("ping")["pong"] is True  # uploaded, compiled by 3.9, run by 3.9
    info = agent.call("inspect")
    assert info["python_version"].startswith("3.9.") and info["sglang"] is None
    assert agent.call("server_find")["state"] == "down"
    assert agent.call("releases")["releases"] == []
    root = tmp_path / "work" / "agent" / archive.agent_digest()
    tag = subprocess.run([oldest_python, "-c", "import sys; print(sys.implementation.cache_tag)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    compiled = {p.name.split(".")[0] for p in root.glob(f"**/__pycache__/*.{tag}.pyc")}
    assert compiled == {Path(name).stem for name in archive.agent_files()}


def test_every_agent_module_imports_on_python_3_9(oldest_python):
    """Modules a verb loads lazily are imported too: a 3.10-only construct anywhere fails here."""
    from dynctl_agent import verbs

    modules = sorted({entry[0] for entry in {**verbs.VERBS, **verbs.OPS}.values()}
                     | {Path(n).stem for n in archive.agent_files() if n.startswith("dynctl_agent/")} - {"__main__"})
    code = ("import importlib, json, sys\nsys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
            "print(json.dumps([importlib.import_module('dynctl_agent.' + m).__name__ for m in sys.argv[3:]]))\n")
    client = str(Path(importlib.import_module("dynctl").__file__).parent.parent)
    proc = subprocess.run([oldest_python, "-c", code, str(archive.remote_dir()), client, *modules],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["dynctl_agent." + m for m in modules]
    assert sys.version_info[:2] > MIN_PYTHON  # the suite itself runs on a newer one
