"""`dynctl bench` says when the server it measures is slower than production, and what its no-spec row is.

Against the simulated SGLang host (a real `python -m dynctl.sim` process on a real sglang 0.5.9 tree, read by
the real agent): a server started with strict memory checks (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY) or
--enable-nan-detection runs every busy step with checks production servers do not run, and bench reads both
from the server's /proc entry and warns, in its text and its JSON. --compare's no-spec row is threshold 0 on a
speculative server, the patch's disabled path, and is labelled so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_harness import SPEC_ARGS, Sim
from test_bench_cli import make_app, write_config
from test_bench_server import TokenServer
from typer.testing import CliRunner

pytestmark = pytest.mark.slow

SIM_LAUNCH = ["{python}", "-m", "dynctl.sim"]
STRICT = "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"
WARNING = "these numbers are slower than production"
NO_SPEC_NOTE = "no-spec measured as threshold 0 on a speculative server"


def start(site: Path, workdir: Path, *extra: str, env: dict[str, str] | None = None) -> Sim:
    argv = ["--time-scale", "4", "--sim-load-seconds", "0", "--model-path", "/models/sim-truth", "--enable-metrics",
            *SPEC_ARGS, "--speculative-disable-batch-threshold", "5", *extra]
    return Sim(site, argv, workdir, env={"SGLANG_ENABLE_SPEC_V2": "1", **(env or {})}).wait_ready(60)


def bench(tmp_path: Path, port: int, *args: str) -> tuple[str, dict]:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(make_app(), [
        "bench", "--config", str(write_config(tmp_path, port, launch=SIM_LAUNCH)), "--input-len", "16",
        "--output-len", "16", "--duration", "1", "--json", str(out), "--no-chart", *args])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split()), json.loads(out.read_text())


@pytest.fixture(scope="module")
def sims(patched_site_059, tmp_path_factory):  # noqa: F811 - the fixture
    """Four servers: plain, strict memory checks on, NaN detection on, and the check variable set to 0."""
    made = {}
    try:
        for name, extra, env in (("plain", (), {}), ("strict", (), {STRICT: "1"}),
                                 ("nan", ("--enable-nan-detection",), {}), ("strict-off", (), {STRICT: "0"})):
            made[name] = start(patched_site_059, tmp_path_factory.mktemp(name), *extra, env=env)
        yield made
    finally:
        for sim in made.values():
            sim.stop()


@pytest.mark.parametrize("name, checks", [
    ("strict", [("strict memory checks", f"{STRICT}=1 in its environment")]),
    ("nan", [("NaN detection", "--enable-nan-detection on its command line")]),
])
def test_a_server_with_debug_checks_is_named_slower_than_production(sims, name, checks, tmp_path):
    text, doc = bench(tmp_path, sims[name].port, "--concurrency", "1")
    assert [(c["check"], c["source"]) for c in doc["debug_checks"]] == checks
    assert doc["slower_than_production"] is True
    assert WARNING in text and checks[0][0] in text and checks[0][1] in text
    assert text.count(WARNING) == 2  # when the run starts, and again under its tables


@pytest.mark.parametrize("name", ["plain", "strict-off"])
def test_a_server_without_them_gets_no_warning(sims, name, tmp_path):
    text, doc = bench(tmp_path, sims[name].port, "--concurrency", "1")
    assert doc["debug_checks"] == [] and doc["slower_than_production"] is False
    assert "slower than production" not in text and "debug checks" not in text


def test_the_simulator_takes_nan_detection_as_sglang_does(sims):
    info = sims["nan"].client().get("/server_info").json()
    assert info["enable_nan_detection"] is True
    assert sims["plain"].client().get("/server_info").json()["enable_nan_detection"] is False


def test_compare_labels_its_no_spec_baseline_and_the_penalty(sims, tmp_path):
    text, doc = bench(tmp_path, sims["strict"].port, "--concurrency", "1,2", "--compare")
    runs = {r["mode"]: r for r in doc["runs"]}
    assert runs["no-spec"]["measured_as"] == "threshold 0 on a speculative server"
    assert runs["no-spec"]["threshold"] == 0
    assert runs["always-spec"]["measured_as"] is None
    rec = doc["recommendation"]
    assert rec["no_spec_measured_as"] == "threshold 0 on a speculative server"
    assert any(note.startswith(NO_SPEC_NOTE) and "EAGLE3 configured" in note for note in rec["notes"])
    assert rec["measured_with_debug_checks"] == ["strict memory checks"]
    assert NO_SPEC_NOTE in text and "no-spec (measured as threshold 0 on a speculative server)" in text
    assert WARNING in text


def test_without_compare_no_baseline_label(sims, tmp_path):
    text, doc = bench(tmp_path, sims["plain"].port, "--concurrency", "1", "--threshold", "0")
    assert [r["mode"] for r in doc["runs"]] == ["threshold 0"] and doc["runs"][0]["measured_as"] is None
    assert doc["recommendation"] is None and "measured as" not in text


def test_nan_detection_reported_by_server_info_counts_too(tmp_path):
    """A server whose command line does not show the flag (the process bench reads is not the launcher) but
    whose /server_info says enable_nan_detection: warned about all the same."""
    server = TokenServer(interval=0.005)
    server.extra_info = {"enable_nan_detection": True}
    server.start()
    try:
        cfg = write_config(tmp_path, server.port, serves_here=True)
        out = tmp_path / "bench.json"
        result = CliRunner().invoke(make_app(), ["bench", "--config", str(cfg), "--concurrency", "1",
                                                 "--num-prompts", "2", "--input-len", "4", "--output-len", "4",
                                                 "--json", str(out), "--no-chart"])
    finally:
        server.close()
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["debug_checks"] == [{"check": "NaN detection", "source": "enable_nan_detection in its /server_info"}]
    assert WARNING in " ".join(result.output.split())
