"""The simulator's step-cost table is what benchmarks/gpu/sim_table.py makes of the committed GPU results."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu" / "sim_table.py"
RESULTS = ROOT / "benchmarks" / "gpu" / "results" / "0.5.12.post1.json"
# disabled steps per step on the same 5.9 B shape, measured with the current patch
STEADY = ROOT / "benchmarks" / "gpu" / "results" / "0.5.12.post1-5.9b-steady.json"
TABLE = ROOT / "dynctl" / "sim" / "gpu_table.json"


def sim_table(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def test_the_committed_table_is_the_scripts_output_for_the_committed_results(tmp_path):
    out = tmp_path / "table.json"
    done = sim_table(RESULTS, "--steady", STEADY, "--out", out)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == TABLE.read_text()
    assert sim_table(RESULTS, "--steady", STEADY, "--check").returncode == 0
    # without the steady file the disabled rows are the older closed-loop sweep's: not the committed table
    assert sim_table(RESULTS, "--check").returncode == 1


def test_check_reports_a_stale_table(tmp_path):
    stale = tmp_path / "table.json"
    stale.write_text(TABLE.read_text().replace('"date": "2026-11-30"', '"date": "2026-11-29"'))
    done = sim_table(RESULTS, "--steady", STEADY, "--check", "--out", stale)
    assert done.returncode == 1 and "is not what" in done.stderr and "run without --check" in done.stderr


def test_the_table_says_where_it_comes_from_and_what_its_columns_mean():
    table = json.loads(TABLE.read_text())
    source = table["source"]
    assert source["results"] == "benchmarks/gpu/results/0.5.12.post1.json"
    assert source["run"] == "benchmarks/gpu/results/runs/2026-11-30-4-early-verify-final"
    assert source["date"] == "2026-11-30" and source["sglang"] == "0.5.12.post1"
    assert source["gpu"].startswith("1 x NVIDIA H200") and "5.9 B" in source["model"]["target"]
    assert source["recommended_threshold"] == 8 and "--speculative-num-steps" in source["flags"]
    assert table["workload"] == {"prompt_tokens_mean": 65.031, "new_tokens": 128}
    assert {kind: t["sweep"] for kind, t in table["kinds"].items()} == {
        "plain": "nospec", "speculate": "eagle3", "skip": "nospec x steady threshold_0/no_spec"}
    steady = source["steady"]
    assert steady["results"] == "benchmarks/gpu/results/0.5.12.post1-5.9b-steady.json"
    assert steady["runs"] == ["2026-12-01-9-lean-plain-step-5.9b-0.5.12"]
    assert (steady["model"]["hidden"], steady["model"]["layers"]) == (4096, 32)
    plain = {r["batch"]: r["decode_ms"] for r in table["kinds"]["plain"]["rows"]}
    for row in table["kinds"]["skip"]["rows"]:
        assert row["decode_ms"] == pytest.approx(plain[row["batch"]] * row["step_ratio"], abs=1e-4)
    for kind in table["kinds"].values():
        assert [r["batch"] for r in kind["rows"]] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
        for row in kind["rows"]:
            assert set(row) <= set(table["columns"])


def test_the_table_says_which_releases_are_patched_measured_unmeasured_or_native():
    releases = json.loads(TABLE.read_text())["releases"]
    assert releases["patched"]["0.5.8"] == releases["patched"]["0.5.10"] == "patched, measured on a GPU"
    for version in ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"):
        assert releases["patched"][version].startswith("patched, not measured on a GPU (only with strategy")
    for version in ("0.5.6", "0.5.7"):
        assert releases["patched"][version].startswith('patched, not measured on a GPU (strategy = "auto" takes it')
    for version in ("0.5.12", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17"):
        assert releases["patched"][version].startswith("patched, measured on a GPU; short of a target: ")
        assert "1.2 B" in releases["patched"][version]
    assert "0.5.24" not in releases["patched"] and "native adaptive speculation" in releases["native"]


def test_a_results_file_without_its_run_directory_is_refused(tmp_path):
    lonely = tmp_path / "0.5.12.post1.json"
    shutil.copy(RESULTS, lonely)
    done = sim_table(lonely, "--out", tmp_path / "t.json")
    assert done.returncode == 2
    assert f"{lonely}: no run directory under {tmp_path / 'runs'}" in done.stderr
    assert not (tmp_path / "t.json").exists()
