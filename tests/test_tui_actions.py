"""The dashboard's keys and the CLI run the same core commands: against one demo host, each does and says the same."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest
from demo_box import dynctl, server_info, server_pid, session
from polling import wait_for
from textual.widgets import Input
from tui_harness import PushFeed

from dynctl.base.config import load_config
from dynctl.actions.host import actions_for
from dynctl.core.lifecycle import server_argv
from dynctl.tui.app import DynctlApp, create_app
from dynctl.tui.widgets import ActionLog

pytestmark = pytest.mark.slow


def dashboard(config: Path) -> DynctlApp:
    """The TUI on host `box` with the product's actions; its feed stays quiet (the keys are the subject)."""
    cfg = load_config(config)
    return create_app(["box"], lambda on_update: PushFeed(["box"], on_update), actions_for(cfg, [cfg.host("box")]))


def threshold_now(config: Path) -> int | None:
    return ((server_info(config) or {}).get("internal_states") or [{}])[0].get("speculative_disable_batch_threshold")


async def press(app: DynctlApp, pilot, *keys: str) -> str:
    """Press `keys`, wait for the action they start, return the last line it wrote (without clock and host)."""
    log = app.dashboard.query_one(ActionLog)
    before = len(log.lines_written)
    await pilot.press(*keys)
    await app.workers.wait_for_complete()
    await pilot.pause()
    assert len(log.lines_written) > before, f"{keys}: nothing written"
    return log.lines_written[-1].split(" box ", 1)[1]


def outcome(proc: subprocess.CompletedProcess) -> str:
    """The CLI's last line: the same sentence the panel shows, with its own way of adding the time taken."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def without_uptime(line: str) -> str:
    return re.sub(r", up \d+ s", "", line)


@pytest.mark.asyncio
async def test_keys_change_the_threshold_and_restart_the_server(demo_box) -> None:
    config = demo_box(via="local")
    deployed = dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    pid_before = server_pid(config)
    app = dashboard(config)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("t")
        app.screen.query_one(Input).value = "9"
        assert await press(app, pilot, "enter") == "threshold 9 in force on box (read back from /server_info)"
        assert threshold_now(config) == 9

        restarted = await press(app, pilot, "R", "y")
        assert re.fullmatch(r"restarted the server on box: pid \d+ ready \(\d+\.\d s\)", restarted), restarted
    assert server_pid(config) not in (None, pid_before)
    assert threshold_now(config) == 5  # a restart runs the release's recorded argv again: the deployed threshold


@pytest.mark.asyncio
async def test_a_hand_started_server_meets_the_same_decisions_from_keys_and_commands(demo_box) -> None:
    """Restart, start while running and stop while stopped: the key and the command decide and say alike. A
    server started by hand is the operator's: the key and `restart --yes` both refuse it (the key has no word
    for a takeover); `restart --yes --adopt` takes it over."""
    config = demo_box(via="local")
    host = session(config).host
    env = {**os.environ, **{k: v.replace("${PATH}", os.environ["PATH"]) for k, v in host.env.items()}}
    by_hand = subprocess.Popen(server_argv(host), env=env, cwd=host.workdir, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: _serves(host.port), 60, "the hand-started server to answer")
        app = dashboard(config)
        async with app.run_test(size=(120, 40)) as pilot:
            refused_by_key = await press(app, pilot, "R", "y")
            assert f"restart refused: the server on the port is pid {by_hand.pid}, not started by dynctl" in \
                refused_by_key and "--adopt" in refused_by_key, refused_by_key
            refused = dynctl("restart", "--yes", config=config)
            assert refused.returncode == 3 and f"pid {by_hand.pid}, not started by dynctl" in refused.stderr
            assert by_hand.poll() is None  # neither touched it
            taken = outcome(dynctl("restart", "--yes", "--adopt", config=config))
            assert re.fullmatch(r"restarted the server on box: pid \d+ ready, \d+\.\d s", taken), taken
            wait_for(lambda: by_hand.poll() is not None, 30, "the hand-started server to exit")
            by_key = await press(app, pilot, "R", "y")
            assert re.fullmatch(r"restarted the server on box: pid \d+ ready \(\d+\.\d s\)", by_key), by_key
            by_command = outcome(dynctl("restart", "--yes", config=config))
            assert re.fullmatch(r"restarted the server on box: pid \d+ ready, \d+\.\d s", by_command), by_command

            running = outcome(dynctl("start", "--yes", config=config))
            assert running.startswith(f"✓ server on box is already running: ready, pid {server_pid(config)} ")
            assert without_uptime("✓ " + await press(app, pilot, "S")) == without_uptime(running)

            stopped = await press(app, pilot, "s", "y")
            assert stopped.startswith("stopped the server on box (pid ")
            assert server_pid(config) is None
            again = await press(app, pilot, "s", "y")
            assert again == "server on box is already stopped"
            assert outcome(dynctl("stop", "--yes", config=config)) == "✓ " + again
    finally:
        if by_hand.poll() is None:
            by_hand.kill()
        by_hand.wait(10)


def _serves(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
