"""`dynctl demo` for real, in tmux: the screen shows speculation turning OFF under load and ON again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sglang_trees import sglang_wheel
from sshd_harness import free_port

pytestmark = pytest.mark.slow

TMUX = shutil.which("tmux")


def screen(env: dict[str, str], session: str) -> str:
    out = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True, env=env)
    return out.stdout


def wait_for(env: dict[str, str], session: str, predicate, what: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = screen(env, session)
        if predicate(text):
            return text
        time.sleep(0.2)  # polling the screen for a condition, with a deadline
    raise AssertionError(f"the screen never showed {what}; last screen:\n{text}")


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (apt-get install tmux)")
def test_demo_in_tmux_shows_speculation_switching(tmp_path, isolated_home):
    data = tmp_path / "data"
    cache = data / "dynctl" / "demo" / "cache"
    cache.mkdir(parents=True)
    wheel = sglang_wheel("0.5.9")
    shutil.copy(wheel, cache / wheel.name)
    env = dict(os.environ, HOME=str(isolated_home), XDG_DATA_HOME=str(data), TMUX_TMPDIR=str(tmp_path),
               TERM="xterm-256color")
    env.pop("DYNCTL_CONFIG", None)
    port = free_port()
    session = "dynctl-demo"
    command = (f"{sys.executable} -m dynctl demo --port {port} --level-seconds 2; "
               f"echo DEMO-EXITED-$?; sleep 600")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", command],
                   check=True, env=env)
    try:
        wait_for(env, session, lambda t: "SPECULATION" in t and "(simulated)" in t, "the dashboard", 180)
        wait_for(env, session, lambda t: "> threshold 5" in t, "speculation OFF above threshold 5", 120)
        wait_for(env, session, lambda t: "≤ threshold 5" in t, "speculation ON again at or below 5", 120)
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True, env=env)
        done = wait_for(env, session, lambda t: "DEMO-EXITED-" in t, "the demo exiting", 30)
        assert "DEMO-EXITED-0" in done
        assert "dynctl stop --host demo --yes" in done
    finally:
        subprocess.run(["tmux", "kill-server"], env=env, capture_output=True)
        subprocess.run([sys.executable, "-m", "dynctl", "stop", "--host", "demo", "--yes", "--grace", "5"],
                       env=env, capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    assert Path(isolated_home, ".config", "dynctl", "config.toml").is_file()
