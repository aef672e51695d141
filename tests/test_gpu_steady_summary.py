"""steady_summary.py pools a second server of a mode into it (`--same LABEL:MODE`): the mode's step is
the mean over both servers, its spread spans both servers' windows, and the ratio is against the
pooled no-spec servers; a label no call measured is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "steady_summary.py"


def _rows(steps):
    return [{"concurrency": c, "step_ms": sum(w) / len(w), "step_ms_windows": w} for c, w in steps]


def run_summary(script, tmp_path, *args):
    """A summary script over the call folder tmp_path/run, writing tmp_path/out.json."""
    return subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "--version", "0.5.14",
                           "--model", "hidden=2048,layers=24,params_b=1.21", "--out", str(tmp_path / "out.json"),
                           *args], capture_output=True, text=True)


def _run(tmp_path, *args):
    return run_summary(SCRIPT, tmp_path, *args)


def test_a_second_server_of_a_mode_is_pooled_into_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    servers = {"nospec": [(1, [1.0, 1.0]), (16, [2.0, 2.0])], "nospec2": [(1, [1.2, 1.2]), (16, [2.0, 2.2])],
               "t0": [(1, [1.1, 1.1]), (16, [2.1, 2.1])], "patched2": [(1, [1.1, 1.3]), (16, [2.1, 2.1])]}
    for label, steps in servers.items():
        (run / f"steady-{label}.json").write_text(json.dumps(_rows(steps)))
    out = _run(tmp_path, "--same", "nospec2:no_spec", "--same", "patched2:threshold_0")
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    assert summary["levels"] == [1, 16]
    assert summary["step_ms"] == {"no_spec": [1.1, 2.05], "threshold_0": [1.15, 2.1]}
    assert summary["step_spread_pct"]["no_spec"] == [round(100 * 0.2 / 1.1, 1), round(100 * 0.2 / 2.05, 1)]
    assert summary["step_ratio_vs_no_spec"]["threshold_0"] == [round(1.15 / 1.1, 3), round(2.1 / 2.05, 3)]
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert sorted({r["server"] for r in rows["no_spec"]}) == ["nospec", "nospec2"]

    refused = _run(tmp_path, "--same", "nospec3:no_spec")
    assert refused.returncode == 2
    assert "--same nospec3:no_spec: no rows labelled nospec3" in refused.stderr


def test_the_ratio_round_by_round_pairs_each_measurement_with_the_base_one_of_its_round(tmp_path):
    """A level measured four times on each server: the paired ratio is each round's own (a drift
    between rounds that the pooled means would carry into the ratio cancels), its median, range and
    count per level; a level the base did not measure has no pair."""
    run = tmp_path / "run"
    run.mkdir()
    # the machine twice as slow in rounds 2 and 3; the patched server 4 % slower in every round
    base = [(16, [1.0]), (16, [2.0]), (16, [2.0]), (16, [1.0])]
    patched = [(16, [1.04]), (16, [2.08]), (16, [2.08]), (16, [1.04]), (64, [3.0])]
    (run / "steady-nospec.json").write_text(json.dumps(_rows(base)))
    (run / "steady-t0.json").write_text(json.dumps(_rows(patched)))
    out = _run(tmp_path)
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    assert summary["levels"] == [16, 64]
    assert summary["step_ratio_paired_vs_no_spec"]["threshold_0"] == [1.04, None]
    assert summary["step_ratio_paired_range"]["threshold_0"] == [[1.04, 1.04], None]
    assert summary["step_ratio_pairs"]["threshold_0"] == [4, 0]
    assert summary["step_ratio_pairs"]["no_spec"] == [4, 0]
    # the pooled means would not see it: (1.04+2.08+2.08+1.04)/4 over 1.5, the same, but a single
    # slow round of the base moves the means' ratio while the median of pairs stays
    slow_once = [(16, [1.0]), (16, [2.0]), (16, [2.0]), (16, [3.0])]
    (run / "steady-nospec.json").write_text(json.dumps(_rows(slow_once)))
    out = _run(tmp_path)
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    assert summary["step_ratio_vs_no_spec"]["threshold_0"][0] == round(1.56 / 2.0, 3)
    assert summary["step_ratio_paired_vs_no_spec"]["threshold_0"][0] == 1.04
    assert summary["step_ratio_paired_range"]["threshold_0"][0] == [round(1.04 / 3.0, 3), 1.04]


def _log(batch, steps_ms, accept=None):
    """One steady measurement in a server's log: a first line (idle time and prefill in it), then one
    line per 40-step interval at the given step times."""
    lines, tokens = [], batch * 16
    for ms in [50.0] + steps_ms:
        tokens += 40 * batch
        acc = f"accept len: {accept:.2f}, accept rate: 0.00, " if accept else ""
        lines.append(f"[2026-12-05 15:57:56] Decode batch, #running-req: {batch}, #token: {tokens}, token usage: 0.00, "
                     f"{acc}cuda graph: True, gen throughput (token/s): {1000 * batch / ms:.2f}, #queue-req: 0")
    return "\n".join(lines) + "\n"


def test_the_servers_own_log_intervals_give_the_step_and_its_ratio_measurement_by_measurement(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "steady-nospec.json").write_text(json.dumps(_rows([(16, [1.0]), (16, [2.0])])))
    (run / "steady-t0.json").write_text(json.dumps(_rows([(16, [1.0]), (16, [2.0])])))
    # the no-spec server's second measurement on a slow core; the patched one 3 % slower in each
    (run / "nospec.log").write_text(_log(16, [1.0, 1.0, 1.0]) + _log(16, [2.0, 2.0, 2.0, 2.0])
                                    + _log(8, [9.0, 9.0]))  # too short to be a measurement
    (run / "patched.log").write_text(_log(16, [1.03, 1.03, 1.03], accept=1.0) + _log(16, [2.06, 2.06, 2.06], 1.0))
    out = _run(tmp_path)
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    assert summary["step_ms_log"] == {"no_spec": [2.0], "threshold_0": [1.545]}
    assert summary["step_ratio_log_paired_vs_no_spec"]["threshold_0"] == [1.03]
    assert summary["step_ratio_log_paired_range"]["threshold_0"] == [[1.03, 1.03]]
