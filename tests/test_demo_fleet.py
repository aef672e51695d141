"""`dynctl demo --fleet 3 --no-tui`: three simulated hosts behind a real smg, threshold 5 rolled through it."""

from __future__ import annotations

import json
import os
import signal

import pytest
from polling import alive, wait_for
from demo_box import demo_env, dynctl_in

from dynctl.base.config import load_config

pytestmark = pytest.mark.slow


def test_demo_fleet_rolls_the_threshold_through_a_real_gateway(tmp_path, isolated_home):
    env, data = demo_env(tmp_path, isolated_home)
    pidfile = data / "dynctl" / "demo-fleet" / "smg.pid"
    try:
        out = dynctl_in(env, "demo", "--fleet", "3", "--no-tui", "--time-scale", "20")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "SIMULATED" in out.stdout and "smg gateway on http://127.0.0.1:" in out.stdout
        for name in ("demo-1", "demo-2", "demo-3"):  # read back after the rollout, and in the gateway again
            line = next(ln for ln in out.stdout.splitlines() if ln.startswith(f"{name}: "))
            assert ", threshold 5, ready load" in line, out.stdout
        config = isolated_home / ".config" / "dynctl" / "config.toml"
        cfg = load_config(config)
        assert list(cfg.groups) == ["demo-fleet"] and cfg.groups["demo-fleet"].gateway is not None
        status = dynctl_in(env, "status", "--host", "demo-fleet", "--json")
        assert status.returncode == 0, status.stderr
        assert [r["threshold"] for r in json.loads(status.stdout)["hosts"]] == [5, 5, 5]
        # a second run reuses the fleet and its gateway: nothing to deploy
        again = dynctl_in(env, "demo", "--fleet", "3", "--no-tui", "--time-scale", "20")
        assert again.returncode == 0 and again.stdout.count("unchanged") == 3, again.stdout + again.stderr
    finally:
        for name in ("demo-1", "demo-2", "demo-3"):
            dynctl_in(env, "stop", "--host", name, "--yes", "--grace", "5")
        if pidfile.exists():
            pid = int(pidfile.read_text())
            if alive(pid):
                os.kill(pid, signal.SIGTERM)  # the gateway this test's demo started, by its recorded pid
                wait_for(lambda: not alive(pid), 20, "the demo's gateway to exit")
