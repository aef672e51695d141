"""End to end: the dashboard on the demo host over SSH + pct, while real load crosses the threshold.

real sshd → pct stand-in → the simulated sglang 0.5.9 server (deployed with threshold 5 by `dynctl deploy`)
← the agent's `watch` verb ← LiveFeed ← the Textual app under Pilot. Streams are opened against the server's
/generate; the speculation indicator must turn OFF while more than 5 run, and ON again after.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from demo_box import dynctl

from dynctl.base.config import load_config
from dynctl.live.feed import LiveFeed
from dynctl.actions.host import actions_for
from dynctl.tui.app import create_app
from dynctl.tui.widgets import HeaderBar, LoadPanel, SpeculationPanel

pytestmark = pytest.mark.slow


@pytest.fixture
def demo_config(demo_box) -> Path:
    """A demo host in pct container 129, deployed with threshold 5."""
    config = demo_box()
    deployed = dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    return config


class Load:
    """Concurrent streaming /generate requests, each re-opened until its own stop; `ramp_down` ends them
    one by one, as load leaves a real server (so the batch passes through every size on the way down)."""

    def __init__(self, port: int, streams: int) -> None:
        self.port = port
        self.stops = [threading.Event() for _ in range(streams)]
        self.threads = [threading.Thread(target=self._run, args=(e,), daemon=True) for e in self.stops]

    def _run(self, stop: threading.Event) -> None:
        body = {"text": "Tell me about speculative decoding.", "stream": True,
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                with client.stream("POST", f"http://127.0.0.1:{self.port}/generate", json=body) as resp:
                    for _ in resp.iter_lines():
                        if stop.is_set():
                            break  # closing the stream aborts the request on the server

    def ramp_down(self, keep: int) -> None:
        """End streams one by one until `keep` still run."""
        for stop, thread in list(zip(self.stops, self.threads))[:max(0, len(self.stops) - keep)]:
            stop.set()
            thread.join(30)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for stop in self.stops:
            stop.set()
        for t in self.threads:
            t.join(30)


@pytest.mark.asyncio
async def test_indicator_flips_off_under_load_and_back_on(demo_config: Path) -> None:
    cfg = load_config(demo_config)
    host = cfg.host("box")
    app = create_app(["box"], lambda on_update: LiveFeed([host], on_update, config=cfg, interval=0.5),
                     actions_for(cfg, [host]))

    async with app.run_test(size=(100, 30)) as pilot:
        spec = app.dashboard.query_one(SpeculationPanel)

        async def wait_until(check, what: str, timeout: float = 60.0) -> None:
            deadline = time.monotonic() + timeout
            while not check():
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what} within {timeout} s; screen: {spec.text()!r} "
                                         f"{app.dashboard.query_one(LoadPanel).text()!r}")
                await pilot.pause(0.1)

        await wait_until(lambda: "READY" in app.dashboard.query_one(HeaderBar).text(), "server ready")
        header = app.dashboard.query_one(HeaderBar).text()
        assert "box (simulated)" in header and "sglang 0.5.9" in header and "patch" in header
        assert "thr 5" in app.dashboard.query_one(LoadPanel).text()
        await wait_until(lambda: "SPECULATION ON" in spec.text(), "speculation on while idle")

        with Load(host.port, streams=12) as load:
            # the switch shown must be the log's line of the flip, which brings the batch
            await wait_until(lambda: "SPECULATION OFF" in spec.text() and "> threshold 5" in spec.text(),
                             "speculation off under 12 streams, with the batch the log gave")
            snap = app.latest["box"]
            assert snap is not None and snap.running_reqs is not None and snap.running_reqs > 5
            assert snap.last_switch is not None and snap.last_switch.enabled is False
            assert snap.last_switch.source == "log" and snap.last_switch.batch_size > 5
            # three streams stay, so the server steps at a batch under the threshold and logs the switch
            # back on (an idle server shows ON too, for the next request, but no step switched it)
            ramp = threading.Thread(target=load.ramp_down, args=(3,), daemon=True)
            ramp.start()
            await wait_until(lambda: "SPECULATION ON" in spec.text() and "≤ threshold 5" in spec.text(),
                             "speculation back on, from a step, as the load leaves")
        history = app.histories["box"]
        assert history is not None
        kinds = [s.enabled for s in history.switches()]
        assert False in kinds and kinds[-1] is True  # the chart has both moments to mark
        await pilot.press("q")
    assert app.return_code == 0
