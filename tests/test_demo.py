"""`dynctl demo --no-tui` end to end, and how it registers the demo host in the user's config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from demo_box import demo_env, dynctl_in
from sshd_harness import free_port

from dynctl.base.config import load_config
from dynctl.actions.demo import register_demo_host


@pytest.mark.slow
def test_demo_no_tui_tells_the_whole_story(tmp_path, isolated_home):
    env, data = demo_env(tmp_path, isolated_home)
    port = free_port()
    try:
        # the demo's own time scale: 1, the speed of the H200 the simulator's table was measured on
        out = dynctl_in(env, "demo", "--no-tui", "--port", str(port), "--level-seconds", "1.5")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "SIMULATED" in out.stdout
        assert "threshold 5 in force" in out.stdout
        rows = [ln.split() for ln in out.stdout.splitlines() if ln.strip()[:1].isdigit() and ("ON" in ln or "OFF" in ln)]
        states = {int(r[0]): r[3] for r in rows}
        assert states[1] == "ON" and states[64] == "OFF"
        assert "speculation switched 2 time(s)" in out.stdout

        config = isolated_home / ".config" / "dynctl" / "config.toml"
        assert load_config(config).hosts["demo"].simulated is True
        status = dynctl_in(env, "status", "--host", "demo", "--json")
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["server"]["threshold"] == 5
        assert report["patch"]["status"] == "applied"
    finally:
        dynctl_in(env, "stop", "--host", "demo", "--yes", "--grace", "5")


def test_register_keeps_the_operators_config(tmp_path):
    path = tmp_path / "config.toml"
    original = '# my fleet\ndefault_host = "glm5"\n\n[hosts.glm5]\nssh = "root@pve"  # the big box\npct = 129\n'
    path.write_text(original)
    entry = {"python": "/usr/bin/python3", "workdir": "/tmp/w", "port": 30001, "simulated": True,
             "env": {"PATH": "/x/bin:${PATH}"}, "args": ["--tp", "8"]}
    register_demo_host(entry, str(path))
    text = path.read_text()
    assert text.startswith(original)
    cfg = load_config(path)
    assert cfg.default_host == "glm5" and cfg.hosts["glm5"].pct == 129
    assert cfg.hosts["demo"].port == 30001 and cfg.hosts["demo"].env == {"PATH": "/x/bin:${PATH}"}

    register_demo_host(dict(entry, port=30002), str(path))  # again: replaced, not duplicated
    cfg = load_config(path)
    assert cfg.hosts["demo"].port == 30002
    assert path.read_text().count("[hosts.demo]") == 1
    assert path.read_text().startswith(original)


def test_register_replaces_an_old_demo_section_in_any_spelling_and_keeps_what_follows(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('default_host = "glm5"\n\n[hosts.demo]   # from an older demo\nport = 1\n[hosts.demo.env]\n'
                    'A = "1"\n\n# the production box, keep\n[hosts.glm5]\nssh = "root@pve"  # via the jump host\n')
    register_demo_host({"port": 30003, "env": {"B": "2"}}, str(path))
    text = path.read_text()
    cfg = load_config(path)
    assert cfg.hosts["demo"].port == 30003 and cfg.hosts["demo"].env == {"B": "2"}
    assert cfg.hosts["glm5"].ssh is not None and cfg.default_host == "glm5"
    assert "# the production box, keep\n[hosts.glm5]" in text and "# via the jump host" in text
    assert text.count("[hosts.demo]") == 1 and "A = " not in text


def test_register_refuses_a_broken_config(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[hosts.a\n")
    proc = subprocess.run([sys.executable, "-c", "from dynctl.actions.demo import register_demo_host as r; "
                           f"r({{'port': 1}}, {str(path)!r})"], capture_output=True, text=True)
    assert proc.returncode != 0 and "TOML syntax error" in proc.stderr
    assert path.read_text() == "[hosts.a\n"


def test_demo_root_follows_xdg(tmp_path, monkeypatch):
    from dynctl.actions.demo import demo_root

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert demo_root() == Path(tmp_path) / "dynctl" / "demo"
