"""The GPU benchmark's bookkeeping: one call's rows per result file, stamped with their run, release and shape.

phase.py (the device side) is imported here with its results folder in a temporary directory: a call
starts from an empty results folder and fresh server logs, and stamps every sweep row; summarize.py runs
as the script it is on returned folders built like the device's, and refuses one that mixes calls,
releases or model shapes.
"""

from __future__ import annotations

import importlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEVICE = ROOT / "benchmarks" / "gpu" / "device"
SUMMARIZE = ROOT / "benchmarks" / "gpu" / "summarize.py"
RUNS = ROOT / "benchmarks" / "gpu" / "results" / "runs"
LEVELS = (1, 2, 4)
LABELS = ("nospec", "eagle3", "skip-t0", "warm-tm1", "skip-t8")
BIG = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "inter": 11008, "vocab": 32000}
SMALL = {"hidden": 2048, "layers": 24, "heads": 16, "kv_heads": 4, "inter": 5632, "vocab": 32000}
BIG_SHAPE = "hidden=4096,layers=32,heads=32,kv_heads=8,inter=11008,vocab=32000"


@pytest.fixture
def phase(tmp_path, monkeypatch):
    """benchmarks/gpu/device/phase.py with $GPU_ENV and $OUT in tmp_path."""
    env, out = tmp_path / "gpuenv", tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("GPU_ENV", str(env))
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.delenv("GPU_MODEL_ARGS", raising=False)
    monkeypatch.syspath_prepend(str(DEVICE))
    for name in ("phase", "client", "runinfo"):
        sys.modules.pop(name, None)
    module = importlib.import_module("phase")
    yield module
    for name in ("phase", "client", "runinfo"):
        sys.modules.pop(name, None)


def shape(dims: dict) -> dict:
    sys.path.insert(0, str(DEVICE))
    try:
        import runinfo
    finally:
        sys.path.remove(str(DEVICE))
    return dict(dims, params_b=runinfo.params_b(**dims))


def row(c: int, tok_s: float, step_ms: float) -> dict:
    return {"concurrency": c, "tok_s": tok_s, "spread_pct": 1.0, "step_ms": step_ms, "tokens_per_step": 1.0,
            "spec_share": 1.0, "errors": 0, "windows": [{"seconds": 1.2}]}


def sweeps(run_id: str | None, sglang: str = "0.5.12.post1", model: dict | None = None, scale: float = 1.0,
           labels=LABELS) -> dict:
    """{label: rows} as phase.py writes them (stamped unless run_id is None)."""
    out = {}
    for i, label in enumerate(labels):
        rows = [row(c, scale * (100.0 * c + i), 4.0 + i + c / 100) for c in LEVELS]
        if run_id is not None:
            rows = [dict(r, run_id=run_id, phase="speed", sglang=sglang, model=model or shape(BIG)) for r in rows]
        out[label] = rows
    return out


def returned(folder: Path, *files: tuple[str, dict], tar_run: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, doc in files:
        (folder / name).write_text(json.dumps(doc))
    if tar_run is not None:
        with tarfile.open(folder / "results-speed-0.5.12.post1.tar.gz", "w:gz") as t:
            data = json.dumps(tar_run).encode()
            info = tarfile.TarInfo("results/run.json")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return folder


def summarize(folder: Path, out: Path, *extra: str, version: str = "0.5.12.post1",
              threshold: int = 8) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SUMMARIZE), str(folder), "--version", version, "--threshold",
                           str(threshold), "--draft-mode", "skip", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=60)


def test_one_run_is_summarized_with_step_ms_and_the_model_shape(tmp_path):
    run = {"run_id": "20261201T080000Z-11", "phase": "speed", "sglang": "0.5.12.post1", "model": shape(SMALL)}
    folder = returned(tmp_path / "r", ("sweeps-speed-0.5.12.post1.json", sweeps(run["run_id"], model=shape(SMALL))),
                      tar_run=run)
    done = summarize(folder, tmp_path / "res.json")
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "res.json").read_text())
    summary = doc["summary"]
    assert summary["concurrency"] == list(LEVELS)
    assert set(summary["step_ms"]) == set(summary["tok_s"]) == {
        "no_spec", "eagle3", "threshold_0", "threshold_-1", "threshold_N"}
    assert summary["step_ms"]["no_spec"] == [4.01, 4.02, 4.04]
    assert summary["step_ms"]["threshold_0"] == [6.01, 6.02, 6.04]  # skip-t0, the third label
    assert summary["model"] == dict(shape(SMALL), source="config.json")
    assert 1.0 < summary["model"]["params_b"] < 1.5
    assert doc["run_id"] == run["run_id"]
    assert "hidden 2048, 24 layers, 16/4 heads" in doc["model"]["target"]


@pytest.mark.parametrize("files, fragment", [
    ([("sweeps-speed-0.5.12.post1.json", sweeps("A-1", labels=LABELS[:3])),
      ("sweeps-more-0.5.12.post1.json", sweeps("B-2", labels=LABELS[3:]))], "rows of 2 run ids"),
    ([("sweeps-speed-0.5.12.post1.json", dict(sweeps("A-1", labels=LABELS[:3]),
                                              **sweeps("A-1", sglang="0.5.14", labels=LABELS[3:])))],
     "rows of 2 releases"),
    ([("sweeps-speed-0.5.12.post1.json", dict(sweeps("A-1", labels=LABELS[:3]),
                                              **sweeps("A-1", model=shape(SMALL), labels=LABELS[3:])))],
     "rows of 2 model shapes"),
    ([("sweeps-speed-0.5.14.json", sweeps("A-1", sglang="0.5.14"))], "rows of sglang 0.5.14, not --version 0.5.12.post1"),
    ([("sweeps-speed-0.5.12.post1.json", dict(sweeps("A-1", labels=LABELS[:3]), **sweeps(None, labels=LABELS[3:])))],
     "rows without a run id (skip-t8 c1"),
    ([("sweeps-speed-0.5.12.post1.json", sweeps("A-1")),
      ("sweeps-more-0.5.12.post1.json", sweeps("A-1", labels=LABELS[:1]))], "sweep 'nospec' is in two sweeps files"),
])
def test_a_folder_mixing_runs_releases_or_shapes_is_refused(files, fragment, tmp_path):
    out = tmp_path / "res.json"
    done = summarize(returned(tmp_path / "r", *files), out)
    assert done.returncode == 2, done.stdout + done.stderr
    assert fragment in done.stderr and "not summarized" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


def test_a_results_tarball_of_another_run_is_refused(tmp_path):
    other = {"run_id": "B-2", "phase": "speed", "sglang": "0.5.12.post1", "model": shape(BIG)}
    folder = returned(tmp_path / "r", ("sweeps-speed-0.5.12.post1.json", sweeps("A-1")), tar_run=other)
    done = summarize(folder, tmp_path / "res.json")
    assert done.returncode == 2
    assert "the results tarball is of run B-2, the sweeps of run A-1" in done.stderr


def test_a_model_shape_against_the_rows_is_refused_and_a_bad_one_named(tmp_path):
    folder = returned(tmp_path / "r", ("sweeps-speed-0.5.12.post1.json", sweeps("A-1", model=shape(SMALL))))
    done = summarize(folder, tmp_path / "res.json", "--model-shape", BIG_SHAPE)
    assert done.returncode == 2 and "but the rows were measured on" in done.stderr
    done = summarize(folder, tmp_path / "res.json", "--model-shape", "hidden=4096,layers=x")
    assert done.returncode == 2 and "--model-shape" in done.stderr and "'x' is not a number" in done.stderr
    done = summarize(folder, tmp_path / "res.json", "--model-shape", "hidden=4096")
    assert done.returncode == 2 and "missing layers, heads, kv_heads, inter, vocab" in done.stderr


def test_the_committed_runs_still_summarize_with_the_shape_given_or_marked_unknown(tmp_path):
    run = RUNS / "2026-12-01-3-native-vs-patched-0.5.14"
    committed = json.loads((ROOT / "benchmarks" / "gpu" / "results" / "0.5.14.json").read_text())
    labels = ("--labels", "patched-t0,patched-tm1,patched-t8")
    done = summarize(run, tmp_path / "given.json", *labels, "--model-shape", BIG_SHAPE, version="0.5.14")
    assert done.returncode == 0, done.stderr
    given = json.loads((tmp_path / "given.json").read_text())
    assert given["summary"]["tok_s"] == committed["summary"]["tok_s"]
    assert given["summary"]["model"] == dict(shape(BIG), source="--model-shape")
    assert given["summary"]["model"]["params_b"] == pytest.approx(5.93)
    assert given["summary"]["step_ms"]["no_spec"] == [r["step_ms"] for r in committed["modes"]["nospec"]]
    assert given["model"]["target"] == committed["model"]["target"]
    done = summarize(run, tmp_path / "unknown.json", *labels, version="0.5.14")
    assert done.returncode == 0, done.stderr
    model = json.loads((tmp_path / "unknown.json").read_text())["summary"]["model"]
    assert model["source"] == "unknown" and model["hidden"] is None and model["params_b"] is None


def write_model(models: Path, dims: dict) -> None:
    cfg = {"hidden_size": dims["hidden"], "num_hidden_layers": dims["layers"], "num_attention_heads": dims["heads"],
           "num_key_value_heads": dims["kv_heads"], "intermediate_size": dims["inter"], "vocab_size": dims["vocab"]}
    (models / "target").mkdir(parents=True)
    (models / "target" / "config.json").write_text(json.dumps(cfg))
    (models / "draft").mkdir()
    (models / "draft" / "model.safetensors").write_text("weights")
    (models / "made-with.txt").write_text("")


def device_call(phase, monkeypatch, models: Path, version: str, run_id: str, labels, scale: float) -> None:
    """One call of phase.py as far as its bookkeeping goes: main()'s start, sweeps, finish()."""
    monkeypatch.setattr(phase, "RUN", {"run_id": run_id, "phase": "speed", "sglang": version, "model": None})
    monkeypatch.setenv("GPU_MODELS", str(models))
    phase.fresh_results()
    assert phase.models() == str(models)
    levels = iter([row(c, scale * c, 4.0) for _ in labels for c in LEVELS])
    monkeypatch.setattr(phase.client, "generate", lambda *a, **k: {})
    monkeypatch.setattr(phase.client, "sweep_level", lambda *a, **k: next(levels))
    monkeypatch.setattr(phase, "PROMPTS", [[5, 6, 7]])
    for label in labels:
        phase.sweep(phase.Server(label, 1), label, levels=",".join(map(str, LEVELS)))
    phase.finish("speed", version)


def test_a_second_call_on_a_warm_machine_returns_only_its_own_rows(phase, monkeypatch, tmp_path):
    models = tmp_path / "models"
    write_model(models, BIG)
    out = Path(phase.os.environ["OUT"])
    device_call(phase, monkeypatch, models, "0.5.14", "A-1", LABELS, scale=2.0)
    for f in out.iterdir():
        f.unlink()  # the device's $OUT is empty at every call
    device_call(phase, monkeypatch, models, "0.5.12.post1", "B-2", LABELS[:3], scale=1.0)
    returned_sweeps = json.loads((out / "sweeps-speed-0.5.12.post1.json").read_text())
    assert sorted(returned_sweeps) == sorted(LABELS[:3])
    for rows in returned_sweeps.values():
        for r in rows:
            assert (r["run_id"], r["phase"], r["sglang"], r["model"]) == ("B-2", "speed", "0.5.12.post1", shape(BIG))
    with tarfile.open(out / "results-speed-0.5.12.post1.tar.gz") as t:
        names = t.getnames()
        assert json.load(t.extractfile("results/run.json"))["run_id"] == "B-2"
    assert "results/sweep-warm-tm1.json" not in names and "results/sweep-nospec.json" in names
    previous = Path(phase.ENV) / "previous" / "before-B-2" / "results"
    assert json.loads((previous / "sweep-warm-tm1.json").read_text())[0]["run_id"] == "A-1"
    assert json.loads((out / "run-speed-0.5.12.post1.json").read_text())["run_id"] == "B-2"


def test_two_phases_in_one_call_keep_apart_by_their_tags(phase, monkeypatch, tmp_path):
    """`a; b` in one device call: with PHASE_TAG each phase's files in $OUT are its own, not overwritten."""
    models = tmp_path / "models"
    write_model(models, BIG)
    out = Path(phase.os.environ["OUT"])
    monkeypatch.setenv("PHASE_TAG", "first")
    device_call(phase, monkeypatch, models, "0.5.14", "A-1", LABELS[:2], scale=2.0)
    monkeypatch.setenv("PHASE_TAG", "5.9b")
    device_call(phase, monkeypatch, models, "0.5.14", "B-2", LABELS[2:4], scale=1.0)
    for tag, run_id, labels in (("first", "A-1", LABELS[:2]), ("5.9b", "B-2", LABELS[2:4])):
        sweeps = json.loads((out / f"sweeps-speed-0.5.14-{tag}.json").read_text())
        assert sorted(sweeps) == sorted(labels)
        assert {r["run_id"] for rows in sweeps.values() for r in rows} == {run_id}
        with tarfile.open(out / f"results-speed-0.5.14-{tag}.tar.gz") as t:
            assert json.load(t.extractfile("results/run.json"))["run_id"] == run_id
    assert not (out / "sweeps-speed-0.5.14.json").exists()
    monkeypatch.setenv("PHASE_TAG", "../x")
    with pytest.raises(SystemExit, match="PHASE_TAG='../x'"):
        phase.finish("speed", "0.5.14")


def test_the_first_call_rows_left_in_place_would_be_refused(phase, monkeypatch, tmp_path):
    """What the warm machine used to return (a previous call's sweeps next to this call's) is refused."""
    models = tmp_path / "models"
    write_model(models, BIG)
    monkeypatch.setattr(phase, "fresh_results", lambda: phase.os.makedirs(phase.RES, exist_ok=True))
    out = Path(phase.os.environ["OUT"])
    device_call(phase, monkeypatch, models, "0.5.14", "A-1", LABELS[3:], scale=2.0)
    device_call(phase, monkeypatch, models, "0.5.12.post1", "B-2", LABELS[:3], scale=1.0)
    (out / "sweeps-speed-0.5.14.json").unlink()
    (out / "results-speed-0.5.14.tar.gz").unlink()
    done = summarize(out, tmp_path / "res.json")
    assert done.returncode == 2 and "rows of 2 run ids" in done.stderr


def test_models_of_another_shape_are_made_again(phase, monkeypatch, tmp_path):
    """A warm machine keeps the last call's models: made with other GPU_MODEL_ARGS, they are made again."""
    models = tmp_path / "models"
    write_model(models, BIG)
    calls = []

    def fake_make(argv, **kw):
        calls.append(argv)
        cfg = json.loads((models / "target" / "config.json").read_text())
        cfg.update(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                   intermediate_size=5632)
        (models / "target" / "config.json").write_text(json.dumps(cfg))
        return subprocess.CompletedProcess(argv, 0, "saved", "")

    monkeypatch.setenv("GPU_MODELS", str(models))
    monkeypatch.setattr(phase.subprocess, "run", fake_make)
    assert phase.models() == str(models) and not calls
    assert phase.RUN["model"] == shape(BIG)
    args = "--hidden 2048 --layers 24 --heads 16 --kv-heads 4 --inter 5632"
    monkeypatch.setenv("GPU_MODEL_ARGS", args)
    phase.models()
    assert len(calls) == 1 and calls[0][-10:] == args.split()
    assert (models / "made-with.txt").read_text() == args
    assert phase.RUN["model"] == shape(SMALL)
    phase.models()
    assert len(calls) == 1


def test_server_logs_start_empty_at_each_launch(phase, tmp_path):
    """A server's log holds its own start only, not the previous one's of the same name."""
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "launch_server.py").write_text("import sys\nprint('started with', sys.argv[-1])\n")
    phase.os.makedirs(phase.RES, exist_ok=True)
    for n in ("first", "second"):
        s = phase.Server("nospec", 1, env={"PYTHONPATH": str(fake)}, args=["--model-path", n])
        s.launch()
        assert s.proc.wait(30) == 0
    text = Path(s.log).read_text()
    assert "started with second" in text and "first" not in text
