"""The agent's HTTP to the server on its host never goes through a proxy the host's environment names."""

from __future__ import annotations

import socket

import pytest

from dynctl.core import deploy as core


@pytest.fixture
def dead_proxy(monkeypatch: pytest.MonkeyPatch) -> str:
    """http_proxy (both spellings) at a port where nothing listens, and no no_proxy: as on a host whose
    profile sets a corporate proxy for pip."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = "http://127.0.0.1:%d" % s.getsockname()[1]
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(name, url)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    return url


def test_deploy_threshold_and_bench_ignore_a_dead_http_proxy(local_demo, dead_proxy):
    agent, host = local_demo.agent, local_demo.host
    result = core.deploy(agent, core.plan_deploy(agent, host, 5), ready_timeout=60, soak=0)
    assert result["threshold_in_force"] == 5  # read back from /server_info, not rolled back

    assert core.set_threshold(agent, 7)["in_force"] == 7  # read back too

    probe = agent.call("bench_probe")
    assert probe["reachable"] is True and probe["threshold"] == 7 and probe["metrics"] is True
    items = list(agent.stream("bench_level", concurrency=1, input_len=8, output_len=4, num_prompts=2, warmup=0))
    level = items[-1]
    assert level["type"] == "level" and len(level["records"]) == 2 and level["failed"] == 0
    assert level["samples"], "the /metrics samples of the level"
