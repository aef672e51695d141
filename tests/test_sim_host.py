"""The demo host directory (dynctl.sim.hostsetup) and its fake nvidia-smi."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dynctl.base.config import parse_config
from dynctl.sim.hostsetup import prepare_demo_host
from sglang_trees import cache_dir, sglang_wheel
from polling import alive, wait_for
from sshd_harness import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    sglang_wheel("0.5.9")  # through the shared test cache, so no second download
    root = tmp_path_factory.mktemp("demo-host")
    return root, prepare_demo_host(root, port=free_port(), cache_dir=cache_dir(), time_scale=50)


def run_smi(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(root / "bin" / "nvidia-smi"), *args], capture_output=True, text=True)


def test_the_host_entry_is_a_valid_config_host(demo):
    root, entry = demo
    config = parse_config({"hosts": {"demo": entry}})
    host = config.hosts["demo"]
    assert host.simulated and host.python == sys.executable and host.workdir == str(root / "work")
    assert host.launch_argv()[:3] == [sys.executable, "-m", "dynctl.sim"]
    assert "--speculative-algorithm" in host.args and "/models/demo-simulated" in host.args
    assert entry["env"]["PYTHONPATH"] == str(root / "site") and entry["env"]["PATH"] == f"{root / 'bin'}:${{PATH}}"
    assert (root / "site" / "sglang-0.5.9.dist-info").is_dir() and (root / "site" / "sglang" / "srt").is_dir()


def test_preparing_twice_changes_nothing_and_keeps_a_patched_tree(demo):
    root, entry = demo
    server_args = root / "site" / "sglang" / "srt" / "server_args.py"
    original = server_args.read_text()
    server_args.write_text(original + "\n# patched by a release\n")
    smi_mtime = (root / "bin" / "nvidia-smi").stat().st_mtime_ns
    try:
        again = prepare_demo_host(root, port=entry["port"], cache_dir=cache_dir(), time_scale=50)
        assert again == entry
        assert server_args.read_text().endswith("# patched by a release\n")
        assert (root / "bin" / "nvidia-smi").stat().st_mtime_ns == smi_mtime
    finally:
        server_args.write_text(original)


def test_the_demo_entry_launches_a_server_that_nvidia_smi_sees(demo, tmp_path):
    root, entry = demo
    env = {**os.environ, **{k: v.replace("${PATH}", os.environ["PATH"]) for k, v in entry["env"].items()}}
    argv = [part.replace("{python}", entry["python"]) for part in entry["launch"]]
    argv += [*entry["args"], "--port", str(entry["port"]), "--enable-metrics"]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=entry["workdir"], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        def ready():
            assert proc.poll() is None, log.read_text()[-3000:]
            return "The server is fired up and ready to roll!" in log.read_text()
        wait_for(ready, 30, "the demo server")
        smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.used,memory.total",
                              "--format=csv,noheader,nounits"], env=env, capture_output=True, text=True, check=True)
        rows = [line.split(", ") for line in smi.stdout.splitlines()]
        assert len(rows) == 8 and all(name == "NVIDIA H200" and int(used) > 100_000 for _, name, used, _ in rows)
        apps = run_smi(root, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits")
        pids = [int(line.split(", ")[0]) for line in apps.stdout.splitlines()]
        assert len(pids) == 8 and all(alive(pid) for pid in pids)
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: run_smi(root, "--query-compute-apps=pid", "--format=csv,noheader").stdout == "", 10,
             "the GPU memory of the dead server to be free")
    used = run_smi(root, "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout.split()
    assert used == ["0"] * 8


def test_nvidia_smi_csv_headers_units_and_errors(demo):
    root, _ = demo
    out = run_smi(root, "--query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total,power.draw,clocks.sm",
                  "--format=csv")
    header, *rows = out.stdout.splitlines()
    assert header == ("index, uuid, name, utilization.gpu [%], memory.used [MiB], memory.total [MiB], "
                      "power.draw [W], clocks.current.sm [MHz]")
    assert len(rows) == 8
    assert re.fullmatch(r"0, GPU-[0-9a-f-]{36}, NVIDIA H200, 0 %, 0 MiB, 143771 MiB, \d+\.\d\d W, \d+ MHz", rows[0])
    plain = run_smi(root, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits", "-i", "3")
    assert plain.stdout == "3, 143771\n"
    apps = run_smi(root, "--query-compute-apps=pid,process_name,used_memory", "--format=csv")
    assert apps.stdout == "pid, process_name, used_gpu_memory [MiB]\n"
    bad = run_smi(root, "--query-gpu=index,bogus", "--format=csv")
    assert bad.returncode == 2 and 'Field "bogus" is not a valid field to query.' in bad.stdout
    listing = run_smi(root, "-L")
    assert listing.stdout.startswith("GPU 0: NVIDIA H200 (UUID: GPU-")


def test_nvidia_smi_loop_keeps_printing(demo):
    root, _ = demo
    proc = subprocess.Popen([str(root / "bin" / "nvidia-smi"), "--query-gpu=index", "--format=csv,noheader",
                             "-lms", "50"], stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(24)]
        assert lines == [f"{i}\n" for i in range(8)] * 3
    finally:
        proc.kill()
        proc.wait()


def test_a_demo_host_made_under_a_group_writable_umask_is_private(tmp_path):
    """The directories the demo creates are 0700 whatever the umask, so the agent's ownership checks
    (which refuse a workdir others could write to, or under one) accept it."""
    sglang_wheel("0.5.9")
    before = stat.S_IMODE(tmp_path.stat().st_mode)
    old = os.umask(0o002)
    try:
        root = tmp_path / "share" / "dynctl" / "demo"
        entry = prepare_demo_host(root, port=free_port(), cache_dir=cache_dir(), time_scale=50)
    finally:
        os.umask(old)
    for path in (tmp_path / "share", tmp_path / "share" / "dynctl", root, Path(entry["workdir"])):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE(tmp_path.stat().st_mode) == before  # a directory that existed is left as it was
