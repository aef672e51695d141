"""The layering as CI holds it: the import-linter contracts of pyproject.toml, a core that pulls in no UI
library, and the product code as ruff and mypy see it (at the level pyproject.toml sets)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UI_LIBRARIES = ("typer", "textual", "rich", "textual_plotext", "click")

# The core and what it stands on: everything `dynctl deploy` runs, without the views.
CORE = ("dynctl.core.deploy", "dynctl.core.lifecycle", "dynctl.core.operations", "dynctl.core.native",
        "dynctl.core.inventory", "dynctl.core.adoption", "dynctl.core.gateway", "dynctl.core.fleet",
        "dynctl.core.rollout",
        "dynctl.live.server_status", "dynctl.live.snapshot", "dynctl.live.feed", "dynctl.patching",
        "dynctl.bench.runner", "dynctl.bench.modes", "dynctl.bench.stats", "dynctl.agent.client",
        "dynctl.transport.ssh", "dynctl.transport.pct", "dynctl.base.config", "dynctl.base.events",
        "dynctl.base.parsers.prometheus", "dynctl.base.parsers.serverlog", "dynctl.base.parsers.nvidia_smi",
        "dynctl.base.sglang", "dynctl.base.hostspec")


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={"PATH": str(Path(sys.executable).parent), "HOME": str(ROOT), "PYTHONPATH": str(ROOT)})


def test_the_import_contracts_are_kept():
    proc = run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                                      "sys.argv = ['lint-imports', '--no-cache']; lint_imports_command()"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Contracts: 5 kept, 0 broken." in proc.stdout, proc.stdout[-3000:]


def test_importing_the_core_pulls_in_no_ui_library():
    probe = ("import importlib, json, sys\n"
             f"for name in {CORE!r}: importlib.import_module(name)\n"
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    proc = run([sys.executable, "-c", probe])
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout))
    assert "dynctl" in loaded and "paramiko" in loaded  # the probe did import the core
    assert not loaded & set(UI_LIBRARIES), sorted(loaded & set(UI_LIBRARIES))


def test_ruff_passes_on_the_product_code():
    proc = run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "dynctl", "remote"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


@pytest.mark.slow
def test_mypy_passes_on_the_product_code(tmp_path):
    proc = run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
    assert proc.stdout.startswith("Success"), proc.stdout[-1000:]
