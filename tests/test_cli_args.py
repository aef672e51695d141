"""What the command line accepts: negative numbers as values, an empty --host, demo options checked first.

Parsing cases run the real typer app in-process; the live threshold runs against a local demo host.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from demo_box import dynctl, session
from sshd_harness import free_port
from typer.testing import CliRunner

from dynctl.cli import app


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def unreachable(tmp_path: Path) -> Path:
    """A config whose only host is a closed port: reaching it at all would fail with exit 4."""
    path = tmp_path / "dynctl.toml"
    path.write_text(f'default_host = "gone"\n[hosts.gone]\nssh = "root@127.0.0.1:{free_port()}"\n')
    return path


# ---- negative numbers


@pytest.mark.parametrize("argv", [
    ["threshold", "-1", "--yes"],
    ["threshold", "--yes", "-1"],
    ["threshold", "-yH", "gone", "-1"],
    ["threshold", "-1", "-H", "gone", "-y"],
    ["threshold", "--", "-1", "--yes"],
    ["deploy", "--threshold", "-1", "--yes"],
    ["deploy", "-t", "-1", "--yes"],
    ["patch", "apply", "--threshold", "-1", "--yes"],
    ["bench", "--compare", "--threshold", "4", "-1"],
])
def test_minus_one_is_a_value_wherever_a_threshold_goes(unreachable: Path, argv: list[str]):
    """-1 (never disable speculation) parses everywhere; the closed port proves the command got that far."""
    if "--" in argv:  # after `--` everything is positional, as in every click program
        argv = [*argv[:argv.index("--")], "--config", str(unreachable), *argv[argv.index("--"):]]
        result = invoke(*argv)
        assert result.exit_code == 2 and "unexpected extra argument" in result.output
        return
    result = invoke(*argv, "--config", str(unreachable))
    assert "No such option" not in result.output
    assert result.exit_code == 4, result.output
    assert "connection refused by 127.0.0.1" in one_line(result.output)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["threshold", "-2", "--yes"], "threshold: -2 is below -1"),
    (["threshold", "--yes", "-7"], "threshold: -7 is below -1"),
    (["threshold", "abc", "--yes"], "threshold: 'abc' is not an integer"),
    (["deploy", "--threshold", "-3", "--yes"], "--threshold: -3 is below -1"),
    (["bench", "--threshold", "-2"], "--threshold '-2': -2 is below -1"),
])
def test_bad_thresholds_are_usage_errors_before_any_host_is_contacted(unreachable: Path, argv: list[str],
                                                                      fragment: str):
    result = invoke(*argv, "--config", str(unreachable))
    assert result.exit_code == 2, result.output
    assert fragment in one_line(result.output)
    assert "connection refused" not in result.output


def test_an_unknown_option_is_still_named(unreachable: Path):
    result = invoke("threshold", "--bogus", "5", "--config", str(unreachable))
    assert result.exit_code == 2 and "No such option: --bogus" in one_line(result.output)


# ---- --host ''


@pytest.mark.parametrize("command", [["status"], ["threshold", "5", "--yes"], ["stop", "--yes"], ["tui"]])
@pytest.mark.parametrize("name", ["", " "])
def test_an_empty_host_name_is_a_usage_error_not_the_default_host(unreachable: Path, command: list[str], name: str):
    result = invoke(*command, "--host", name, "--config", str(unreachable))
    assert result.exit_code == 2, result.output
    assert f"--host: empty host name {name!r}" in one_line(result.output)
    assert "gone" in result.output  # names the hosts there are
    assert "connection refused" not in result.output


# ---- demo options


@pytest.mark.parametrize(("option", "fragment"), [
    (["--port", "0"], "--port: expected a TCP port 1-65535, got 0"),
    (["--port", "70000"], "--port: expected a TCP port 1-65535, got 70000"),
    (["--threshold", "-2"], "--threshold: -2 is below -1"),
    (["--time-scale", "0"], "--time-scale: expected a number above 0"),
    (["--level-seconds", "-1"], "--level-seconds: expected a number above 0"),
])
def test_bad_demo_options_change_nothing(isolated_home: Path, option: list[str], fragment: str):
    """Refused before the demo host is prepared: no config written, no demo directory."""
    config = isolated_home / ".config" / "dynctl" / "config.toml"
    try:
        result = invoke("demo", "--no-tui", "--port", str(free_port()), *option)
        assert result.exit_code == 2, result.output
        assert fragment in one_line(result.output)
        assert not config.parent.exists()
        assert not (isolated_home / ".local" / "share" / "dynctl").exists()
    finally:
        if config.exists():  # a demo that got as far as starting its server must not outlive the test
            subprocess.run([sys.executable, "-m", "dynctl", "stop", "--host", "demo", "--yes", "--grace", "5"],
                           capture_output=True, stdin=subprocess.DEVNULL, timeout=120)


# ---- the live threshold end to end


@pytest.mark.slow
def test_live_threshold_minus_one_then_a_clear_refusal_once_the_server_is_down(demo_box):
    config = demo_box(via="local")
    port = session(config).host.port
    try:
        deployed = dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        live = dynctl("threshold", "-1", "--yes", config=config)
        assert live.returncode == 0, live.stdout + live.stderr
        assert "threshold -1 in force" in live.stdout
    finally:
        stopped = dynctl("stop", "--yes", "--grace", "5", config=config)
    assert stopped.returncode == 0, stopped.stderr
    down = dynctl("threshold", "5", "--yes", config=config)
    assert down.returncode == 3, down.stdout + down.stderr
    message = one_line(down.stderr)
    assert f"no server is listening on 127.0.0.1:{port}" in message
    assert "dynctl start" in message
    assert "urlopen" not in message and "Errno" not in message
