"""`dynctl bench --compare` on a native-strategy host: modes by redeploy, the original release put back."""

from __future__ import annotations

import json

import pytest
from demo_box import dynctl

pytestmark = pytest.mark.slow


def test_compare_by_redeploy_puts_the_original_release_back(demo_box, tmp_path):
    config = demo_box("0.5.14", via="local", strategy="native")
    assert dynctl("deploy", "--threshold", "8", "--yes", "--soak", "0", config=config).returncode == 0
    before = json.loads(dynctl("releases", "--json", config=config).stdout)
    refused = dynctl("bench", "--compare", "--concurrency", "1,4", "--num-prompts", "8", config=config)
    assert refused.returncode == 2 and "refusing without --yes" in refused.stderr + refused.stdout

    out = dynctl("bench", "--compare", "--concurrency", "1,4", "--num-prompts", "8", "--yes", "--no-chart",
                 "--json", str(tmp_path / "bench.json"), config=config, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "bench.json").read_text())
    assert {run["mode"] for run in result["runs"]} >= {"no-spec", "always-spec"}
    releases = json.loads(dynctl("releases", "--json", config=config).stdout)
    in_force = [r for r in releases if r["state"] == "applied"]
    assert in_force[0]["id"] == before[0]["id"] and in_force[0]["threshold"] == 8
    status = json.loads(dynctl("status", "--json", config=config).stdout)
    assert status["patch"]["current_release"] == before[0]["id"]
