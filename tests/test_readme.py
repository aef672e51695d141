"""The README's first two commands are the contract with a newcomer and with CI: keep them true."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```sh\n(.+?)\n```", text, re.S)[:2]


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    grep = re.search(r"grep -m1 '\^([^']+)' README.md", ci)
    assert grep, ".ci/run must take its command from the README"
    test_line = commands()[1]
    assert test_line.startswith(grep.group(1))
    assert "pytest" in test_line and "openssh-server" in test_line


def test_first_command_installs_and_runs_dynctl():
    first = commands()[0]
    assert "pip install" in first and "dynctl" in first
