"""The command line's conventions: -h, shell completion, an example in every command's help, flags without a
`<bool>` placeholder, `dynctl config`, tables that a pipe reads with `cut -f`, and `logs --json` records."""

from __future__ import annotations

import io
import json
import sys

import pytest
import typer
from rich.console import Console

from dynctl.cli import app, main
from dynctl.cli.tables import print_table
from dynctl.base.parsers.logrecord import log_record


def run(capsys, monkeypatch, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["dynctl", *argv])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


def command_paths() -> list[list[str]]:
    paths = []

    def walk(command, prefix):
        for name, sub in getattr(command, "commands", {}).items():
            if getattr(sub, "commands", None):
                walk(sub, [*prefix, name])
            else:
                paths.append([*prefix, name])

    walk(typer.main.get_command(app), [])
    return paths


def test_root_help_has_h_and_shell_completion(capsys, monkeypatch):
    code, out, _ = run(capsys, monkeypatch, "-h")
    assert code == 0 and "--install-completion" in out and "--show-completion" in out


@pytest.mark.parametrize("path", command_paths(), ids=" ".join)
def test_every_command_has_h_an_example_and_no_bool_placeholder(capsys, monkeypatch, path):
    code, out, _ = run(capsys, monkeypatch, *path, "-h")
    assert code == 0, out
    assert f"Example: dynctl {' '.join(path)}" in " ".join(out.split())
    assert "<bool>" not in out


def test_config_names_the_file_where_it_looked_and_the_settings_without_secrets(capsys, monkeypatch, tmp_path):
    cfg = tmp_path / "dynctl.toml"
    cfg.write_text('# ours\ndefault_host = "box"\n\n[hosts.box]\nport = 31000\npython = "/opt/sg/bin/python3"\n'
                   'env = { HF_TOKEN = "hf_secret_value" }\nargs = ["--model-path", "/models/m"]\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DYNCTL_CONFIG", raising=False)
    code, out, _ = run(capsys, monkeypatch, "config", "--json")
    found = json.loads(out)
    assert code == 0 and found["config"] == str(cfg)
    assert [e["state"] for e in found["looked"]] == ["not set", "not set", "in use"]  # the user config is not read
    settings = found["settings"]
    assert (settings["host"], settings["port"], settings["env_keys"]) == ("box", 31000, ["HF_TOKEN"])
    assert settings["launch_argv"][-4:] == ["/models/m", "--port", "31000", "--enable-metrics"]
    code, out, _ = run(capsys, monkeypatch, "config")  # piped: tab-separated rows
    assert "hf_secret_value" not in out
    rows = [line.split("\t") for line in out.splitlines()]
    assert ["port", "31000"] in rows and ["./dynctl.toml", str(cfg), "in use"] in rows


def test_tables_off_a_terminal_are_tab_separated_and_never_wrapped():
    buf = io.StringIO()
    console = Console(file=buf, width=40, force_terminal=False)
    long = "a cell far longer than the forty columns this console has, with\ta tab and\na line break"
    print_table(console, ("release", "note", "state"), [("r-20260101-000000-ab12", long, "reverted"),
                                                        ("r2", "short", "active")], no_wrap=("release",))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3 and all(line.count("\t") == 2 for line in lines)
    assert [line.split("\t")[2] for line in lines] == ["state", "reverted", "active"]
    assert lines[1].split("\t")[1] == " ".join(long.split())


def test_log_records_keep_every_line_and_read_what_they_can():
    decode = log_record("[2026-04-08 14:05:21 TP0] Decode batch, #running-req: 5, #token: 20800, token usage: 0.29, "
                        "cuda graph: True, gen throughput (token/s): 144.95, #queue-req: 0", 0.0)
    assert decode["kind"] == "decode" and decode["ranks"] == {"TP": 0}
    assert decode["decode"]["running_reqs"] == 5 and decode["decode"]["gen_throughput"] == 144.95
    switch = log_record("[2026-04-08 14:05:22 TP0] Speculation disabled: batch size 7 > threshold 5", 0.0)
    assert switch["speculation"] == {"enabled": False, "batch_size": 7, "threshold": 5}
    odd = log_record("a line no release of sglang writes", 0.0)
    assert (odd["kind"], odd["line"], odd["time"]) == ("other", "a line no release of sglang writes", None)
    json.dumps([decode, switch, odd])


def test_declining_a_prompt_names_the_change_and_exits_with_nothing_changed(tmp_path):
    """On a terminal (a pty): the question says what changes; "n" ends with a message and exit 3."""
    import os
    import pty
    import select
    import time

    cfg = tmp_path / "dynctl.toml"
    cfg.write_text(f'[hosts.box]\nworkdir = "{tmp_path / "work"}"\nport = 1\npython = "{sys.executable}"\n')
    pid, fd = pty.fork()
    if pid == 0:  # the child: dynctl on the pty
        os.execv(sys.executable, [sys.executable, "-m", "dynctl", "threshold", "7", "--config", str(cfg)])
    seen, answered, deadline = b"", False, time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the pty
            break
        if not chunk:
            break
        seen += chunk
        if not answered and b"[y/N]" in seen:
            os.write(fd, b"n\n")
            answered = True
    _, status = os.waitpid(pid, 0)
    text = " ".join(seen.decode(errors="replace").split())
    assert answered, text
    assert "Set the live threshold of box" in text and "to 7" in text
    assert "declined: nothing was changed" in text and os.waitstatus_to_exitcode(status) == 3


def test_a_key_value_table_off_a_terminal_is_plain_tab_separated_text():
    from rich.table import Table

    from dynctl.cli.tables import print_rich_table

    buf = io.StringIO()
    table = Table(box=None, show_header=False)
    table.add_column()
    table.add_column()
    table.add_row("server", "[green]ready[/]  pid 4242")
    table.add_row("throughput", "0.0 tok/s  [bold yellow]STALE: gauge 42 s old[/]")
    print_rich_table(Console(file=buf, width=30, force_terminal=False), table)
    assert buf.getvalue().splitlines() == ["server\tready pid 4242", "throughput\t0.0 tok/s STALE: gauge 42 s old"]
