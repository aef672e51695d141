"""trim_run.py leaves a call folder's server logs and metrics snapshots in its results tarball only, where
the tarball holds them byte for byte, and closed_summary.py reads the same counters from the tarball."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

from test_gpu_closed_summary import SCRIPT as CLOSED, _server
from test_gpu_steady_summary import run_summary

TRIM = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "trim_run.py"


def _call_folder(tmp_path: Path) -> Path:
    """A call folder as unpacked from its tarball: two servers' closed loop, their logs; then one log the
    tarball does not hold as it is (appended to after the tarball was made)."""
    run = tmp_path / "run"
    run.mkdir()
    _server(run, "nospec", "prefill_cuda_graph", [8000, 9000], (5, 1.0, 10, 2.0, 10), (15, 1.5, 30, 4.0, 30))
    _server(run, "t0", "prefill_none", [7000, 8000], (3, 0.5, 10, 1.0, 10), (8, 1.7, 30, 4.6, 30))
    for label in ("nospec", "t0"):
        (run / f"{label}.log").write_text(f"[{label}] server log\n" * 50)
    with tarfile.open(run / "results-profile-0.5.17.tar.gz", "w:gz") as tar:
        for path in sorted(run.iterdir()):
            if path.suffix != ".gz":
                tar.add(path, arcname=f"results/{path.name}")
    with (run / "t0.log").open("a") as f:
        f.write("a line the tarball does not have\n")
    return run


def _trim(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TRIM), *args], capture_output=True, text=True)


def test_the_bulky_copies_go_and_the_summary_reads_the_tarball(tmp_path):
    run = _call_folder(tmp_path)
    before = run_summary(CLOSED, tmp_path)
    assert before.returncode == 0, before.stderr
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    assert summary["prefill_passes"]["no_spec"] == [{"prefill_cuda_graph": 10}]  # the counters were read

    trimmed = _trim(str(run))
    assert trimmed.returncode == 0, trimmed.stderr
    left = sorted(p.name for p in run.iterdir())
    assert left == ["closed-nospec.json", "closed-t0.json", "results-profile-0.5.17.tar.gz", "t0.log"], left
    assert "a line the tarball does not have" in (run / "t0.log").read_text()  # not the tarball's bytes: kept
    assert "removed" in trimmed.stdout and "bytes freed" in trimmed.stdout

    after = run_summary(CLOSED, tmp_path)
    assert after.returncode == 0, after.stderr
    assert json.loads((tmp_path / "out.json").read_text())["summary"] == summary


def test_a_dry_run_removes_nothing_and_a_folder_without_a_tarball_is_refused(tmp_path):
    run = _call_folder(tmp_path)
    names = sorted(p.name for p in run.iterdir())
    dry = _trim(str(run), "--dry-run")
    assert dry.returncode == 0 and "would remove" in dry.stdout and sorted(p.name for p in run.iterdir()) == names
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "nospec.log").write_text("log\n")
    refused = _trim(str(run), str(bare))
    assert refused.returncode == 2 and f"no results-*.tar.gz in {bare}" in refused.stderr
    assert (bare / "nospec.log").exists() and sorted(p.name for p in run.iterdir()) == names  # nothing touched
