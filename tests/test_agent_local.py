"""The host agent through the Local transport: the archive uploaded by hash, protocol, inspect, bad hosts."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from polling import at_once

from dynctl.agent import archive
from dynctl_agent import verbs
from dynctl.agent.client import AgentClient, AgentError
from dynctl.base import sglang
from dynctl.base.config import HostConfig
from dynctl.base.errors import PreflightError
from dynctl.core.inventory import describe_host
from dynctl.transport.local import Local


def make_agent(tmp_path: Path, **overrides) -> AgentClient:
    fields = {"name": "t", "python": sys.executable, "workdir": str(tmp_path / "work"), "port": 1}
    fields.update(overrides)
    return AgentClient(Local(), HostConfig(**fields))


def installed(workdir: Path) -> Path:
    return workdir / "agent" / archive.agent_digest()


def test_uploads_once_under_its_hash(tmp_path):
    agent = make_agent(tmp_path)
    assert agent.call("ping")["pong"] is True
    root = installed(tmp_path / "work")
    for name, data in archive.agent_files().items():
        assert (root / name).read_bytes() == data
        assert (root / name).stat().st_mode & 0o777 == 0o600
    tag = sys.implementation.cache_tag
    assert (root / "dynctl_agent" / "__pycache__" / f"verbs.{tag}.pyc").is_file()  # compiled once, at upload
    assert (root / "dynctl" / "base" / "__pycache__" / f"sglang.{tag}.pyc").is_file()
    assert sorted(p.name for p in (tmp_path / "work" / "agent").iterdir()) == [archive.agent_digest()]
    assert agent.round_trips == 3  # missing → upload → call
    agent.call("ping")
    assert agent.round_trips == 4  # already there: one round trip


def test_workdir_with_spaces_and_dollar(tmp_path):
    agent = make_agent(tmp_path, workdir=str(tmp_path / "a dir $HOME `x`"))
    info = agent.call("inspect")
    assert info["workdir"]["path"] == str(tmp_path / "a dir $HOME `x`")
    assert (installed(tmp_path / "a dir $HOME `x`") / "dynctl_agent" / "verbs.py").is_file()


def test_the_archive_is_the_same_bytes_whatever_the_checkout(tmp_path):
    """Another copy of the sources, written in another order with other mtimes and stale bytecode beside
    them, packs to the very same archive: one content hash per version of the agent."""
    source = archive.remote_dir() / "dynctl_agent"
    copy = tmp_path / "checkout" / "dynctl_agent"
    copy.mkdir(parents=True)
    names = [p.name for p in source.glob("*.py")]
    random.Random(7).shuffle(names)
    for i, name in enumerate(names):
        shutil.copyfile(source / name, copy / name)
        os.utime(copy / name, (1_000_000 + i * 977, 1_000_000 + i * 977))
    (copy / "__pycache__").mkdir()
    (copy / "__pycache__" / "verbs.cpython-311.pyc").write_bytes(b"stale")
    sglang_copy = tmp_path / "sglang.py"
    shutil.copyfile(Path(sglang.__file__), sglang_copy)
    again = archive.build_archive(archive.agent_files(copy, sglang_copy))
    assert again == archive.agent_archive()
    names_inside = zipfile_names(again)
    assert not [n for n in names_inside if "__pycache__" in n or n.endswith(".pyc")]
    assert "dynctl_agent/verbs.py" in names_inside and "dynctl/base/sglang.py" in names_inside


def zipfile_names(data: bytes) -> list[str]:
    import io
    import zipfile

    return zipfile.ZipFile(io.BytesIO(data)).namelist()


def test_concurrent_uploads_leave_one_whole_agent(tmp_path):
    """Two clients uploading the same agent at once: both calls answer, one complete copy is in place and
    no temporary unpacking is left behind."""
    assert at_once(lambda: make_agent(tmp_path).call("ping")["pong"], 4, timeout=120) == [True] * 4
    folder = tmp_path / "work" / "agent"
    assert sorted(p.name for p in folder.iterdir()) == [archive.agent_digest()]
    for name, data in archive.agent_files().items():
        assert (folder / archive.agent_digest() / name).read_bytes() == data


def test_a_dropped_or_damaged_upload_leaves_no_agent(tmp_path):
    """An upload cut short never becomes the agent: a truncated archive is refused before anything is
    written, and the unpacking a killed upload left behind is swept by the next one."""
    work = tmp_path / "work"
    agent = make_agent(tmp_path)
    argv = agent_module().upload_argv(sys.executable, str(work))
    cut = subprocess.run(argv, input=archive.agent_archive()[:5000], capture_output=True, timeout=60)
    assert cut.returncode == 3 and b"arrived damaged" in cut.stderr
    assert not installed(work).exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = work / "agent" / f".tmp-{archive.agent_digest()}-{dead.pid}"
    (leftover / "dynctl_agent").mkdir(parents=True)
    (leftover / "dynctl_agent" / "verbs.py").write_text("half")
    assert agent.call("ping")["pong"] is True
    assert sorted(p.name for p in (work / "agent").iterdir()) == [archive.agent_digest()]


def agent_module():
    import dynctl.agent.client

    return dynctl.agent.client


def test_old_agent_copies_are_pruned(tmp_path):
    """The newest few copies stay (a worker of an older client may still start from one); older ones that
    have not been touched for an hour go."""
    work = tmp_path / "work"
    folder = work / "agent"
    old = [f"{i:016x}" for i in range(1, 6)]
    for i, name in enumerate(old):
        (folder / name / "dynctl_agent").mkdir(parents=True)
        os.utime(folder / name, (1_000_000 + i, 1_000_000 + i))
    (folder / "00000000000000ff").mkdir()  # another client's, uploaded a moment ago
    (work / "journal.jsonl").write_text("")
    assert make_agent(tmp_path).call("ping")["pong"] is True
    kept = sorted(p.name for p in folder.iterdir())
    assert kept == sorted([archive.agent_digest(), "00000000000000ff", old[-1]])
    assert sorted(p.name for p in work.iterdir()) == ["agent", "journal.jsonl"]


def test_a_verb_imports_only_its_own_modules(tmp_path):
    """A ping loads neither bench nor watch nor the lifecycle: verbs import their module when called."""
    make_agent(tmp_path).call("ping")
    root = installed(tmp_path / "work")
    probe = ("import io,json,sys\nsys.path.insert(0, sys.argv[1])\nsys.stdin = io.StringIO(sys.argv[2])\n"
             "from dynctl_agent import verbs\nverbs.main()\n"
             "sys.stderr.write(json.dumps(sorted(m for m in sys.modules if m.startswith('dynctl'))))\n")
    request = {"protocol": 1, "verb": "ping", "host": {"workdir": str(tmp_path / "work")}}
    proc = subprocess.run([sys.executable, "-c", probe, str(root), json.dumps(request)], capture_output=True,
                          text=True, timeout=60)
    assert json.loads(proc.stdout)["result"]["pong"] is True
    assert json.loads(proc.stderr) == ["dynctl", "dynctl.base", "dynctl.base.hostspec", "dynctl_agent",
                                       "dynctl_agent.protocol", "dynctl_agent.verbs"]  # hostspec: the request's host settings checked
    for name, entry in {**verbs.VERBS, **verbs.OPS}.items():  # and every one names a function that is there
        assert callable(verbs.load(entry)), name


def test_missing_python_is_a_preflight_error(tmp_path):
    agent = make_agent(tmp_path, python=str(tmp_path / "no" / "python3"))
    with pytest.raises(PreflightError, match="python interpreter .* not found"):
        agent.call("inspect")


def test_workdir_not_creatable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    agent = make_agent(tmp_path, workdir=str(blocker / "work"))
    with pytest.raises(PreflightError, match="cannot write the dynctl agent"):
        agent.call("ping")
    assert blocker.read_text() == ""


def test_unknown_verb_and_protocol_mismatch(tmp_path):
    agent = make_agent(tmp_path)
    with pytest.raises(AgentError, match="unknown agent verb 'nope'") as info:
        agent.call("nope")
    assert info.value.exit_code == 2
    proc = subprocess.run([sys.executable, "-m", "dynctl_agent"], input=json.dumps({"protocol": 999, "verb": "ping"}),
                          capture_output=True, text=True, cwd=archive.remote_dir())
    answer = json.loads(proc.stdout)
    assert proc.returncode == 2
    assert answer["ok"] is False and "protocol 1" in answer["error"] and "999" in answer["error"]


def test_inspect_without_sglang_says_so(tmp_path):
    agent = make_agent(tmp_path, env={"PYTHONPATH": str(tmp_path / "empty")})
    info = describe_host(agent.host, agent)
    assert info.sglang_version is None
    assert info.strategy == "absent"
    assert info.python_version == "%d.%d.%d" % sys.version_info[:3]


def test_inspect_finds_sglang_without_importing_it(tmp_path):
    """A tree whose __init__ raises on import is still found, with its version from dist-info."""
    site = tmp_path / "site"
    pkg = site / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('heavy import attempted')\n")
    dist = site / "sglang-0.5.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.9\n")
    agent = make_agent(tmp_path, env={"PYTHONPATH": str(site)})
    raw = agent.call("inspect")
    assert raw["sglang"] == {"version": "0.5.9", "package_dir": str(pkg)}


def test_inspect_reports_port_listener(tmp_path):
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        raw = make_agent(tmp_path, port=port).call("inspect")
    assert raw["port_in_use"] is True
    assert [p["pid"] for p in raw["port_listeners"]] == [os.getpid()]
