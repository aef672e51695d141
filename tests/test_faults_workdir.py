"""Faults around the workdir: another user's files in it or above it (OpenSSH's StrictModes), a home or
world-writable directory as the workdir, clean-ups that must spare the operator's files, a damaged copy of
the agent, and the messages for a dangling symlink or an unknown ~user.

Real files and real uids (the suite runs as root: 65534 is "another user"), the agent through Local, SSH
and SSH + the `pct` stand-in. Where a refusal promises that nothing was changed, the whole workdir (names,
bytes, owners, modes) is compared before and after; where another user swapped the agent's code, that code
writes a canary file if it ever runs.
"""

from __future__ import annotations

import binascii
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from demo_box import CTID, dynctl, write_config
from dynctl.agent import archive
from dynctl.agent.client import AgentClient, AgentError
from dynctl.base.config import HostConfig
from dynctl.base.errors import ConfigError, DynctlError, PreflightError
from dynctl.transport.local import Local
from dynctl.transport.pct import Pct
from dynctl_agent import oprecords, procfs
from dynctl_agent.protocol import Context
from polling import wait_for
from sshd_harness import FakeHost, free_port

NOBODY = 65534  # another user; /etc/passwd calls it "nobody"
TAG = sys.implementation.cache_tag


def one_line(text: str) -> str:
    return " ".join(text.split())


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root (root included): kind, owner, mode and bytes (or link target)."""
    out = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        if path.is_symlink():
            body: object = os.readlink(path)
        elif path.is_file():
            body = path.read_bytes()
        else:
            body = None
        out[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, body)
    return out


def copy_of(workdir: Path) -> Path:
    return workdir / "agent" / archive.agent_digest()


def agent_for(workdir: str | Path, transport=None, python: str = sys.executable) -> AgentClient:
    return AgentClient(transport or Local(), HostConfig(name="box", python=python, workdir=str(workdir), port=free_port()))


def chown_tree(path: Path, uid: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.lchown(p, uid, uid)


def with_canary(module: Path, canary: Path) -> None:
    """module writes `canary` when it is imported, and otherwise does what it did."""
    future = b"from __future__ import annotations\n"
    head, tail = module.read_bytes().split(future, 1)
    module.write_bytes(head + future + f"open({str(canary)!r}, 'w').write('ran')\n".encode() + tail)


def plant_canary(workdir: Path, canary: Path) -> None:
    """What another user who may write the copy does: verbs.py writes `canary` when it runs (and then works as
    before, so nothing looks amiss), its .pyc goes so the source is what runs, and MANIFEST is rewritten to match."""
    verbs = copy_of(workdir) / "dynctl_agent" / "verbs.py"
    with_canary(verbs, canary)
    for pyc in (verbs.parent / "__pycache__").glob("verbs.*.pyc"):
        pyc.unlink()
    manifest = copy_of(workdir) / "MANIFEST"
    if manifest.exists():
        listed = json.loads(manifest.read_text())
        files = {n: v for n, v in listed["files"].items() if not n.startswith("dynctl_agent/__pycache__/verbs.")}
        data = verbs.read_bytes()
        files["dynctl_agent/verbs.py"] = [len(data), binascii.crc32(data)]
        manifest.write_text(json.dumps({**listed, "files": files}))


def installed_as_shipped(workdir: Path) -> None:
    root = copy_of(workdir)
    for name, data in archive.agent_files().items():
        assert (root / name).read_bytes() == data, name
        stem = Path(name)
        assert (root / stem.parent / "__pycache__" / f"{stem.stem}.{TAG}.pyc").is_file(), name


# --------------------------------------------------------------------------- StrictModes: another user's workdir


def _foreign_workdir(work: Path) -> None:
    chown_tree(work, NOBODY)


def _foreign_agent_dir(work: Path) -> None:
    chown_tree(work / "agent", NOBODY)


def _foreign_module(work: Path) -> None:
    verbs = copy_of(work) / "dynctl_agent" / "verbs.py"
    os.chown(verbs, NOBODY, NOBODY)
    verbs.chmod(0o644)


def _group_writable_workdir(work: Path) -> None:
    work.chmod(0o770)


def _world_writable_package(work: Path) -> None:
    (copy_of(work) / "dynctl_agent").chmod(0o757)


def _group_writable_parent(work: Path) -> None:
    work.parent.chmod(0o775)


def _foreign_parent(work: Path) -> None:
    os.chown(work.parent, NOBODY, NOBODY)


FOREIGN = {
    "workdir owned by another user": (_foreign_workdir, "{work} is owned by nobody (uid 65534), not by root (uid 0) (mode 0700)"),
    "agent/ owned by another user": (_foreign_agent_dir, "{work}/agent is owned by nobody (uid 65534)"),
    "one module owned by another user": (_foreign_module, "{copy}/dynctl_agent/verbs.py is owned by nobody (uid 65534)"),
    "group-writable workdir": (_group_writable_workdir, "{work} is group-writable (mode 0770, owner root (uid 0))"),
    "world-writable package dir": (_world_writable_package, "{copy}/dynctl_agent is world-writable (mode 0757, owner root (uid 0))"),
    "group-writable parent": (_group_writable_parent, "{work.parent} is group-writable (mode 0775, owner root (uid 0))"),
    "parent owned by another user": (_foreign_parent, "{work.parent} is owned by nobody (uid 65534), not by root"),
}


@pytest.mark.parametrize("case", list(FOREIGN))
def test_code_another_user_could_have_changed_never_runs(tmp_path, case):
    """The attack: another user who may write the workdir (or the agent copy, or a directory above it) swaps
    verbs.py for their own code; the next call must refuse before running any of it, name the path, its
    owner or mode and what to do, exit 3 and change nothing."""
    work = tmp_path / "parent" / "work"
    work.parent.mkdir(mode=0o755)
    agent_for(work).call("ping")
    canary = tmp_path / "canary"
    plant_canary(work, canary)
    spoil, said = FOREIGN[case]
    spoil(work)
    before = snapshot(work.parent)
    with pytest.raises(AgentError) as info:
        agent_for(work).call("ping")
    assert not canary.exists()
    assert info.value.exit_code == 3 and info.value.kind == "preflight"
    text = one_line(str(info.value))
    assert said.format(work=work, copy=copy_of(work)) in text, text
    assert f"refusing workdir {work}" in text and "nothing was changed" in text
    if "parent" not in case:
        assert f"chown -R root {work} && chmod -R go-w {work}; remove {work}/agent" in text
    else:
        assert "could replace the workdir" in text and "only you or root can write" in text
        assert (f"chmod go-w {work.parent}" in text) == ("writable" in case)
    assert snapshot(work.parent) == before


def test_a_new_agent_is_not_unpacked_into_another_users_agent_directory(tmp_path):
    """A client with another agent version finds no copy of its own: the upload must not write it into an agent/
    that another user may change under it."""
    work = tmp_path / "work"
    agent_for(work).call("ping")
    shutil.rmtree(copy_of(work))
    os.chown(work / "agent", NOBODY, NOBODY)
    before = snapshot(work)
    with pytest.raises(PreflightError) as info:
        agent_for(work).call("ping")
    assert f"{work}/agent is owned by nobody (uid 65534)" in one_line(str(info.value))
    assert info.value.exit_code == 3 and snapshot(work) == before


@pytest.mark.slow
@pytest.mark.parametrize("route", ["ssh", "ssh+pct"])
def test_another_users_workdir_is_refused_over_ssh_and_pct(sshd: FakeHost, tmp_path, route):
    if route == "ssh":
        transport, work, spec = sshd.ssh(), tmp_path / "work", str(tmp_path / "work")
    else:
        sshd.make_ct(CTID)
        transport, work, spec = Pct(sshd.ssh(), CTID), sshd.ct_root(CTID) / "strict-work", "~/strict-work"
        shutil.rmtree(work, ignore_errors=True)
    agent_for(spec, transport).call("ping")
    canary = tmp_path / "canary"
    plant_canary(work, canary)
    chown_tree(work, NOBODY)
    before = snapshot(work)
    with pytest.raises(AgentError) as info:
        agent_for(spec, transport).call("inspect")
    assert info.value.exit_code == 3
    assert f"{work} is owned by nobody (uid 65534)" in one_line(str(info.value))
    assert not canary.exists() and snapshot(work) == before
    shutil.rmtree(work)


def test_a_root_owned_sticky_directory_ends_the_walk_but_others_do_not(tmp_path):
    """/tmp's kind of directory (root's, sticky, world-writable) may hold a workdir of our own; a world-writable
    one without the sticky bit, or a sticky one that another user owns, may not."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert agent_for(sticky / "work").call("ping")["pong"] is True
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(PreflightError, match=f"{open_dir} is world-writable"):
        agent_for(open_dir / "work").call("ping")
    assert list(open_dir.iterdir()) == []  # the upload refused before it created anything
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o1777)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(PreflightError, match=f"{theirs} is owned by nobody"):
        agent_for(theirs / "work").call("ping")
    assert list(theirs.iterdir()) == []
    # a symlink in the sticky directory that another user owns (and may point elsewhere at any time)
    link = sticky / "link"
    link.symlink_to(sticky / "work")
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(AgentError) as info:
        agent_for(link).call("ping")
    assert f"{link} is a symlink (to {sticky / 'work'}) owned by nobody (uid 65534)" in one_line(str(info.value))
    os.lchown(link, 0, 0)
    assert agent_for(link).call("ping")["pong"] is True  # root's own symlink: fine


# --------------------------------------------------------------------------- StrictModes: records dynctl trusts


def _forge_server_json(work: Path, victim: subprocess.Popen) -> Path:
    argv = wait_for(lambda: procfs.cmdline(victim.pid) == ["sleep", "300"] and ["sleep", "300"], what="sleep's exec")
    record = {"pid": victim.pid, "pid_start": procfs.start_time(victim.pid), "argv": argv,
              "marker": None, "started": "2026-12-01T00:00:00+00:00", "release": None, "port": 1}
    path = work / "server.json"
    path.write_text(json.dumps(record))
    return path


@pytest.mark.parametrize("how", ["owned by another user", "world-writable"])
def test_a_forged_server_json_is_refused_and_nothing_is_signalled(tmp_path, owned, how):
    """Another user writes server.json naming a root process (its pid, start time and command line are public
    in /proc): root's `dynctl stop` must refuse, exit 3, and leave that process alone."""
    work = tmp_path / "work"
    config = write_config(tmp_path / "dynctl.toml", {"box": {"python": sys.executable, "workdir": str(work),
                                                             "port": free_port()}}, default_host="box")
    agent_for(work).call("ping")
    victim = subprocess.Popen(["sleep", "300"])
    owned.append(victim)
    record = _forge_server_json(work, victim)
    if how == "world-writable":
        record.chmod(0o666)
    else:
        os.chown(record, NOBODY, NOBODY)
        record.chmod(0o644)
    before = snapshot(work)
    out = dynctl("stop", "--yes", "--grace", "1", config=config, timeout=120)
    said = one_line(out.stderr + out.stdout)
    assert out.returncode == 3, said
    assert f"{record} is " in said and ("nobody (uid 65534)" in said if how != "world-writable" else "mode 0666" in said)
    assert "nothing was changed" in said
    assert victim.poll() is None and psutil.Process(victim.pid).status() != psutil.STATUS_ZOMBIE
    assert snapshot(work) == before


@pytest.mark.slow
def test_a_forged_server_json_is_refused_over_ssh(sshd: FakeHost, tmp_path, owned):
    work = tmp_path / "work"
    config = sshd.write_config(tmp_path / "dynctl.toml", {"box": {"ssh": sshd.target, "python": sys.executable,
                                                                  "workdir": str(work), "port": free_port()}},
                               default_host="box")
    agent_for(work).call("ping")
    victim = subprocess.Popen(["sleep", "300"])
    owned.append(victim)
    os.chown(_forge_server_json(work, victim), NOBODY, NOBODY)
    before = snapshot(work)
    for verb in ("stop", "status"):
        out = dynctl(verb, "--yes", config=config, timeout=120) if verb == "stop" else dynctl(verb, config=config)
        said = one_line(out.stderr + out.stdout)
        assert out.returncode == 3 and f"{work}/server.json is owned by nobody (uid 65534)" in said, said
    assert victim.poll() is None and snapshot(work) == before


@pytest.mark.parametrize("record", ["lock", "journal.jsonl", "releases", "ops/x.json", "current"])
def test_every_record_dynctl_reads_back_must_be_its_users_alone(tmp_path, record):
    """The lock, the journal, releases/ (what a rollback writes back into sglang) and ops/: another user's file
    anywhere there (or a symlink) is a pre-flight refusal for every verb."""
    work = tmp_path / "work"
    agent_for(work).call("ping")
    path = work / record
    path.parent.mkdir(exist_ok=True)
    if record == "releases":
        (path / "0001-20261201T000000Z" / "orig").mkdir(parents=True)
        path = path / "0001-20261201T000000Z" / "orig" / "scheduler.py"
    path.write_text("{}")
    os.chown(path, NOBODY, NOBODY)
    before = snapshot(work)
    for verb in ("releases", "op_list", "server_find"):
        with pytest.raises(AgentError) as info:
            agent_for(work).call(verb)
        assert info.value.exit_code == 3 and f"{path} is owned by nobody (uid 65534)" in one_line(str(info.value))
    os.lchown(path, 0, 0)
    path.unlink()
    path.symlink_to("/etc/passwd")
    with pytest.raises(AgentError, match="is a symlink"):
        agent_for(work).call("releases")
    path.unlink()
    assert agent_for(work).call("releases")["releases"] == []  # the host's own again: answered


# --------------------------------------------------------------------------- home, world-writable, exact names


def test_the_home_directory_itself_is_no_workdir(tmp_path, isolated_home):
    """`workdir = "~"` is a config error; the same directory spelt absolute is refused on the host. Either way
    the operator's files there, which older clean-ups matched (agent-*.py[c], *.tmp.<dead pid>), stay."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    mine = {"agent-notes.py": "notes", "agent-0123456789abcdef.py": "mine too", "agent-tool.pyc": "x",
            f"draft.tmp.{dead.pid}": "half written", f"server.json.tmp.{dead.pid}": "{}"}
    for name, text in mine.items():
        (isolated_home / name).write_text(text)
    before = snapshot(isolated_home)
    for spelling in ("~", "~/", "~/."):
        config = write_config(tmp_path / "dynctl.toml", {"box": {"python": sys.executable, "workdir": spelling}},
                              default_host="box")
        out = dynctl("releases", config=config)
        assert out.returncode == 2 and "is the home directory itself" in one_line(out.stderr), out.stderr
    with pytest.raises(ConfigError, match="home directory itself"):
        AgentClient(Local(), HostConfig(name="coded", workdir="~"))
    config = write_config(tmp_path / "dynctl.toml", {"box": {"python": sys.executable, "workdir": str(isolated_home)}},
                          default_host="box")
    for verb in ("releases", "status"):
        out = dynctl(verb, config=config)
        said = one_line(out.stderr + out.stdout)
        assert out.returncode == 3 and f"refusing workdir {isolated_home}: it is the home directory of root" in said, said
    assert snapshot(isolated_home) == before


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_a_world_or_group_writable_workdir_is_refused(tmp_path, mode):
    work = tmp_path / "shared"
    work.mkdir()
    work.chmod(mode)
    with pytest.raises(PreflightError) as info:
        agent_for(work).call("ping")
    kind = "group" if mode == 0o775 else "world"
    assert f"{work} is {kind}-writable (mode {mode:04o}, owner root (uid 0))" in one_line(str(info.value))
    assert info.value.exit_code == 3 and list(work.iterdir()) == []


def test_cleanups_remove_only_the_names_dynctl_writes(tmp_path):
    """Temp files of killed writers, unpackings of killed uploads and old copies go; files of the operator's that
    merely look alike stay, and so does anything dynctl does not write today."""
    work = tmp_path / "work"
    (work / "agent").mkdir(parents=True)
    (work / "ops").mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    ours = [f"server.json.tmp.{dead.pid}", f"lock.tmp.{dead.pid}", f"current.tmp.{dead.pid}",
            f"ops/20261201T000000-deploy-abcdef.json.tmp.{dead.pid}",
            f"agent/.tmp-0123456789abcdef-{dead.pid}/dynctl_agent/verbs.py"]
    theirs = ["agent-notes.py", "agent-tool.pyc", "agent-0123456789abcdef.py.orig", f"notes.tmp.{dead.pid}",
              "agent-0123456789abcdef.py", "agent-0123456789abcdef.pyc",  # names dynctl no longer writes
              f"ops/readme.tmp.{dead.pid}", f"agent/.tmp-backup-{dead.pid}", "agent/README", "agent/0123456789ABCDEF",
              "agent/old-copy-of-mine"]
    for name in ours + theirs:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("x")
    old_copies = [f"agent/{i:016x}" for i in range(1, 5)]  # copies of older clients, the newest few kept
    for i, name in enumerate(old_copies):
        (work / name / "dynctl_agent").mkdir(parents=True)
        os.utime(work / name, (2_000_000 + i, 2_000_000 + i))
    for name in ("agent/0123456789ABCDEF", "agent/old-copy-of-mine", "agent/README"):
        os.utime(work / name, (1_000_000, 1_000_000))  # older still: first in line if they were taken for copies
    assert agent_for(work).call("ping")["pong"] is True  # the upload's clean-up
    oprecords.prune(Context({"workdir": str(work)}, {"user": "t"}))  # the one operations run
    assert [n for n in ours if (work / n).exists() and not n.startswith("agent/.tmp-")] == []
    assert not (work / f"agent/.tmp-0123456789abcdef-{dead.pid}").exists()
    assert [n for n in old_copies if (work / n).exists()] == old_copies[2:]
    assert [n for n in theirs if not (work / n).exists()] == []


# --------------------------------------------------------------------------- a damaged copy is repaired


def _corrupt_pyc(root: Path) -> None:
    pyc = root / "dynctl_agent" / "__pycache__" / f"verbs.{TAG}.pyc"
    data = pyc.read_bytes()
    pyc.write_bytes(data[:16] + b"\x00garbage" + data[24:-40])  # header intact: the body does not unmarshal


def _deleted_module(root: Path) -> None:
    (root / "dynctl_agent" / "lifecycle.py").unlink()
    (root / "dynctl_agent" / "__pycache__" / f"lifecycle.{TAG}.pyc").unlink()


def _deleted_pyc(root: Path) -> None:
    (root / "dynctl_agent" / "__pycache__" / f"servers.{TAG}.pyc").unlink()


def _edited_source_without_pyc(root: Path, canary: Path) -> None:
    with_canary(root / "dynctl_agent" / "verbs.py", canary)
    (root / "dynctl_agent" / "__pycache__" / f"verbs.{TAG}.pyc").unlink()


def _edited_source_same_size_and_mtime(root: Path, canary: Path) -> None:
    """The package's __init__.py (imported by every verb) becomes code of the very same size and mtime."""
    init = root / "dynctl_agent" / "__init__.py"
    st = init.stat()
    evil = f"open({str(canary)!r}, 'w').write('ran')\n#".encode()
    assert len(evil) < st.st_size
    init.write_bytes(evil.ljust(st.st_size, b"#"))
    os.utime(init, ns=(st.st_atime_ns, st.st_mtime_ns))


def _gone_manifest(root: Path) -> None:
    (root / "MANIFEST").unlink()


DAMAGE = {
    "corrupt .pyc": _corrupt_pyc,
    "deleted module": _deleted_module,
    "deleted .pyc": _deleted_pyc,
    "edited source, .pyc gone": _edited_source_without_pyc,
    "edited source, same size and mtime": _edited_source_same_size_and_mtime,
    "MANIFEST gone": _gone_manifest,
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_agent_copy_is_reinstalled_and_edits_never_run(tmp_path, case):
    """Damage that broke every command with a traceback (a corrupt .pyc, a module gone) or let an edited
    source run: the boot program finds it against MANIFEST, the client installs the copy again, the call
    answers, and the copy is byte for byte what dynctl ships."""
    work = tmp_path / "work"
    agent_for(work).call("ping")
    canary = tmp_path / "canary"
    damage = DAMAGE[case]
    damage(copy_of(work), canary) if "edited" in case else damage(copy_of(work))
    agent = agent_for(work)
    assert agent.call("server_find")["state"] == "down"
    assert agent.round_trips == 3  # found damaged → installed again → answered
    assert not canary.exists()
    installed_as_shipped(work)
    assert sorted(p.name for p in (work / "agent").iterdir()) == [archive.agent_digest()]
    agent.call("ping")
    assert agent.round_trips == 4


def test_a_damaged_copy_is_reinstalled_on_python_3_9(tmp_path):
    exe = shutil.which("pypy3")
    if exe is None:
        pytest.fail("pypy3 not found: apt-get install -y pypy3 (the agent's oldest supported Python, 3.9)")
    work = tmp_path / "work"
    agent_for(work, python=exe).call("ping")
    (pyc,) = (copy_of(work) / "dynctl_agent" / "__pycache__").glob("verbs.pypy*.pyc")
    pyc.write_bytes(pyc.read_bytes()[:40])
    agent = agent_for(work, python=exe)
    assert agent.call("releases")["releases"] == [] and agent.round_trips == 3
    assert json.loads((copy_of(work) / "MANIFEST").read_text())["files"][str(pyc.relative_to(copy_of(work)))][0] \
        == pyc.stat().st_size > 40


def test_refusals_are_worded_on_python_3_9_too(tmp_path):
    """The boot program compiles its refusal texts only when it refuses: on the oldest interpreter as well."""
    exe = shutil.which("pypy3")
    if exe is None:
        pytest.fail("pypy3 not found: apt-get install -y pypy3 (the agent's oldest supported Python, 3.9)")
    work = tmp_path / "work"
    agent_for(work, python=exe).call("ping")
    os.chown(work / "agent", NOBODY, NOBODY)
    with pytest.raises(AgentError, match=f"{work}/agent is owned by nobody \\(uid 65534\\)") as info:
        agent_for(work, python=exe).call("ping")
    assert info.value.exit_code == 3


@pytest.mark.slow
def test_a_damaged_copy_is_reinstalled_through_ssh_and_pct(sshd: FakeHost):
    sshd.make_ct(CTID)
    transport = Pct(sshd.ssh(), CTID)
    work = sshd.ct_root(CTID) / "repair-work"
    shutil.rmtree(work, ignore_errors=True)
    agent_for("~/repair-work", transport).call("ping")
    _corrupt_pyc(copy_of(work))
    _deleted_module(copy_of(work))
    agent = agent_for("~/repair-work", transport)
    assert agent.call("server_find")["state"] == "down" and agent.round_trips == 3
    installed_as_shipped(work)
    shutil.rmtree(work)


def test_a_module_that_does_not_load_is_reinstalled_once_then_named(tmp_path):
    """Damage no MANIFEST can see (here the host's own python: a stdlib module the verb needs is broken) is
    still "install the agent again" the first time, and a clear pre-flight refusal naming the module after,
    not a traceback with exit 1."""
    broken = tmp_path / "broken-stdlib"
    broken.mkdir()
    (broken / "subprocess.py").write_text("raise ImportError('this python cannot import subprocess')\n")
    python = tmp_path / "python-with-broken-stdlib"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={broken} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    work = tmp_path / "work"
    agent = agent_for(work, python=str(python))
    assert agent.call("ping")["pong"] is True  # ping needs no subprocess
    with pytest.raises(PreflightError) as info:
        agent.call("inspect")
    text = one_line(str(info.value))
    assert "does not load hostinfo: ImportError: this python cannot import subprocess" in text, text
    assert "installing the agent again did not repair it" in text and info.value.exit_code == 3
    assert agent.round_trips == 1 + 2 + 3  # ping: upload and call; inspect: 96, repair, 96


# --------------------------------------------------------------------------- messages


@pytest.mark.parametrize("route", ["local", "ssh"])
def test_a_dangling_workdir_symlink_is_named_as_such(sshd: FakeHost, tmp_path, route):
    link = tmp_path / "work"
    link.symlink_to(tmp_path / "nowhere")
    transport = Local() if route == "local" else sshd.ssh()
    with pytest.raises(PreflightError) as info:
        agent_for(link, transport).call("ping")
    text = one_line(str(info.value))
    assert "python interpreter" not in text
    assert f"{link} is a symlink to {tmp_path / 'nowhere'}, which does not exist" in text, text
    assert info.value.exit_code == 3 and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("route", ["local", "ssh"])
def test_an_unknown_user_in_the_workdir_is_named(sshd: FakeHost, tmp_path, monkeypatch, route):
    monkeypatch.chdir(tmp_path)
    transport = Local() if route == "local" else sshd.ssh()
    with pytest.raises(DynctlError) as info:
        agent_for("~nosuchuser/wd", transport).call("ping")
    text = one_line(str(info.value))
    assert "there is no user 'nosuchuser' on this host" in text and "relative" not in text, text
    assert isinstance(info.value, (AgentError, PreflightError))
    assert info.value.exit_code == 3
    assert not (tmp_path / "~nosuchuser").exists() and not (sshd.tmp / "home" / "~nosuchuser").exists()
