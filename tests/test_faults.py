"""SPEC §9's never-list as a regression suite: the fault and bad-input scenarios dynctl withstands.

Each runs against the real things an operator's box has: the test sshd, the `pct` stand-in, and the
demo host (the simulated sglang server on a real sglang tree from PyPI), mostly through the `dynctl`
CLI. Where files could change, a scenario compares the sha256 of the whole sglang tree before and after.

    config and CLI validation      exit 2, and the host is not touched
    injection                      configured strings arrive verbatim over SSH and SSH+pct, never run
    host keys                      unknown refused, changed refused with both fingerprints, accept-new opt-in
    secrets                        identity file paths may be shown; key material and env values never
    client killed mid-deploy       the host finishes on its own and is consistent
    worker killed mid-swap         the next operation recovers; the tree is one release or the other
    hang or crash on start         rolled back to the serving release, exit 1
    SIGTERM ignored                SIGKILL after the grace, to our server's tree only
    orphans, foreign processes     swept only when provably ours, refused and left alone otherwise
    concurrent operators           the second is refused naming the holder, exit 3
    pct losing exit codes          exit statuses survive an LXC that drops them
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from demo_box import (
    CTID,
    dynctl,
    kill_servers_of,
    make_demo_box,
    server_info,
    server_pid,
    session,
    site_of,
    start_baseline,
    tree_sha256,
    with_text,
)
from polling import alive, wait_for
from sshd_harness import FakeHost, free_port, generate_key
from typer.testing import CliRunner

from dynctl.core import deploy as core
from dynctl.base import events
from dynctl.core import lifecycle
from dynctl.cli import app
from dynctl.cli.common import HostSession
from dynctl.base.config import SSHTarget
from dynctl.base.errors import ConfigError, HostKeyError, OperationFailed, UnreachableError
from dynctl.transport import close_all
from dynctl.transport.pct import Pct
from dynctl.transport.ssh import SSH

POLICY = "srt/speculative/spec_batch_threshold.py"
SERVING_CT = 140  # the demo host whose server stays up for the whole module
LOSSY_CT = 142  # a container whose LXC loses exit statuses
SECRET = "hf_dynctl-FAULTS-s3cr3t-9c1e2f"


def one_line(text: str) -> str:
    return " ".join(text.split())


def tree_of(pid: int) -> list[int]:
    return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]


def listening(port: int) -> bool:
    return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections(kind="tcp"))


def ssh_keygen_fingerprint(pub: Path) -> str:
    """The fingerprint as OpenSSH itself prints it (independent of paramiko)."""
    return subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True).stdout.split()[1]


@pytest.fixture(scope="module")
def serving(sshd: FakeHost, demo_template, tmp_path_factory) -> Iterator[Path]:
    """One demo host with its baseline server up, for scenarios that must leave it exactly as it is.

    Its env carries a secret (SECRET) that no output may ever show.
    """
    tmp = tmp_path_factory.mktemp("serving")
    config = make_demo_box(sshd, demo_template("0.5.9"), tmp, ctid=SERVING_CT, HF_TOKEN=SECRET)
    start_baseline(config)
    yield config
    close_all()
    dynctl("stop", "--yes", "--grace", "5", config=config)
    kill_servers_of(Path(session(config).host.workdir))
    close_all()


@pytest.fixture
def demo(demo_box) -> tuple[HostSession, Path]:
    """(session, config path) of a demo host inside container 129, its server not started."""
    config = demo_box(time_scale=50)
    return session(config), config


def start(s: HostSession, *flags: str) -> int:
    return lifecycle.start_server(s.agent, lifecycle.server_argv(s.host, flags))["pid"]


def spawn(owned: list[subprocess.Popen], argv: list[str], **kw) -> subprocess.Popen:
    kw.setdefault("stdout", subprocess.DEVNULL)
    kw.setdefault("stderr", subprocess.DEVNULL)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, **kw)
    owned.append(proc)
    return proc


# =========================================================================== config and CLI validation


@pytest.mark.slow  # the real CLI in a process of its own
@pytest.mark.parametrize(("text", "fragment"), [
    ("[hosts.a]\npct = 'x'\n", "hosts.a.pct"),
    ("[hosts.a\n", "TOML syntax error"),
    ("[hosts.a]\nport = 70000\n", "hosts.a.port: expected an integer 1-65535, got 70000"),
    ("[hosts.a]\nssh = 'root@h:99999'\n", "hosts.a.ssh: port 99999 is out of range"),
    ("[hosts.a]\nenv = { 'A-B' = '1' }\n", "hosts.a.env.A-B: not a valid environment variable name"),
    ("[hosts.a]\nargs = '--tp 8'\n", "hosts.a.args: expected a list of strings"),
    ("[hosts.a]\nbogus = 1\n", "hosts.a.bogus: unknown key"),
    ("default_host = 'b'\n[hosts.a]\n", "default_host = 'b' names no [hosts.b] section"),
])
def test_a_bad_config_exits_2_naming_file_and_key(tmp_path: Path, text: str, fragment: str):
    path = tmp_path / "dynctl.toml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "dynctl", "status", "--config", str(path)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert str(path) in proc.stderr and fragment in one_line(proc.stderr)


@pytest.mark.slow  # the real CLI in a process of its own
def test_an_unknown_host_exits_2_naming_the_defined_ones(tmp_path: Path):
    path = tmp_path / "dynctl.toml"
    path.write_text('[hosts.glm5]\nssh = "root@127.0.0.1:2222"\n')
    proc = subprocess.run([sys.executable, "-m", "dynctl", "status", "--config", str(path), "--host", "nobody"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "no host named 'nobody' (defined: glm5)" in proc.stderr


def test_a_missing_config_file_exits_2(tmp_path: Path):
    result = CliRunner().invoke(app, ["status", "--config", str(tmp_path / "absent.toml")])
    assert result.exit_code == 2
    assert f"{tmp_path / 'absent.toml'}: config file not found" in one_line(result.output)


@pytest.mark.parametrize("argv", [
    ["stop", "--grace", "-1"],
    ["start", "--ready-timeout", "0"],
    ["logs", "-n", "-1"],
    ["tui", "--interval", "0"],
])
def test_out_of_range_options_exit_2_before_any_host_is_contacted(tmp_path: Path, argv: list[str]):
    path = tmp_path / "dynctl.toml"
    path.write_text(f'[hosts.gone]\nssh = "root@127.0.0.1:{free_port()}"\n')
    result = CliRunner().invoke(app, [*argv, "--config", str(path)])
    assert result.exit_code == 2, result.output
    assert "connection refused" not in result.output


@pytest.mark.slow
def test_missing_identity_file_is_a_config_error(sshd: FakeHost, tmp_path: Path):
    with pytest.raises(ConfigError, match=r"identity_file .*nope.* No such file") as info:
        sshd.ssh(identity_file=str(tmp_path / "nope")).run(["true"])
    assert info.value.exit_code == 2


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["deploy", "--threshold", "5"],
    ["rollback"],
    ["restart"],
    ["stop"],
    ["threshold", "7"],
    ["patch", "apply"],
    ["patch", "revert", "--all"],
])
@pytest.mark.slow
def test_changing_a_host_without_yes_off_a_terminal_exits_2_and_changes_nothing(serving: Path, argv: list[str]):
    before, pid = tree_sha256(serving), server_pid(serving)
    result = CliRunner().invoke(app, [*argv, "--config", str(serving)])  # stdin is no terminal there either
    assert result.exit_code == 2, result.output
    assert "refusing without --yes (stdin is not a terminal)" in one_line(result.output)
    assert tree_sha256(serving) == before
    assert server_pid(serving) == pid
    assert core.list_releases(session(serving).agent) == []


# =========================================================================== injection


PAYLOAD = "$(touch canary-1) `touch canary-2`; touch canary-3 | touch canary-4 && touch canary-5 'q' \"dq\" \\ \n x"


def canaries(*roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("canary-*")]


@pytest.mark.slow
@pytest.mark.parametrize("route", ["ssh", "ssh+pct"])
def test_configured_strings_arrive_verbatim_and_never_run(demo_box, sshd: FakeHost, tmp_path: Path, route: str):
    """python, workdir, identity file, an env value and an argument, each full of shell syntax, through every layer."""
    identity = tmp_path / f"key {PAYLOAD}"
    identity.write_bytes(sshd.client_key.read_bytes())
    identity.chmod(0o600)
    venv = tmp_path / f"venv {PAYLOAD}"
    venv.symlink_to(Path(sys.prefix), target_is_directory=True)  # pyvenv.cfg is found through the link
    python = str(venv / "bin" / "python")
    workdir = tmp_path / f"work {PAYLOAD}"
    box = demo_box(via="pct" if route == "ssh+pct" else "ssh", time_scale=50)
    entry = tomllib.loads(box.read_text())["hosts"]["box"]
    args = list(entry["args"])
    args[args.index("--model-path") + 1] = f"/models/{PAYLOAD}"
    entry.update(identity_file=str(identity), python=python, workdir=str(workdir), args=args,
                 env={**entry["env"], "DYNCTL_FAULT_VALUE": PAYLOAD})
    config = sshd.write_config(tmp_path / "injected.toml", {"box": entry}, default_host="box")
    site = site_of(config)
    before = tree_sha256(site)
    try:
        status = dynctl("status", "--json", config=config)
        assert status.returncode == 0, status.stderr
        host = json.loads(status.stdout)["host"]
        assert host["workdir"]["path"] == str(workdir) and host["workdir"]["writable"]
        assert host["python"] == python

        started = dynctl("start", "--yes", "--ready-timeout", "120", config=config)
        assert started.returncode == 0, started.stdout + started.stderr
        pid = json.loads((workdir / "server.json").read_text())["pid"]
        cmdline = psutil.Process(pid).cmdline()
        assert cmdline[cmdline.index("--model-path") + 1] == f"/models/{PAYLOAD}"
        assert psutil.Process(pid).environ()["DYNCTL_FAULT_VALUE"] == PAYLOAD
        assert dynctl("stop", "--yes", "--grace", "10", config=config).returncode == 0
    finally:
        close_all()
        kill_servers_of(workdir)
    assert canaries(tmp_path, sshd.tmp / "home", site.parent, sshd.ct_root(CTID)) == []
    assert tree_sha256(site) == before


@pytest.mark.slow  # the real CLI in a process of its own
def test_an_ssh_target_with_shell_syntax_never_reaches_a_shell(tmp_path: Path):
    path = tmp_path / "dynctl.toml"
    path.write_text('[hosts.x]\nssh = "box;touch${IFS}canary-ssh"\n')  # a bare word: an alias, no DNS
    out = subprocess.run([sys.executable, "-m", "dynctl", "status", "--config", str(path)], cwd=tmp_path,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert out.returncode == 4 and "is not a Host alias" in out.stderr
    assert canaries(tmp_path) == []


# =========================================================================== host keys


@pytest.mark.slow
def test_unknown_host_key_is_refused_with_its_fingerprint(sshd: FakeHost, tmp_path: Path):
    own = tmp_path / "dynctl_known_hosts"
    t = sshd.ssh(known_hosts_path=str(own))
    with pytest.raises(HostKeyError) as info:
        t.run(["true"])
    message = str(info.value)
    assert ssh_keygen_fingerprint(sshd.tmp / "host_ed25519.pub") in message
    assert f"[127.0.0.1]:{sshd.port}" in message and "accept_new_host_key = true" in message
    assert info.value.exit_code == 4
    assert not own.exists()


@pytest.mark.slow
def test_unknown_host_key_is_refused_by_the_cli(sshd: FakeHost, tmp_path: Path):
    config = sshd.write_config(tmp_path / "dynctl.toml", {"box": {"ssh": sshd.target, "python": sys.executable}})
    config.with_name("dynctl.known_hosts").write_text("")  # trust nothing
    out = dynctl("status", config=config)
    assert out.returncode == 4
    assert "SHA256:" in out.stderr and "accept_new_host_key" in out.stderr
    assert config.with_name("dynctl.known_hosts").read_text() == ""


@pytest.mark.slow
def test_accept_new_stores_the_key_0600_and_keeps_other_entries(sshd: FakeHost, tmp_path: Path):
    own = tmp_path / "state" / "known_hosts"
    own.parent.mkdir()
    other = "[127.0.0.9]:2222 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDWxPNsKQAbE0cIjtt8Th08oYlSOvAb9qzRjGlwsoGh6"
    own.write_text("# kept\n" + other)  # no final newline: the append must not glue lines together
    own.chmod(0o644)
    assert sshd.ssh(known_hosts_path=str(own), accept_new=True).run(["true"]).rc == 0
    assert own.stat().st_mode & 0o777 == 0o600
    assert own.read_text().splitlines() == ["# kept", other, sshd.host_key_line]
    assert [p.name for p in own.parent.iterdir() if p.name.startswith(".")] == []  # no temp file left
    # Stored means trusted: a later connection without accept-new gets in.
    assert sshd.ssh(known_hosts_path=str(own), accept_new=False).run(["true"]).rc == 0


@pytest.mark.slow
def test_changed_host_key_is_refused_showing_both_fingerprints(sshd: FakeHost, tmp_path: Path):
    impostor = generate_key(tmp_path / "old_host_ed25519")
    keytype, b64 = Path(f"{impostor}.pub").read_text().split()[:2]
    own = tmp_path / "known_hosts"
    own.write_text(f"[127.0.0.1]:{sshd.port} {keytype} {b64}\n")
    before = own.read_bytes()
    t = sshd.ssh(known_hosts_path=str(own), accept_new=True)  # accept-new never overrides a change
    with pytest.raises(HostKeyError) as info:
        t.run(["true"])
    message = str(info.value)
    assert "HOST KEY CHANGED" in message
    assert ssh_keygen_fingerprint(Path(f"{impostor}.pub")) in message
    assert ssh_keygen_fingerprint(sshd.tmp / "host_ed25519.pub") in message
    assert str(own) in message
    assert own.read_bytes() == before


@pytest.mark.slow
def test_a_changed_jump_host_key_is_refused_too(sshd: FakeHost, sshd_factory, tmp_path: Path):
    jump = sshd_factory("127.0.0.2")
    impostor = generate_key(tmp_path / "impostor")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{sshd.host_key_line}\n[127.0.0.2]:{jump.port} {Path(f'{impostor}.pub').read_text()}")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host target\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
                   f"  ProxyJump {jump.user}@127.0.0.2:{jump.port}\n")
    t = SSH(SSHTarget(None, "target", None), ssh_config_path=str(cfg), identity_file=str(sshd.client_key),
            known_hosts_path=str(kh), accept_new=True)
    with pytest.raises(HostKeyError) as info:
        t.run(["true"])
    assert "jump host" in str(info.value) and "HOST KEY CHANGED" in str(info.value)
    assert ssh_keygen_fingerprint(jump.tmp / "host_ed25519.pub") in str(info.value)


@pytest.mark.slow
def test_users_known_hosts_is_read_but_never_written(sshd: FakeHost, isolated_home: Path, tmp_path: Path):
    users = isolated_home / ".ssh" / "known_hosts"
    users.write_text(sshd.host_key_line + "\n")
    own = tmp_path / "own_known_hosts"
    before = users.stat()
    assert sshd.ssh(known_hosts_path=str(own), accept_new=True).run(["true"]).rc == 0
    after = users.stat()
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    assert not own.exists()


# =========================================================================== secrets


def key_material(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("-----")]


@pytest.mark.slow
def test_wrong_key_is_an_auth_failure_without_key_material(sshd: FakeHost, tmp_path: Path):
    wrong = generate_key(tmp_path / "wrong_ed25519")
    t = sshd.ssh(identity_file=str(wrong))
    with pytest.raises(UnreachableError, match=rf"authentication failed for user '{sshd.user}'") as info:
        t.run(["true"])
    message = str(info.value)
    assert str(wrong) in message
    assert not any(line in message for line in key_material(wrong))
    assert info.value.exit_code == 4


@pytest.mark.slow
def test_a_passphrase_protected_key_is_named_not_shown(sshd: FakeHost, tmp_path: Path):
    locked = tmp_path / "locked_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "correct horse", "-f", str(locked)], check=True)
    (sshd.tmp / "authorized_keys").open("a").write(Path(f"{locked}.pub").read_text())
    with pytest.raises(UnreachableError) as info:
        sshd.ssh(identity_file=str(locked)).run(["true"])
    message = str(info.value)
    assert f"identity file {locked} is passphrase-protected" in message
    assert not any(line in message for line in key_material(locked)) and "correct horse" not in message


@pytest.mark.slow
def test_env_secrets_and_key_material_are_never_printed(serving: Path, sshd: FakeHost):
    """Every read-only command, and refusals, on a host whose env holds a token."""
    commands = [["status"], ["status", "--json"], ["hosts"], ["hosts", "--json"],
                ["deploy", "--threshold", "5", "--dry-run"], ["deploy", "--threshold", "5", "--dry-run", "--json"],
                ["releases"], ["logs", "-n", "200"], ["patch", "status"], ["patch", "diff"],
                ["deploy", "--threshold", "5"], ["threshold", "3", "--yes"], ["start", "--yes"]]
    material = key_material(sshd.client_key)
    seen = 0
    for argv in commands:
        text = CliRunner().invoke(app, [*argv, "--config", str(serving)]).output  # stdout and stderr
        seen += len(text)
        assert SECRET not in text, argv
        assert not any(line in text for line in material), argv
    assert seen > 1000  # the commands did print something


# =========================================================================== a client killed mid-deploy


def journal(workdir: Path) -> list[dict]:
    path = workdir / "journal.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_client_killed_mid_deploy_leaves_the_host_to_finish(demo_box):
    config = demo_box()
    start_baseline(config)
    pristine = tree_sha256(config)
    s = session(config)
    workdir = Path(s.host.workdir)
    client = subprocess.Popen([sys.executable, "-m", "dynctl", "deploy", "--threshold", "5", "--yes", "--soak", "0",
                               "--config", str(config)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        # kill -9 the operator's dynctl once the host has switched the files and is restarting the server
        wait_for(lambda: any(r["event"] == "deploy.step_started" and r.get("step") == "stop"
                             for r in journal(workdir)), 120, "the deploy to reach its stop step")
    finally:
        client.kill()
        client.wait()
    wait_for(lambda: any(r["event"] == "deploy.final" for r in journal(workdir)), 120, "the host to finish")
    assert s.agent.call("op_current")["holder"] is None
    final = [r for r in journal(workdir) if r["event"] == "deploy.final"][-1]
    assert final.get("ok") is True, final
    assert server_info(config)["internal_states"][0]["speculative_disable_batch_threshold"] == 5
    deployed = tree_sha256(config)
    assert deployed != pristine
    patch = json.loads(dynctl("patch", "status", "--json", config=config).stdout)
    assert patch["status"] == "applied"
    again = dynctl("deploy", "--threshold", "5", "--yes", config=config)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    back = dynctl("rollback", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0, back.stderr
    assert tree_sha256(config) == pristine


# =========================================================================== a worker killed mid-swap


@pytest.mark.slow
def test_a_worker_killed_mid_switch_is_undone_by_the_next_deploy(demo_box):
    """kill -9 of the host-side worker right after the swap: the next deploy recovers, then deploys."""
    config = demo_box()
    s = session(config)
    agent, host = s.agent, s.host
    pristine = tree_sha256(config)
    plan = core.plan_deploy(agent, host, 5)
    killed = {}

    def on_event(e: events.Event) -> None:
        if isinstance(e, events.StepStarted) and e.step == "stop" and not killed:
            holder = agent.call("op_current")["holder"]
            os.kill(holder["pid"], signal.SIGKILL)
            killed["pid"] = holder["pid"]

    with pytest.raises(Exception) as info:
        core.deploy(agent, plan, on_event, ready_timeout=60)
    assert killed and "died without finishing" in str(info.value)
    assert agent.call("op_current")["holder"] is None  # a dead worker holds nothing
    releases = core.list_releases(agent)
    assert releases[0]["state"] == "applied"  # switched before the kill, never verified
    interrupted = tree_sha256(config)

    again = core.deploy(agent, core.plan_deploy(agent, host, 5), ready_timeout=60, soak=0)
    assert again["threshold_in_force"] == 5
    deployed = tree_sha256(config)
    assert interrupted in (pristine, deployed)  # one release or the other, never a mix
    back = core.rollback(agent, host, to="baseline", soak=0)
    assert back["target"] == "baseline"
    assert tree_sha256(config) == pristine


# =========================================================================== hang or crash on start


@pytest.mark.slow
def test_crash_on_start_rolls_back_to_the_serving_release(demo_box):
    config = demo_box()
    old = start_baseline(config)
    pristine = tree_sha256(config)
    s = session(config)
    dplan = core.plan_deploy(s.agent, s.host, 5)
    policy = next(f["text"] for f in dplan.files if f["path"] == POLICY)
    with_text(dplan, POLICY, policy + "\nraise RuntimeError('patched module fails at import')\n")
    seen: list[events.Event] = []
    with pytest.raises(OperationFailed) as info:
        core.deploy(s.agent, dplan, seen.append, ready_timeout=60)
    assert "rolled back to baseline, which is serving again" in str(info.value)
    assert info.value.exit_code == 1
    assert any(isinstance(e, events.Failed) and any("patched module fails" in ln for ln in e.log_tail)
               for e in seen)
    assert tree_sha256(config) == pristine
    new = server_pid(config)
    assert new and new != old
    r = httpx.post(f"http://127.0.0.1:{s.host.port}/generate",
                   json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    assert r.status_code == 200


@pytest.mark.slow
def test_hang_on_start_times_out_and_rolls_back(demo_box):
    config = demo_box()
    start_baseline(config)
    pristine = tree_sha256(config)
    s = session(config)
    dplan = core.plan_deploy(s.agent, s.host, 5)
    policy = next(f["text"] for f in dplan.files if f["path"] == POLICY)
    with_text(dplan, POLICY, policy + "\nimport time\ntime.sleep(3600)\n")
    with pytest.raises(OperationFailed) as info:
        core.deploy(s.agent, dplan, ready_timeout=4, grace=5)
    assert "not ready within 4s" in str(info.value) and "rolled back" in str(info.value)
    assert info.value.exit_code == 1
    assert tree_sha256(config) == pristine
    # the rollback restarts the baseline under the same 4 s gate, which a loaded machine can outlast:
    # started it was, and it answers
    wait_for(lambda: server_info(config) is not None, 60, "the baseline server back")


# =========================================================================== SIGTERM ignored


@pytest.mark.slow
def test_sigterm_ignored_is_killed_after_grace_and_nothing_else_is(demo, owned):
    s, config = demo
    before = tree_sha256(config)
    decoy = spawn(owned, [sys.executable, "-c", "import time; time.sleep(600)", "-m", "sglang.launch_server",
                          "--port", str(s.host.port)], start_new_session=True)
    pid = start(s, "--sim-ignore-sigterm")
    lifecycle.wait_ready(s.agent, 120)
    tree = tree_of(pid)
    result = lifecycle.stop_server(s.agent, grace=1)
    assert result["escalated"] is True and result["gpu"]["checked"] is True
    assert not any(alive(p) for p in tree)
    assert alive(decoy.pid)
    assert tree_sha256(config) == before


# =========================================================================== orphans and processes that are not ours


@pytest.mark.slow
def test_orphaned_child_holding_the_port_is_swept(demo):
    s, config = demo
    before = tree_sha256(config)
    start(s, "--sim-orphan-child")
    lifecycle.wait_ready(s.agent, 120)
    result = lifecycle.stop_server(s.agent, grace=10)
    swept = [p for p in result["swept"] if "sglang::orphan" in " ".join(p["cmdline"])]
    assert swept and not alive(swept[0]["pid"])
    assert not listening(s.host.port)
    assert tree_sha256(config) == before


@pytest.mark.slow
def test_decoy_and_second_server_are_untouched(demo_box, owned):
    config = demo_box()
    start_baseline(config)
    pristine = tree_sha256(config)
    decoy = spawn(owned, [sys.executable, "-c", "import sys,time; time.sleep(600)", "-m", "sglang.launch_server"],
                  start_new_session=True)
    other_port = free_port()
    s = session(config)
    other = spawn(owned, [sys.executable, "-m", "dynctl.sim", "--time-scale", "20", "--model-path", "/m",
                          "--port", str(other_port)], env=dict(os.environ, PYTHONPATH=s.host.env["PYTHONPATH"]),
                  start_new_session=True)
    out = dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
    assert out.returncode == 0, out.stderr
    back = dynctl("rollback", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0, back.stderr
    for proc in (decoy, other):
        assert proc.poll() is None
        assert psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE
    assert tree_sha256(config) == pristine


@pytest.mark.slow
def test_foreign_process_on_the_port_is_refused_and_left_alone(demo_box):
    config = demo_box()
    s = session(config)
    pristine = tree_sha256(config)
    with socket.socket() as foreign:
        foreign.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        foreign.bind(("127.0.0.1", s.host.port))
        foreign.listen()
        out = dynctl("deploy", "--threshold", "5", "--yes", config=config)
        assert out.returncode == 3, out.stdout + out.stderr
        assert f"port {s.host.port} is held by pid {os.getpid()}" in out.stderr
        assert core.list_releases(s.agent) == []
        stop = dynctl("stop", "--yes", config=config)
        assert stop.returncode == 0
        said = one_line(stop.stdout)
        assert f"held by pid {os.getpid()} (" in said and "which dynctl does not manage" in said
    assert tree_sha256(config) == pristine


# =========================================================================== concurrent operators


@pytest.mark.slow
def test_second_operation_is_refused_naming_the_first(demo_box, tmp_path):
    config = demo_box()
    start_baseline(config)
    pristine = tree_sha256(config)
    s = session(config)
    dplan = core.plan_deploy(s.agent, s.host, 5)
    policy = next(f["text"] for f in dplan.files if f["path"] == POLICY)
    # the new server hangs at import until the test lets it go, then fails: the first deploy holds the
    # host for as long as the test needs, however slowly the other operators' commands start
    release = tmp_path / "let-the-server-fail"
    with_text(dplan, POLICY, policy + f"\nimport os, time\nwhile not os.path.exists({str(release)!r}):\n"
                                      "    time.sleep(0.05)\nraise RuntimeError('let go by the test')\n")
    started = threading.Event()

    def record(e: events.Event) -> None:
        if isinstance(e, events.StepStarted) and e.step == "ready":
            started.set()

    errors: list[Exception] = []

    def run() -> None:
        try:
            core.deploy(s.agent, dplan, record, ready_timeout=300, grace=5)
        except Exception as err:  # noqa: BLE001 - the first deploy is expected to fail and roll back
            errors.append(err)

    t = threading.Thread(target=run)
    t.start()
    refused: dict[str, subprocess.CompletedProcess] = {}
    try:
        assert started.wait(120)
        # Three operators at once while the first deploy waits for its (hung) server.
        others = [threading.Thread(target=lambda n=name, a=argv: refused.__setitem__(n, dynctl(*a, "--yes",
                                                                                                 config=config)))
                  for name, argv in {"deploy": ["deploy", "--threshold", "7"], "stop": ["stop"],
                                     "rollback": ["rollback"]}.items()]
        for other in others:
            other.start()
        for other in others:
            other.join()
    finally:
        release.touch()
        t.join()
    for name, out in refused.items():
        assert out.returncode == 3, (name, out.stdout + out.stderr)
        assert "host is busy: deploy by" in out.stderr, name
    assert errors and "rolled back" in str(errors[0])
    assert tree_sha256(config) == pristine


# =========================================================================== pct losing exit codes


@pytest.mark.slow
def test_exit_status_survives_an_lxc_that_loses_it(sshd: FakeHost):
    sshd.make_ct(LOSSY_CT, lose_exit_status=True)
    ssh = sshd.ssh()
    # Control: this container really reports 0 for a failing command.
    raw = ssh.run(["pct", "exec", str(LOSSY_CT), "--keep-env", "0", "--", "sh", "-c", "exit 9"])
    assert raw.rc == 0
    pct = Pct(ssh, LOSSY_CT)
    assert pct.run(["sh", "-c", "exit 9"]).rc == 9
    assert pct.run(["sh", "-c", "kill -KILL $$"]).rc == 137
    assert pct.run(["true"]).rc == 0


@pytest.mark.parametrize(("python", "code", "fragment"), [
    ("/opt/nowhere/bin/python3", 3, "not found"),
    (sys.executable, 0, ""),
])
@pytest.mark.slow
def test_the_cli_exit_code_survives_an_lxc_that_loses_it(sshd: FakeHost, tmp_path: Path, python: str, code: int,
                                                         fragment: str):
    sshd.make_ct(LOSSY_CT, lose_exit_status=True)
    config = sshd.write_config(tmp_path / "dynctl.toml",
                               {"box": {"ssh": sshd.target, "pct": LOSSY_CT, "python": python}})
    out = dynctl("status", config=config)
    assert out.returncode == code, out.stdout + out.stderr
    assert fragment in out.stderr
