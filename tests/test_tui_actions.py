"""The dashboard's keys drive the real core: live threshold and restart against a demo host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from textual.widgets import Input

from dynctl.config import load_config
from dynctl.feed import LiveFeed
from dynctl.host_actions import actions_for
from dynctl.sim.hostsetup import prepare_demo_host
from dynctl.transport import close_all
from dynctl.tui.app import create_app
from dynctl.tui.widgets import ActionLog
from sglang_trees import sglang_wheel
from sshd_harness import free_port, toml_value


def dynctl(*args: str, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynctl", *args, "--config", str(config)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)


@pytest.fixture
def deployed(tmp_path: Path):
    entry = prepare_demo_host(tmp_path / "demo", port=free_port(), cache_dir=sglang_wheel("0.5.9").parent,
                              time_scale=20)
    config = tmp_path / "dynctl.toml"
    config.write_text("[hosts.demo]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in entry.items()))
    out = dynctl("deploy", "--threshold", "5", "--yes", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        yield config
    finally:
        close_all()
        dynctl("stop", "--yes", "--grace", "5", config=config)


def server_state(config: Path) -> tuple[int | None, int | None]:
    from dynctl.cli.common import open_host

    s = open_host("demo", str(config))
    info = s.agent.call("server_info")["info"] or {}
    pid = s.agent.call("server_find").get("pid")
    return pid, (info.get("internal_states") or [{}])[0].get("speculative_disable_batch_threshold")


def lines(log: ActionLog) -> list[str]:
    return [strip.text.rstrip() for strip in log.lines]


@pytest.mark.asyncio
async def test_keys_change_the_threshold_and_restart_the_server(deployed: Path) -> None:
    cfg = load_config(deployed)
    hosts = [cfg.host("demo")]
    app = create_app(["demo"], lambda on_update: LiveFeed(hosts, on_update, config=cfg, interval=0.5),
                     actions=actions_for(cfg, hosts))
    pid_before, _ = server_state(deployed)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("t")
        app.screen.query_one(Input).value = "9"
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "threshold in force: 9" in lines(app.dashboard.query_one(ActionLog))[-1]
        assert server_state(deployed)[1] == 9

        await pilot.press("R", "y")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "restart done" in lines(app.dashboard.query_one(ActionLog))[-1]
    pid_after, threshold = server_state(deployed)
    assert pid_after not in (None, pid_before)
    assert threshold == 5  # a restart runs the release's recorded argv again: the deployed threshold


def test_bench_progress_reads_as_one_line_per_level() -> None:
    from dynctl.bench.events import LevelDone, LevelProgress, LevelStarted
    from dynctl.bench.plan import Mode
    from dynctl.host_actions import _relay_bench
    from dynctl.tui.actions import describe_event

    out: list = []
    _relay_bench(LevelStarted(Mode.no_spec(), 4, 2, 7), out.append)
    _relay_bench(LevelProgress(Mode.no_spec(), 4, "measure", 1.0, 0.5, 3, 0, 4.0), out.append)
    _relay_bench(LevelDone(Mode.no_spec(), {"max_concurrency": 4, "output_throughput": 512.3, "median_ttft_ms": 12.0,
                                            "server": {"spec_on_share": 0.0, "mean_batch_size": 4.0}}), out.append)
    assert [describe_event(e)[1] for e in out] == [
        "▶ no-spec c=4 — level 2/7",
        "no-spec c=4: 512 tok/s, TTFT p50 12 ms, batch 4.0, speculation 0% of steps",
    ]
