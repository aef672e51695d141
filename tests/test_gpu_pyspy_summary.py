"""pyspy_summary.py turns py-spy's raw samples of a scheduler into CPU microseconds per decode step: a
steady level's file by the steps its row records, a closed-loop level's file (round 0) by its first
window's decode steps scaled to the seconds sampled, each compared with the base mode of its own kind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "pyspy_summary.py"

STEP = "Scheduler.run_batch (scheduler.py:10);TpModelWorker.forward_batch_generation (tp_worker.py:20)"
SYNC = "Scheduler.run_batch (scheduler.py:10);Event.synchronize (torch/cuda/streams.py:5)"
PLAIN = ("Scheduler.run_batch (scheduler.py:10);EAGLEWorkerV2._spec_disable_target_decode "
         "(eagle_worker_v2.py:30)")


def _samples(path: Path, *rows: tuple[str, int]) -> None:
    path.write_text("".join(f"{stack} {n}\n" for stack, n in rows))


def _closed_row(label, c, rnd, seconds, step_ms, decode_steps=None, sampled=None):
    window = {"seconds": seconds, "step_ms": step_ms}
    if decode_steps is not None:
        window["decode_steps"] = decode_steps
    row = {"concurrency": c, "label": label, "round": rnd, "windows": [window, dict(window)]}
    if sampled is not None:
        row["sampled"] = sampled
    return row


def _run(run: Path, *args):
    out = subprocess.run([sys.executable, str(SCRIPT), str(run), "--json", str(run / "out.json"), *args],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads((run / "out.json").read_text()), out.stdout


def test_steady_and_closed_loop_samples_per_decode_step(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # steady c16: 500 steps recorded by the row itself
    (run / "steady-nospec.json").write_text(json.dumps(
        [{"concurrency": 16, "sampled": {"out": "/device/results/pyspy-nospec-c16.txt", "steps": 500}}]))
    _samples(run / "pyspy-nospec-c16.txt", (STEP, 400), (SYNC, 100))
    # closed loop c64: rows of an older run (no decode_steps, no sampled): 1.0 s / 2.5 ms = 400 steps;
    # round 1 is not the sampled round and must not count
    (run / "closed-nospec.json").write_text(json.dumps(
        [_closed_row("nospec", 64, 0, 1.0, 2.5), _closed_row("nospec", 64, 1, 1.0, 5.0)]))
    # a newer row: 350 steps counted in a 1.0 s window, py-spy sampled 2 s of it -> 700 steps
    (run / "closed-t0.json").write_text(json.dumps(
        [_closed_row("t0", 64, 0, 1.0, 2.9, decode_steps=350,
                     sampled={"out": "/device/results/pyspy-closed-t0-c64.txt", "seconds": 2})]))
    _samples(run / "pyspy-closed-nospec-c64.txt", (STEP, 600))
    _samples(run / "pyspy-closed-t0-c64.txt", (PLAIN, 1050), (SYNC, 350))
    report, stdout = _run(run)

    steady = report["c16"]["nospec"]
    assert steady["steps_sampled"] == 500
    assert steady["cpu_us_per_step"] == 1000.0  # 500 samples of 1 ms over 500 steps

    base = report["c64"]["closed-nospec"]
    assert base["steps_sampled"] == 400
    assert base["cpu_us_per_step"] == 1500.0
    t0 = report["c64"]["closed-t0"]
    assert t0["steps_sampled"] == 700
    assert t0["cpu_us_per_step"] == 2000.0
    # compared with the closed loop's no-spec file, not with a steady one
    diff = t0["vs_closed-nospec"]
    assert diff["EAGLEWorkerV2._spec_disable_target_decode (eagle_worker_v2.py)"] == 1500.0
    assert diff["TpModelWorker.forward_batch_generation (tp_worker.py)"] == -1500.0
    assert "c64 closed-t0: 2000.0 us of scheduler CPU per step (700 steps)" in stdout

    busy, _ = _run(run, "--busy")
    assert busy["c64"]["closed-t0"]["cpu_us_per_step"] == 1500.0  # the 350 samples in synchronize left out


def test_a_closed_base_named_in_full_is_taken_as_it_is(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "closed-nospec.json").write_text(json.dumps([_closed_row("nospec", 16, 0, 1.0, 2.0)]))
    (run / "closed-t0.json").write_text(json.dumps([_closed_row("t0", 16, 0, 1.0, 2.0)]))
    _samples(run / "pyspy-closed-nospec-c16.txt", (STEP, 500))
    _samples(run / "pyspy-closed-t0-c16.txt", (STEP, 600))
    report, _ = _run(run, "--base", "closed-nospec")
    assert report["c16"]["closed-t0"]["vs_closed-nospec"] == {
        "Scheduler.run_batch (scheduler.py)": 200.0, "TpModelWorker.forward_batch_generation (tp_worker.py)": 200.0}
