"""The simulator against real sglang trees: it starts, accepts flags and fails exactly where that tree would."""

from __future__ import annotations

import ast
import json
import re
import signal
import socket
import tempfile
from pathlib import Path

import pytest

from dynctl.sim.serverargs import build_parser, read_server_args
from sglang_trees import install_sglang
from sim_harness import SPEC_ARGS, install_patched

pytestmark = pytest.mark.slow

FAST = ["--time-scale", "20", "--sim-load-seconds", "1", "--model-path", "/models/m"]
SPEC_V2 = {"SGLANG_ENABLE_SPEC_V2": "1"}
THRESHOLD_FLAG = "--speculative-disable-batch-threshold"


def break_file(path: Path, anchor: str) -> int:
    """Delete the comma after `anchor` (the hand-patch failure of SPEC §1); return its line number."""
    text = path.read_text()
    index = text.index(anchor) + len(anchor)
    assert text[index] == ","
    path.write_text(text[:index] + text[index + 1:])
    return text[:index].count("\n") + 1


def assert_port_never_opened(sim) -> None:
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", sim.port)) != 0


def test_the_reconstructed_parser_matches_sglangs_flags():
    """Every option string of 0.5.9's add_cli_args is accepted; defaults come from the dataclass."""
    site = install_sglang("0.5.9", Path(tempfile.mkdtemp()) / "site")
    source = (site / "srt/server_args.py").read_text()
    flags = {n.value for call in ast.walk(ast.parse(source)) if isinstance(call, ast.Call)
             and getattr(call.func, "attr", None) == "add_argument" for n in call.args if isinstance(n, ast.Constant)}
    spec = read_server_args(site / "srt/server_args.py")
    parser = build_parser(spec)
    known = {s for action in parser._actions for s in action.option_strings}
    assert flags <= known and len(flags) > 300
    args = parser.parse_args(["--model-path", "/m"])
    assert args.decode_log_interval == 40 and args.port == 30000 and args.host == "127.0.0.1"


def test_threshold_flag_is_refused_by_a_pristine_tree(site_059, start_sim):
    sim = start_sim(site_059, [*FAST, *SPEC_ARGS, THRESHOLD_FLAG, "5"], env=SPEC_V2)
    assert sim.wait_exit() == 2
    assert f"launch_server.py: error: unrecognized arguments: {THRESHOLD_FLAG} 5" in sim.log


def test_threshold_flag_is_accepted_by_a_patched_tree_and_arms(patched_site_059, start_sim):
    sim = start_sim(patched_site_059, [*FAST, *SPEC_ARGS, THRESHOLD_FLAG, "5", "--max-running-requests", "64"],
                    env=SPEC_V2).wait_ready()
    with sim.client() as c:
        assert c.get("/server_info").json()["internal_states"][0]["speculative_disable_batch_threshold"] == 5
    assert "is not armed" not in sim.log


def test_patched_tree_without_spec_v2_says_why_the_threshold_is_not_armed(patched_site_059, start_sim):
    sim = start_sim(patched_site_059, [*FAST, *SPEC_ARGS, THRESHOLD_FLAG, "5"]).wait_ready()
    assert re.search(r"speculative_disable_batch_threshold=5 is not armed: spec v2 is not in use", sim.log)


def test_an_invalid_threshold_kills_the_start_with_the_modules_traceback(patched_site_059, start_sim):
    sim = start_sim(patched_site_059, [*FAST, *SPEC_ARGS, THRESHOLD_FLAG, "-5"], env=SPEC_V2)
    assert sim.wait_exit() == 1
    log = sim.log
    assert "Traceback (most recent call last):" in log
    assert re.search(r'File ".*/sglang/srt/speculative/spec_batch_threshold\.py", line \d+', log)
    assert log.rstrip().splitlines()[-1].startswith("ValueError: speculative_disable_batch_threshold must be >= -1")


def test_missing_comma_in_server_args_dies_with_the_real_traceback(tmp_path, start_sim):
    package = install_patched("0.5.9", tmp_path / "site")
    line = break_file(package / "srt/server_args.py", '"--speculative-disable-batch-threshold"')
    sim = start_sim(tmp_path / "site", [*FAST, *SPEC_ARGS, THRESHOLD_FLAG, "5"], env=SPEC_V2)
    assert sim.wait_exit() == 1
    log = sim.log
    assert log.startswith("Traceback (most recent call last):\n")
    assert re.search(r'File ".*/sglang/launch_server\.py", line \d+, in <module>\n'
                     r"    from sglang\.srt\.server_args import prepare_server_args\n", log)
    assert f'/sglang/srt/server_args.py", line {line}\n    "--speculative-disable-batch-threshold"\n' in log
    assert "SyntaxError: " in log and "comma" in log
    assert_port_never_opened(sim)


def test_broken_scheduler_dies_through_the_http_server_import(tmp_path, start_sim):
    package = install_sglang("0.5.9", tmp_path / "site")
    break_file(package / "srt/managers/scheduler.py", "            server_args=self.server_args")
    sim = start_sim(tmp_path / "site", FAST)
    assert sim.wait_exit() == 1
    log = sim.log
    for frame in ("launch_server.py", "srt/entrypoints/http_server.py", "srt/entrypoints/engine.py",
                  "srt/managers/scheduler.py"):
        assert f"{frame}\", line" in log, frame
    assert "SyntaxError" in log
    assert "server_args=ServerArgs(" not in log  # it dies before _launch_subprocesses logs anything


def test_broken_speculative_worker_kills_the_server_from_the_scheduler(tmp_path, start_sim):
    package = install_patched("0.5.9", tmp_path / "site")
    worker = package / "srt/speculative/eagle_worker_v2.py"
    worker.write_text(worker.read_text() + "\ndef broken(:\n")
    sim = start_sim(tmp_path / "site", [*FAST, *SPEC_ARGS], env=SPEC_V2)
    assert sim.wait_exit() == -signal.SIGKILL
    log = sim.log
    assert "Scheduler hit an exception: Traceback (most recent call last):" in log
    assert re.search(r'eagle_worker_v2\.py", line \d+\n.*\n.*\nSyntaxError', log)
    assert "Received sigquit from a child process. It usually means the child failed." in log
    assert_port_never_opened(sim)


def test_broken_worker_is_not_imported_without_spec_v2(tmp_path, start_sim):
    """0.5.9 imports eagle_worker_v2 only under SGLANG_ENABLE_SPEC_V2 (speculative/spec_info.py:75-83)."""
    package = install_sglang("0.5.9", tmp_path / "site")
    worker = package / "srt/speculative/eagle_worker_v2.py"
    worker.write_text(worker.read_text() + "\ndef broken(:\n")
    start_sim(tmp_path / "site", [*FAST, *SPEC_ARGS]).wait_ready()


def test_missing_policy_module_is_a_module_not_found_error(tmp_path, start_sim):
    package = install_patched("0.5.9", tmp_path / "site")
    (package / "srt/speculative/spec_batch_threshold.py").unlink()
    sim = start_sim(tmp_path / "site", [*FAST, *SPEC_ARGS], env=SPEC_V2)
    assert sim.wait_exit() == 1
    assert "ModuleNotFoundError: No module named 'sglang.srt.speculative.spec_batch_threshold'" in sim.log


def test_adaptive_flags_exist_only_where_the_tree_has_them(site_059, start_sim):
    sim = start_sim(site_059, [*FAST, *SPEC_ARGS, "--speculative-adaptive"])
    assert sim.wait_exit() == 2
    assert "unrecognized arguments: --speculative-adaptive" in sim.log


def test_native_adaptive_config_routes_like_sglang_0_5_14(tmp_path, start_sim):
    install_sglang("0.5.14", tmp_path / "site")
    config = tmp_path / "adaptive.json"
    # nospec from batch 6 up: a batch of 5 is padded to 5 (captured), a batch of 9 to 10.
    config.write_text(json.dumps({"1": {"candidate_steps": [3]}, "6": {"candidate_steps": [0]}}))
    sim = start_sim(tmp_path / "site", [*FAST, *SPEC_ARGS, "--max-running-requests", "32", "--enable-metrics",
                                        "--speculative-adaptive", "--speculative-adaptive-config", str(config),
                                        "--decode-log-interval", "1"]).wait_ready()
    assert "AdaptiveSpeculativeParams initialized: steps=3, candidate_steps=[3]" in sim.log

    def decode_lines(start: int) -> list[str]:
        return [line for line in sim.log[start:].splitlines() if "Decode batch" in line]

    def burst(n: int) -> None:
        """n requests in one /generate: the tokenizer hands them on together, so one prefill admits all n
        (n separate requests from a client on a loaded machine can arrive one decode step apart)."""
        with sim.client() as c:
            r = c.post("/generate", json={"text": ["q"] * n, "sampling_params": {"max_new_tokens": 40}})
        assert r.status_code == 200 and len(r.json()) == n
    mark = len(sim.log)
    burst(9)
    full = [line for line in decode_lines(mark) if "#running-req: 9," in line]
    assert full and all("accept len: 1.00" in line for line in full)  # steps 0: one token per step
    mark = len(sim.log)
    burst(5)
    full = [line for line in decode_lines(mark) if "#running-req: 5," in line]
    assert full and all("accept len: 1.00" not in line for line in full)
    with sim.client() as c:
        assert c.get("/server_info").json()["version"] == "0.5.14"
