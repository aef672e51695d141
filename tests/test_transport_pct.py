"""`pct exec` through real SSH to the pct stand-in: exit status, environment, refusals, files."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

from dynctl.agent.client import AgentClient
from dynctl.base.config import load_config
from dynctl.base.errors import UnreachableError
from dynctl.transport import Result, Transport, close_all, connect
from dynctl.transport.local import Local
from dynctl.transport.pct import RC_MARK, Pct
from sshd_harness import FakeHost

pytestmark = pytest.mark.slow

_next_ct = iter(range(200, 1000))


@pytest.fixture
def ct(sshd: FakeHost) -> int:
    """A fresh running container id (ids are never reused within a session)."""
    ctid = next(_next_ct)
    sshd.make_ct(ctid)
    return ctid


def calls_for(sshd: FakeHost, ctid: int) -> list[str]:
    return [c for c in sshd.pct_calls() if f" {ctid} " in c + " "]


def test_runs_inside_the_container_with_a_clean_environment(sshd: FakeHost, ct: int):
    res = Pct(sshd.ssh(), ct).run(["sh", "-c", "pwd; echo \"PCT_SHIM_ROOT=${PCT_SHIM_ROOT-unset}\"; echo $PATH"])
    cwd, env_line, path = res.stdout.splitlines()
    assert cwd == str(sshd.ct_root(ct))
    assert env_line == "PCT_SHIM_ROOT=unset"  # --keep-env 0: the SSH session's variables stay outside
    assert path == "/sbin:/bin:/usr/sbin:/usr/bin"
    assert calls_for(sshd, ct)[-1].startswith(f"pct exec {ct} --keep-env 0 -- sh -c ")


@pytest.mark.parametrize("script, rc", [
    ("exit 0", 0), ("exit 1", 1), ("exit 3", 3), ("exit 254", 254), ("kill -TERM $$", 143),
])
def test_exit_status(sshd: FakeHost, ct: int, script: str, rc: int):
    assert Pct(sshd.ssh(), ct).run(["sh", "-c", script]).rc == rc


def test_missing_program_is_127(sshd: FakeHost, ct: int):
    res = Pct(sshd.ssh(), ct).run(["no-such-program-xyz"])
    assert res.rc == 127 and b"no-such-program-xyz" in res.err


def test_stderr_is_byte_exact_even_when_it_imitates_the_sentinel(sshd: FakeHost, ct: int):
    fake = RC_MARK + b"0\n"
    script = r"printf '\036__dynctl_rc=0\n' >&2; printf 'no newline at end' >&2; exit 5"
    res = Pct(sshd.ssh(), ct).run(["sh", "-c", script])
    assert res.rc == 5
    assert res.err == fake + b"no newline at end"


def test_stdin_reaches_the_command(sshd: FakeHost, ct: int):
    data = os.urandom(1 << 20)
    res = Pct(sshd.ssh(), ct).run(["sha256sum"], stdin=data)
    assert res.stdout.split()[0] == hashlib.sha256(data).hexdigest()


def test_status_is_checked_once(sshd: FakeHost, ct: int):
    pct = Pct(sshd.ssh(), ct)
    for _ in range(3):
        pct.run(["true"])
    assert [c for c in calls_for(sshd, ct) if c.startswith("pct status")] == [f"pct status {ct} "]


def test_stopped_container_is_refused_before_anything_runs(sshd: FakeHost):
    ctid = next(_next_ct)
    sshd.make_ct(ctid, state="stopped")
    with pytest.raises(UnreachableError, match=rf"container {ctid} is not running on 127\.0\.0\.1") as info:
        Pct(sshd.ssh(), ctid).run(["touch", "should-not-exist"])
    assert info.value.exit_code == 4
    assert calls_for(sshd, ctid) == [f"pct status {ctid} "]
    assert not (sshd.ct_root(ctid) / "should-not-exist").exists()


def test_unknown_container_is_named(sshd: FakeHost):
    ctid = next(_next_ct)
    with pytest.raises(UnreachableError, match=rf"container {ctid} does not exist on 127\.0\.0\.1 "
                                               rf"\(pct: Configuration file 'nodes/.*/lxc/{ctid}\.conf'"):
        Pct(sshd.ssh(), ctid).run(["true"])


def test_container_stopped_after_the_check(sshd: FakeHost, ct: int):
    pct = Pct(sshd.ssh(), ct)
    assert pct.run(["true"]).rc == 0
    sshd.make_ct(ct, state="stopped")
    with pytest.raises(UnreachableError, match=rf"container {ct} is not running on 127\.0\.0\.1 "
                                               rf"\(pct: container '{ct}' not running!\)"):
        pct.run(["true"])


def test_host_without_pct(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no pct here
    with pytest.raises(UnreachableError, match=r"`pct` not found on local: is it a Proxmox VE node\?"):
        Pct(Local(), 129).run(["true"])


def test_container_id_must_be_a_number():
    with pytest.raises(ValueError, match="positive integer"):
        Pct(Local(), "129")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Pct(Local(), True)  # type: ignore[arg-type]


def test_stream_lines_and_exit_status(sshd: FakeHost):
    ctid = next(_next_ct)
    sshd.make_ct(ctid, lose_exit_status=True)
    s = Pct(sshd.ssh(), ctid).open_stream(["sh", "-c", "cat; echo b; echo oops >&2; exit 6"], stdin=b"a\n")
    try:
        assert list(s.lines()) == [b"a\n", b"b\n"]
    finally:
        s.close()
    assert s.rc == 6
    assert s.stderr == b"oops\n"


# Writes stdin to $1 atomically: temp file in the same directory, chmod, rename. A constant script with its
# arguments positional: binary stdin and a hostile path through the pct layer's quoting, unharmed.
ATOMIC_WRITE_SH = (
    'set -e; d=$(dirname -- "$1"); mkdir -p -- "$d"; t="$d/.$(basename -- "$1").tmp.$$"; '
    'trap \'rm -f -- "$t"\' EXIT; cat > "$t"; chmod "$2" "$t"; mv -f -- "$t" "$1"; trap - EXIT'
)


def write_file_atomic(transport: Transport, path: str, data: bytes, mode: int = 0o600) -> Result:
    return transport.run(["sh", "-c", ATOMIC_WRITE_SH, "sh", path, f"{mode:o}"], stdin=data, timeout=60)


def test_write_file_atomic_into_a_path_with_spaces_and_dollar(sshd: FakeHost, ct: int):
    target = "work dir/$HOME `x` 'q'/agent.py"
    data = os.urandom(200_000)
    res = write_file_atomic(Pct(sshd.ssh(), ct), target, data, mode=0o600)
    assert res.rc == 0, res.stderr
    written = sshd.ct_root(ct) / target
    assert written.read_bytes() == data
    assert written.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in written.parent.iterdir()] == ["agent.py"]


def test_agent_through_ssh_and_pct_from_a_written_config(sshd: FakeHost, ct: int, tmp_path: Path):
    cfg = sshd.write_config(tmp_path / "dynctl.toml", {"box": {
        "ssh": sshd.target, "pct": ct, "python": sys.executable, "workdir": "~/work $dir", "port": 30000,
    }})
    config = load_config(cfg)
    host = config.host("box")
    try:
        transport = connect(host, config)
        assert transport.description == f"ssh {sshd.target} → pct {ct}"
        assert AgentClient(transport, host).call("ping")["pong"] is True
        assert (sshd.ct_root(ct) / "work $dir").is_dir()
    finally:
        close_all()
