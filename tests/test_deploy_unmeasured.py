"""Patch variants that passed every CPU check but were not measured on a GPU: opt-in, and said so everywhere."""

from __future__ import annotations

import json

import pytest
from demo_box import dynctl, server_info, start_baseline, tree_sha256

pytestmark = pytest.mark.slow

NOTE = "patch not measured on a GPU for sglang 0.5.18"


def _one_line(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


def test_auto_stays_native_and_status_names_the_unmeasured_variant(demo_box):
    config = demo_box("0.5.18", via="local")
    status = dynctl("status", config=config)
    assert status.returncode == 0, status.stdout + status.stderr
    line = next(ln for ln in status.stdout.splitlines() if "strategy" in ln)
    assert "native" in line
    assert 'patch variant for sglang 0.5.18 exists but is not measured on a GPU' in _one_line(status.stdout)
    dry = dynctl("deploy", "--threshold", "5", "--dry-run", config=config)
    assert dry.returncode == 0, dry.stderr
    assert "strategy native" in dry.stdout and "eagle_worker_v2.py" not in dry.stdout


def test_strategy_patch_takes_the_unmeasured_variant_and_says_so(demo_box):
    config = demo_box("0.5.18", via="local", strategy="patch")
    pristine = tree_sha256(config)
    start_baseline(config)
    dry = dynctl("deploy", "--threshold", "5", "--dry-run", config=config)
    assert dry.returncode == 0, dry.stderr
    assert "strategy patch" in dry.stdout and NOTE in _one_line(dry.stdout)
    assert "+++ b/sglang/srt/speculative/eagle_worker_v2.py" in dry.stdout
    assert tree_sha256(config) == pristine

    out = dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert NOTE in _one_line(out.stdout + out.stderr)
    assert server_info(config)["internal_states"][0]["speculative_disable_batch_threshold"] == 5

    status = dynctl("status", config=config)
    assert status.returncode == 0
    assert NOTE in _one_line(status.stdout)
    data = json.loads(dynctl("status", "--json", config=config).stdout)
    assert data["patch"]["strategy"] == "patch" and data["patch"]["status"] == "applied"
    assert NOTE in data["patch"]["detail"]

    back = dynctl("rollback", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0, back.stdout + back.stderr
    assert tree_sha256(config) == pristine


def test_a_release_without_a_native_route_is_patched_unmeasured_and_says_so():
    """0.5.6 and 0.5.7: their plain step was never measured on a GPU; "auto" still patches them (no
    adaptive speculation before 0.5.14), and the patch is named as not measured wherever it shows."""
    from dynctl.patching.versions import is_measured, strategy_for, strategy_note

    for version in ("0.5.6", "0.5.7"):
        assert not is_measured(version)
        assert strategy_for(version, "auto") == "patch"
        assert strategy_note(version, "patch").startswith(f"patch not measured on a GPU for sglang {version}")
    assert strategy_note("0.5.9", "patch") == "patch measured on a GPU"


def test_a_measured_release_that_misses_a_target_says_which():
    """A release marked measured takes the patch under "auto"; where its GPU runs fall short of a target
    (`misses` in the table), plan and status say which beside "patch measured on a GPU"."""
    from dynctl.patching.recipe import releases
    from dynctl.patching.versions import is_measured, patch_note, strategy_for, strategy_note, unmeasured_note

    for version in ("0.5.15", "0.5.15.post1", "0.5.16", "0.5.17"):
        misses = releases()[version].misses
        assert is_measured(version) and strategy_for(version, "auto") == "patch"
        assert misses and "1.2 B" in misses and f"{version}-" in misses
        assert unmeasured_note(version) is None
        assert patch_note(version) == strategy_note(version, "patch") == (
            f"patch measured on a GPU; short of a target: {misses}")
        assert strategy_note(version, "native") is None
    assert releases()["0.5.8"].misses is None
    assert patch_note("0.5.8") is None and strategy_note("0.5.8", "patch") == "patch measured on a GPU"
    assert unmeasured_note("0.5.18").endswith("its disabled-step cost and correctness were not measured")
    assert patch_note("0.5.18") == unmeasured_note("0.5.18")


def test_auto_patches_a_measured_current_release_and_names_what_it_misses(demo_box):
    """sglang 0.5.16 under the default strategy: the measured patch, not the native route, and the
    target its GPU runs missed on the plan and in status."""
    from dynctl.patching.recipe import releases

    said = " ".join(f"short of a target: {releases()['0.5.16'].misses}".split())
    config = demo_box("0.5.16", via="local")
    status = dynctl("status", config=config)
    assert status.returncode == 0, status.stdout + status.stderr
    line = next(ln for ln in status.stdout.splitlines() if "strategy" in ln)
    assert "patch" in line and "native" not in line
    assert said in _one_line(status.stdout)
    dry = dynctl("deploy", "--threshold", "5", "--dry-run", config=config)
    assert dry.returncode == 0, dry.stderr
    assert "strategy patch" in dry.stdout and said in _one_line(dry.stdout)
    assert "+++ b/sglang/srt/speculative/eagle_worker_v2.py" in dry.stdout


def test_what_the_table_says_of_a_release_names_result_files_that_exist():
    """`misses` cites the committed GPU results it rests on; each cited path (a glob where it
    has one) matches a file of benchmarks/gpu/results/."""
    import re
    from pathlib import Path

    from dynctl.patching.recipe import releases

    repo = Path(__file__).resolve().parents[1]
    cited = 0
    for name, release in releases().items():
        for path in re.findall(r"benchmarks/gpu/results/[\w.*-]+\.json", release.misses or ""):
            assert list(repo.glob(path)), f"{name}: {path} matches no committed file"
            cited += 1
    assert cited >= 6
