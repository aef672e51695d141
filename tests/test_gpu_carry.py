"""A carry too large for one device call: split_carry.sh moves what does not fit into a second folder,
cutting a file in two if it must; a `phase.py store` call keeps that folder on the machine, and the next
call's phase.py finds, joins and checks each file against the carry's SHA256SUMS.

The scripts run as they do for a real carry (bash, a real `python3 phase.py store` process); the device
is only the temporary folder that $GPU_ENV names.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEVICE = ROOT / "benchmarks" / "gpu" / "device"
SPLIT = ROOT / "benchmarks" / "gpu" / "split_carry.sh"
MIB = 1 << 20


def tarball(path: Path, size: int) -> bytes:
    """A real .tar.xz of one file of `size` random bytes; returns them."""
    data = os.urandom(size)
    member = path.parent / "payload"
    member.write_bytes(data)
    with tarfile.open(path, "w:xz", preset=0) as t:
        t.add(member, arcname="pkg/payload")
    member.unlink()
    return data


def carry(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A carry folder as prepare.sh leaves it, before the split: tarballs, wheels/, small files, bin/."""
    dest = tmp_path / ".gpu99"
    (dest / "bin").mkdir(parents=True)
    (dest / "wheels").mkdir()
    for script in DEVICE.glob("*.py"):
        shutil.copy(script, dest / "bin")
    # the large ones stand in for tarballs by their bytes alone (compressing them would cost seconds)
    (dest / "kernels-9.9.tar.xz").write_bytes(os.urandom(300_000))
    (dest / "extra-9.9.tar.xz").write_bytes(os.urandom(700_000))
    tarball(dest / "site.tar.xz", 20_000)
    (dest / "wheels" / "dynctl-0.1.0-py3-none-any.whl").write_bytes(os.urandom(60_000))
    (dest / "sglang-9.9.kernels").write_text("9.9\n")
    (dest / "MANIFEST").write_text("test carry\n")
    files = {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*") if p.is_file() and "bin" not in p.parts}
    return dest, files


def split(dest: Path, limit: int) -> subprocess.CompletedProcess:
    """split_carry.sh with `limit` bytes a call (1 MiB less what it keeps to spare); its cwd is outside
    any git work tree, so the checkout's own files count 0."""
    return subprocess.run(["bash", str(SPLIT), str(dest)], cwd=dest.parent, text=True, capture_output=True,
                          env=dict(os.environ, CARRY_MIB="1", SPARE_BYTES=str(MIB - limit)), timeout=60)


def folder(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.fixture
def device(tmp_path, monkeypatch):
    """phase.py imported with $GPU_ENV in tmp_path; `load(carry)` points it at a carry folder."""
    env = tmp_path / "gpuenv"
    monkeypatch.setenv("GPU_ENV", str(env))
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.syspath_prepend(str(DEVICE))
    for name in ("phase", "client", "runinfo"):
        sys.modules.pop(name, None)
    module = importlib.import_module("phase")

    def load(dest: Path):
        monkeypatch.setattr(module, "CARRY", str(dest))
        return module

    yield env, load
    for name in ("phase", "client", "runinfo"):
        sys.modules.pop(name, None)


def store(folder_a: Path, env: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(folder_a / "bin" / "phase.py"), "store"], cwd=folder_a.parent,
                          text=True, capture_output=True, env=dict(os.environ, GPU_ENV=str(env)), timeout=120)


def test_a_carry_over_one_call_is_split_then_stored_joined_and_checked(tmp_path, device):
    dest, files = carry(tmp_path)
    # 750 kB a call: the 1.2 MB carry (bin/ included) needs two calls, and the largest tarball with the
    # second folder's own bin/ fits neither
    r = split(dest, 750_000)
    assert r.returncode == 0, r.stdout + r.stderr
    a = tmp_path / ".gpu99a"
    assert r.stdout.startswith("store calls: .gpu99a (") and "then .gpu99 (" in r.stdout
    for part in (dest, a):
        assert sum(p.stat().st_size for p in part.rglob("*") if p.is_file()) <= 750_000
    assert (a / "extra-9.9.tar.xz.part-a").exists() and (dest / "extra-9.9.tar.xz.part-b").exists()
    assert not (dest / "extra-9.9.tar.xz").exists() and (a / "bin" / "phase.py").exists()
    assert (dest / "MANIFEST").exists() and (dest / "sglang-9.9.kernels").exists()

    env, load = device
    s = store(a, env)
    assert s.returncode == 0, s.stdout + s.stderr
    assert "stored extra-9.9.tar.xz.part-a" in s.stdout

    phase = load(dest)
    for name, data in files.items():
        if name == "MANIFEST":
            continue
        assert phase.has(name), name
        assert Path(phase.carried(name)).read_bytes() == data, name
    assert not (dest / "site.tar.xz").exists()  # stored whole, extracted from there
    phase.extract(os.path.join(str(dest), "site.tar.xz"), str(env / "site"))
    with tarfile.open(a / "site.tar.xz") as t:
        assert (env / "site" / "pkg" / "payload").read_bytes() == t.extractfile("pkg/payload").read()
    if not (dest / "wheels").exists():
        assert sorted(os.listdir(env / "stored" / "wheels")) == ["dynctl-0.1.0-py3-none-any.whl"]


def test_a_call_before_the_store_call_says_to_make_it(tmp_path, device):
    dest, _ = carry(tmp_path)
    assert split(dest, 750_000).returncode == 0
    _, load = device
    phase = load(dest)
    assert not phase.has("extra-9.9.tar.xz")
    with pytest.raises(SystemExit, match=r"extra-9\.9\.tar\.xz is neither in .*\.gpu99 nor stored .*carry \.gpu99a "
                                         r"\(and \.gpu99b \.\.\. where prepare\.sh made them\) each in a `store`"):
        phase.carried("extra-9.9.tar.xz")


def test_a_phase_on_a_machine_without_the_stores_stops_before_it_makes_anything(tmp_path, device, monkeypatch):
    """A fresh machine has none of an earlier call's stores: setup names every tarball missing and stops
    before the models (a minute of GPU time) are begun; once the store call ran, nothing is missing."""
    dest, _ = carry(tmp_path)
    assert split(dest, 750_000).returncode == 0
    env, load = device
    phase = load(dest)
    begun = []
    monkeypatch.setattr(phase, "models", lambda: begun.append("models"))
    with pytest.raises(SystemExit, match=r"^extra-9\.9\.tar\.xz, kernels-9\.9\.tar\.xz, site\.tar\.xz are neither in "
                                         r".*\.gpu99 nor stored on this machine .*carry \.gpu99a"):
        phase.setup("9.9", ["pristine"])
    assert begun == []
    assert store(tmp_path / ".gpu99a", env).returncode == 0
    assert phase.missing_tarballs() == []


def test_a_stored_copy_of_another_build_is_refused(tmp_path, device):
    dest, _ = carry(tmp_path)
    assert split(dest, 750_000).returncode == 0
    env, load = device
    assert store(tmp_path / ".gpu99a", env).returncode == 0
    part = env / "stored" / "extra-9.9.tar.xz.part-a"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(SystemExit, match=r"extra-9\.9\.tar\.xz: the stored copy .* is not this carry's"):
        load(dest).carried("extra-9.9.tar.xz")


def test_the_split_is_undone_by_join_and_a_carry_too_large_is_left_as_it_was(tmp_path):
    dest, files = carry(tmp_path)
    assert split(dest, 750_000).returncode == 0
    r = subprocess.run(["bash", str(SPLIT), "--join", str(dest)], text=True, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / ".gpu99a").exists()
    joined = folder(dest)
    assert {k: v for k, v in joined.items() if k != "SHA256SUMS" and not k.startswith("bin/")} == files

    before = folder(dest)
    r = split(dest, 150_000)  # 1.2 MB does not fit four calls of 150 kB, each with its bin/
    assert r.returncode == 1
    assert "carry too large for 4 calls" in r.stdout
    assert not (tmp_path / ".gpu99a").exists()
    assert {k: v for k, v in folder(dest).items() if k != "SHA256SUMS"} == {
        k: v for k, v in before.items() if k != "SHA256SUMS"}


def test_a_carry_that_fits_stays_one_folder(tmp_path):
    dest, files = carry(tmp_path)
    r = split(dest, 4 * MIB)
    assert r.returncode == 0 and r.stdout.startswith("one call: .gpu99")
    assert not (tmp_path / ".gpu99a").exists()
    sums = dict(line.split()[::-1] for line in (dest / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {"./" + name for name in files if name != "MANIFEST"}


def test_a_bundle_found_through_its_pth_file_is_put_on_the_path(tmp_path, device):
    site = tmp_path / "extra"
    (site / "nvidia_cutlass_dsl" / "python_packages" / "cutlass").mkdir(parents=True)
    (site / "nvidia_cutlass_dsl.pth").write_text("nvidia_cutlass_dsl/python_packages\n")
    (site / "other.pth").write_text("# a comment\nimport sys\nmissing_dir\n")
    _, load = device
    assert load(tmp_path).pth_dirs(str(site)) == [str(site / "nvidia_cutlass_dsl" / "python_packages")]


def test_imports_made_only_where_cuda_is_present_are_found_in_the_source(tmp_path, device):
    """The GPU machine's import check of 0.5.16 stopped at `import deep_gemm`, which dsa_backend makes under
    `if is_cuda():` and a CPU machine's check never reaches; the source shows it, along the chain of
    module-level imports and nowhere it would not run."""
    from sglang_trees import install_sglang

    _, load = device
    phase = load(tmp_path)
    check = ["sglang.srt.server_args", "sglang.srt.managers.scheduler", "sglang.srt.speculative.eagle_worker_v2"]
    root16 = install_sglang("0.5.16", tmp_path / "t16", only=["sglang/"]).parent
    found = phase.cuda_guarded_imports(str(root16), check + ["sglang.srt.layers.attention.dsa_backend"])
    assert found["deep_gemm"][0][0] == "sglang.srt.layers.attention.dsa_backend"
    assert "sgl_kernel" in found and "torch" not in found
    root14 = install_sglang("0.5.14", tmp_path / "t14", only=["sglang/"]).parent
    assert "deep_gemm" not in phase.cuda_guarded_imports(str(root14), check)

    pkg = tmp_path / "tree" / "sglang"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "top.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .sub import leaf\n"
        "if TYPE_CHECKING:\n    import typed_only\n"
        "def later():\n    if is_cuda():\n        import in_a_function\n")
    (pkg / "sub" / "leaf.py").write_text(
        "import os\n_is_cuda = is_cuda()\n"
        "if _is_cuda:\n    import needs_cuda\n"
        "    try:\n        import optional_one\n    except ImportError:\n        pass\n"
        "elif is_hip():\n    import rocm_only\n"
        "class Holder:\n    if _is_cuda:\n        from other_cuda_pkg import thing\n")
    found = phase.cuda_guarded_imports(str(tmp_path / "tree"), ["sglang.top"])
    assert sorted(found) == ["needs_cuda", "other_cuda_pkg"]
    assert found["needs_cuda"] == [("sglang.sub.leaf", 4)]


def test_the_closed_loop_measures_each_level_in_rounds_the_order_rotating(tmp_path, device, site_059, start_sim,
                                                                          monkeypatch):
    """CLOSED_ROUNDS: every mode measured that many times at a level, round k starting at mode k, so the
    rows of two modes span the same minutes; /metrics texts only in round 0. Against two simulated servers
    (sglang's /generate and /metrics), the device-side client as it runs on the GPU machine."""
    _, load = device
    phase = load(tmp_path)
    fast = ["--time-scale", "20", "--sim-load-seconds", "1", "--model-path", "/models/m", "--enable-metrics"]
    sims = [start_sim(site_059, fast).wait_ready(), start_sim(site_059, fast).wait_ready()]
    servers = {name: phase.Server(name, sim.port) for name, sim in zip(("one", "two"), sims)}
    os.makedirs(phase.RES, exist_ok=True)
    monkeypatch.setattr(phase, "PROMPTS", [[5, 6, 7, 8, 9, 10]])
    for name, value in (("CLOSED_LEVELS", "2"), ("CLOSED_ROUNDS", "2"), ("CLOSED_WINDOWS", "1"),
                        ("CLOSED_WARMUP", "0.3")):
        monkeypatch.setenv(name, value)
    order = []
    sweep = phase.client.sweep_level
    monkeypatch.setattr(phase.client, "sweep_level", lambda url, *a, **k: order.append(url) or sweep(url, *a, **k))
    phase.closed_loop(servers, [("a", "one", None), ("b", "two", None)], None, 1.0)
    assert order == [servers["one"].url, servers["two"].url, servers["two"].url, servers["one"].url]
    for label in ("a", "b"):
        rows = json.loads((Path(phase.RES) / f"closed-{label}.json").read_text())
        assert [(r["concurrency"], r["round"]) for r in rows] == [(2, 0), (2, 1)]
        assert all(r["tok_s"] > 0 and r["run_id"] == phase.RUN["run_id"] for r in rows)
        assert (Path(phase.RES) / f"closed-{label}-c2-metrics-start.txt").read_text().startswith("#")


def test_the_check_phase_deploys_the_patch_on_a_release_not_yet_marked_measured(tmp_path, device):
    """The check phase measures the patch: its dynctl config asks for strategy = "patch", without which
    "auto" deploys sglang's native adaptive route on a release whose variant is not yet measured."""
    from dynctl.base.config import load_config
    from dynctl.patching.versions import strategy_for

    env, load = device
    phase = load(tmp_path)
    os.makedirs(env, exist_ok=True)
    tree = {"PYTHONPATH": "/carry/sglang-0.5.18-dynctl:/carry/site"}
    phase.write_dynctl_config("0.5.18", "/models", {"strict": (30004, tree, ["--enable-metrics", "--x"])})
    host = load_config(env / "dynctl.toml").hosts["strict"]
    assert host.strategy == "patch"
    assert strategy_for("0.5.18", host.strategy) == "patch" != strategy_for("0.5.18", "auto")
    assert host.port == 30004 and "--enable-metrics" not in host.args


@pytest.mark.slow
def test_an_interrupted_deploy_is_followed_to_its_end_and_its_server_stopped(tmp_path, device, demo_box):
    """What the check phase does when its budget ends in the middle of `dynctl deploy`: SIGINT stops the
    command but not the operation on the host, so finish() follows that to its end and only then stops
    the server it started; no server is left holding the GPU for the next call. A simulated host on this
    machine that takes 4 s to load, interrupted while dynctl waits for it to become ready."""
    from demo_box import server_pid

    _, load = device
    phase = load(tmp_path)
    config = demo_box("0.5.9", via="local", time_scale=1, DYNCTL_SIM_LOAD_SECONDS="4")
    deploy = phase.StrictDeploy(dict(os.environ, DYNCTL_CONFIG=str(config)), 5, host="box")
    assert deploy.printed("→ ready", timeout=120), deploy.out
    deploy.finish()
    assert "the deploy continues on the host" in deploy.out
    assert deploy.proc.returncode != 0
    assert server_pid(config) is None


EXPERIMENT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "experiment_tree.sh"


def _tree_tarball(path: Path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:xz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_an_experiment_tree_is_the_patched_tree_with_its_diff_carried_as_changed_files(tmp_path, device):
    """experiment_tree.sh: the files that differ from the pristine tree (the patch's and the experiment's),
    which phase.py lays over the pristine tree as it does for any tree carried as changed files."""
    env, load = device
    carry = tmp_path / "carry"
    carry.mkdir()
    pristine = {"sglang/a.py": "x = 1\n", "sglang/b.py": "y = 2\n", "sglang/c.py": "z = 3\n"}
    patched = dict(pristine, **{"sglang/a.py": "x = 1\npatched = True\n", "sglang/new.py": "n = 0\n"})
    _tree_tarball(carry / "sglang-9.9-pristine.tar.xz", pristine)
    _tree_tarball(carry / "sglang-9.9-patched.tar.xz", patched)
    diff = tmp_path / "exp.diff"
    diff.write_text("--- patched/sglang/b.py\n+++ exp/sglang/b.py\n@@ -1 +1,2 @@\n y = 2\n+experiment = 1\n")
    done = subprocess.run(["bash", str(EXPERIMENT), str(carry), "9.9", "exp", str(diff)], text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    with tarfile.open(carry / "sglang-9.9-exp.files.tar.xz") as tar:
        assert sorted(tar.getnames()) == ["./sglang/a.py", "./sglang/b.py", "./sglang/new.py"]
    phase = load(carry)
    phase.extract(str(carry / "sglang-9.9-pristine.tar.xz"), str(env / "pristine"))
    phase.extract(str(carry / "sglang-9.9-exp.files.tar.xz"), str(env / "exp"), over=str(env / "pristine"))
    got = {str(p.relative_to(env / "exp")): p.read_text() for p in (env / "exp").rglob("*.py")}
    assert got == dict(patched, **{"sglang/b.py": "y = 2\nexperiment = 1\n"})

    diff.write_text("--- patched/sglang/b.py\n+++ exp/sglang/b.py\n@@ -1 +1,2 @@\n not there\n+experiment = 1\n")
    (carry / "sglang-9.9-exp.files.tar.xz").unlink()
    failed = subprocess.run(["bash", str(EXPERIMENT), str(carry), "9.9", "exp", str(diff)], text=True,
                            capture_output=True, timeout=60)
    assert failed.returncode != 0 and "FAILED" in failed.stdout + failed.stderr
    assert not (carry / "sglang-9.9-exp.files.tar.xz").exists()
