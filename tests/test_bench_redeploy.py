"""`dynctl bench --compare` on a native-strategy host: modes by redeploy, the original release put back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dynctl.sim.hostsetup import prepare_demo_host
from sglang_trees import sglang_wheel
from sshd_harness import free_port, toml_value


def dynctl(*args: str, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynctl", *args, "--config", str(config)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)


def test_compare_by_redeploy_puts_the_original_release_back(tmp_path):
    entry = prepare_demo_host(tmp_path / "demo", sglang_version="0.5.14", port=free_port(),
                              cache_dir=sglang_wheel("0.5.14").parent, time_scale=20)
    config = tmp_path / "dynctl.toml"
    config.write_text("[hosts.demo]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in entry.items()))
    try:
        assert dynctl("deploy", "--threshold", "8", "--yes", config=config).returncode == 0
        before = json.loads(dynctl("releases", "--json", config=config).stdout)
        refused = dynctl("bench", "--compare", "--concurrency", "1,4", "--num-prompts", "8", config=config)
        assert refused.returncode == 2 and "refusing without --yes" in refused.stderr + refused.stdout

        out = dynctl("bench", "--compare", "--concurrency", "1,4", "--num-prompts", "8", "--yes", "--no-chart",
                     "--json", str(tmp_path / "bench.json"), config=config)
        assert out.returncode == 0, out.stdout + out.stderr
        result = json.loads((tmp_path / "bench.json").read_text())
        assert {run["mode"] for run in result["runs"]} >= {"no-spec", "always-spec"}
        releases = json.loads(dynctl("releases", "--json", config=config).stdout)
        in_force = [r for r in releases if r["state"] == "applied"]
        assert in_force[0]["id"] == before[0]["id"] and in_force[0]["threshold"] == 8
        status = json.loads(dynctl("status", "--json", config=config).stdout)
        assert status["patch"]["current_release"] == before[0]["id"]
    finally:
        dynctl("stop", "--yes", "--grace", "5", config=config)
