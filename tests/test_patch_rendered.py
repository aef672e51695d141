"""The checked-in patch of every supported release (patches/rendered/) is what fragments + table + wheel give."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from sglang_trees import sglang_wheel

from dynctl.patching.recipe import fragment_text, recipes, releases, table
from dynctl.patching.render import render, rendered_dir, rendered_path

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version", list(releases()))
def test_the_checked_in_diff_is_the_rendered_patch(version: str) -> None:
    path = rendered_path(version)
    assert path.is_file(), f"{path} is missing: run `python -m dynctl.patching.render {version}`"
    assert path.read_text(encoding="utf-8") == render(version, sglang_wheel(version)), (
        f"{path} is out of date: run `python -m dynctl.patching.render {version}` and review the diff")


def test_every_rendered_diff_belongs_to_a_release_of_the_table() -> None:
    names = {p.name for p in rendered_dir().glob("*.diff")}
    assert names == {f"sglang-{v}.diff" for v in releases()}


@pytest.mark.parametrize("version", ["0.5.6", "0.5.8", "0.5.16"])
def test_the_rendered_diff_applies_with_patch_to_the_pristine_wheel(version: str, tmp_path: Path) -> None:
    """A plain unified diff: GNU patch (in the README's install line) applies it to the wheel's files, and
    the result compiles and carries the module dynctl ships."""
    variant = releases()[version].variant
    paths = [r.path for r in recipes(variant)]
    with zipfile.ZipFile(sglang_wheel(version)) as wheel:
        for rel in paths:
            (tmp_path / "sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "sglang" / rel).write_bytes(wheel.read(f"sglang/{rel}"))
    proc = subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(rendered_path(version))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    module = tmp_path / "sglang" / "srt" / "speculative" / "spec_batch_threshold.py"
    assert module.read_text(encoding="utf-8") == (REPO / "patches" / "spec_batch_threshold.py").read_text(encoding="utf-8")
    for rel in paths:
        compile((tmp_path / "sglang" / rel).read_text(encoding="utf-8"), rel, "exec")


def test_the_table_names_only_fragments_and_anchors_that_exist() -> None:
    data = table()
    used = set()
    for variant in data["variants"]:
        for recipe in recipes(variant):
            for ins in recipe.insertions:
                assert fragment_text(ins.fragment), f"variant {variant}: empty fragment {ins.fragment}"
                used.add(ins.fragment)
    for parts in data["fragments"].values():
        used |= set(parts)
    files = {p.name for p in (REPO / "patches" / "fragments").glob("*.pyfrag")}
    assert {u for u in used if u.endswith(".pyfrag")} == files, "a fragment file no variant uses, or one missing"
    for release in releases().values():
        assert release.variant in data["variants"]


def test_the_render_command_checks_without_writing(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dynctl.patching.render", "--check", "0.5.14"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "dynctl.patching.render", "0.5.13"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "no patch variant for sglang 0.5.13" in proc.stderr
