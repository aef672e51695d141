"""Faults around host operations: a connection cut right after the start, Ctrl-C, a full disk, a relative
workdir, release ids typed short, an interrupted release.
Real sshd, the `pct` stand-in, the demo host, real tmpfs mounts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dynctl.core import deploy as core
from dynctl.agent import archive
from dynctl.core import operations
from dynctl.agent.client import AgentClient, AgentError
from dynctl.cli.common import HostSession
from dynctl.base.config import HostConfig
from dynctl.base.errors import ConfigError, DynctlError, PreflightError
from dynctl.patching.host import apply_plan, plan_for_apply, read_patch_state
from dynctl.transport.local import Local
from polling import wait_for
from demo_box import CTID, dynctl, server_info, server_pid, session, start_baseline, tree_sha256, with_text
from test_patch_agent import _mounted, make_box  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

POLICY = "srt/speculative/spec_batch_threshold.py"


def workdir_of(config: Path) -> Path:
    return Path(session(config).host.workdir)


@pytest.fixture
def cut_when() -> Iterator[Callable[[Callable[[], bool], Callable[[], None]], threading.Event]]:
    """cut_when(cond, cut): a thread polls `cond` every few ms and calls `cut` once, the moment it holds."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(cond: Callable[[], bool], cut: Callable[[], None]) -> threading.Event:
        done = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                if cond():
                    cut()
                    done.set()
                    return
                stop.wait(0.003)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        threads.append(t)
        return done

    yield start
    stop.set()
    for t in threads:
        t.join(10)


def op_events(workdir: Path) -> list[dict]:
    found = []
    for path in sorted((workdir / "ops").glob("*.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return found


# --------------------------------------------------------------------------- a connection cut right after the start


@pytest.mark.parametrize("verb", ["deploy", "rollback", "restart"])
def test_connection_cut_right_after_the_start_is_followed_to_what_the_host_did(demo_box, sshd, cut_when, verb):
    """The SSH sessions die the moment the host takes its lock: the host finishes, and the client says so."""
    config = demo_box()
    old = start_baseline(config)
    pristine = tree_sha256(config)
    if verb == "rollback":
        first = dynctl("deploy", "--threshold", "5", "--yes", config=config)
        assert first.returncode == 0, first.stdout + first.stderr
    lock = workdir_of(config) / "lock"
    cut = cut_when(lock.exists, sshd.server.drop_connections)
    args = {"deploy": ["deploy", "--threshold", "5"], "rollback": ["rollback"],
            "restart": ["restart", "--grace", "10"]}[verb]
    out = dynctl(*args, "--yes", config=config)
    assert cut.is_set(), "the connection was never cut"
    assert out.returncode == 0, out.stdout + out.stderr
    assert "connection lost; reconnecting" in out.stdout + out.stderr
    info = server_info(config)
    if verb == "deploy":
        assert "threshold 5 in force" in out.stdout
        assert info["internal_states"][0]["speculative_disable_batch_threshold"] == 5
    elif verb == "rollback":
        assert "rolled back" in out.stdout and tree_sha256(config) == pristine
    else:
        assert "/generate returned" in out.stdout
        assert server_pid(config) not in (None, old) and info is not None
    listing = dynctl("ops", "list", "--json", config=config)
    assert listing.returncode == 0, listing.stderr
    assert [o["state"] for o in json.loads(listing.stdout) if o["kind"] == verb][:1] == ["done"]


@pytest.mark.parametrize("when", ["stop", "start", "ready"])
def test_connection_cut_during_stop_or_start_reports_what_the_host_did(demo_box, sshd, cut_when, when):
    """stop and start are verbs that find what an earlier request did: after the cut, the client sends them again."""
    config = demo_box()
    workdir = workdir_of(config)
    if when == "stop":
        start_baseline(config)
    # "ready": the server is spawned and the client waits for it to be ready
    cond = (workdir / ("server.json" if when == "ready" else "lock")).exists
    cut = cut_when(cond, sshd.server.drop_connections)
    args = ["stop", "--grace", "10"] if when == "stop" else ["start"]
    out = dynctl(*args, "--yes", config=config)
    assert cut.is_set(), "the connection was never cut"
    assert out.returncode == 0, out.stdout + out.stderr
    if when == "stop":
        assert server_pid(config) is None
    else:
        assert server_info(config) is not None and "/generate returned" in out.stdout


def test_the_same_operation_id_twice_starts_one_operation(local_demo):
    """A client that lost its connection before it saw a word sends the same request again: one operation."""
    agent = local_demo.agent
    op_id = operations.new_op_id("rollback")
    params = {"baseline_argv": ["x"], "to": "no-such-release"}
    first = list(operations.run(agent, "rollback", params, op_id))
    again = list(operations.run(agent, "rollback", params, op_id))
    assert [e["type"] for e in first] == ["started", "final"]
    assert again == first  # the second request followed the first's events; it started nothing
    assert "no release 'no-such-release' in force" in first[-1]["error"]
    records = sorted(p.name for p in (Path(local_demo.host.workdir) / "ops").iterdir() if op_id in p.name)
    assert records == [f"{op_id}.json", f"{op_id}.jsonl", f"{op_id}.log"]
    with pytest.raises(AgentError, match="already used by a rollback, not a deploy") as err:
        agent.call("op_start", kind="deploy", op_id=op_id, params={})
    assert err.value.exit_code == 2


# --------------------------------------------------------------------------- Ctrl-C and `dynctl ops follow`


def interrupt_dynctl(config: Path, args: list[str], when: Callable[[], bool]) -> tuple[int, str, str]:
    """Run `dynctl ARGS --yes` and press Ctrl-C (SIGINT) as soon as `when` holds; its exit code and output."""
    proc = subprocess.Popen([sys.executable, "-m", "dynctl", *args, "--yes", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    try:
        wait_for(when, 120, f"the moment to interrupt `dynctl {' '.join(args)}`")
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints where every thread of it waits
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"`dynctl {' '.join(args)}` went on 120 s after Ctrl-C:\n{out}\n{err}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def test_ctrl_c_during_a_deploy_says_it_goes_on_and_ops_follow_reattaches(demo_box):
    config = demo_box(DYNCTL_SIM_SLOW_HEALTH="2")  # a health gate long enough to press Ctrl-C in
    start_baseline(config)
    workdir = workdir_of(config)
    rc, out, err = interrupt_dynctl(config, ["deploy", "--threshold", "5"],
                                    lambda: any(e.get("step") == "ready" for e in op_events(workdir)))
    assert rc == 130, out + err
    assert "the deploy continues on the host" in err and "`dynctl rollback` to undo it" in err
    op_id = re.search(r"`dynctl ops follow (\S+)`", err).group(1)
    assert (workdir / "ops" / f"{op_id}.json").exists()

    latest = dynctl("ops", "follow", "latest", config=config)
    assert latest.returncode == 0, latest.stdout + latest.stderr
    assert "threshold 5 in force" in latest.stdout and "→ ready" in latest.stdout
    by_id = dynctl("ops", "follow", op_id, "--json", config=config)
    assert by_id.returncode == 0 and json.loads(by_id.stdout)["release"]
    assert server_info(config)["internal_states"][0]["speculative_disable_batch_threshold"] == 5


@pytest.mark.parametrize("verb", ["restart", "start"])
def test_ctrl_c_during_a_restart_or_a_start_exits_130_saying_it_goes_on(demo_box, verb):
    config = demo_box(DYNCTL_SIM_SLOW_HEALTH="2")
    workdir = workdir_of(config)
    if verb == "restart":
        start_baseline(config)

    def waiting_for_ready() -> bool:
        if verb == "restart":
            return any(e.get("type") == "step_done" and e.get("step") == "start" for e in op_events(workdir))
        return (workdir / "server.json").exists()

    rc, out, err = interrupt_dynctl(config, [verb], waiting_for_ready)
    assert rc == 130, out + err
    said = " ".join(err.split())
    if verb == "restart":
        assert "the restart continues on the host: `dynctl ops follow" in said
        follow = dynctl("ops", "follow", "latest", config=config)
        assert follow.returncode == 0 and "restarted the server" in follow.stdout, follow.stdout + follow.stderr
    else:
        assert "interrupted: whatever was already asked of the host goes on there" in said
    wait_for(lambda: server_info(config) is not None, 60, "the server to come up all the same")


def test_ops_follow_exits_with_the_operations_outcome(local_demo, tmp_path):
    config = tmp_path / "dynctl.toml"
    agent, host = local_demo.agent, local_demo.host
    failed_plan = core.plan_deploy(agent, host, 5)
    policy = next(f["text"] for f in failed_plan.files if f["path"] == POLICY)
    with_text(failed_plan, POLICY, policy + "\nraise RuntimeError('patched module fails at import')\n")
    with pytest.raises(Exception, match="rolled back"):
        core.deploy(agent, failed_plan, ready_timeout=60)
    failed = dynctl("ops", "follow", "latest", config=config)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "patched module fails" in failed.stdout + failed.stderr and "rolled back" in failed.stderr

    with socket.socket() as foreign:  # a port held by a stranger: refused, nothing changed
        foreign.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        foreign.bind(("127.0.0.1", host.port))
        foreign.listen()
        with pytest.raises(PreflightError):
            core.deploy(agent, core.plan_deploy(agent, host, 5), ready_timeout=60)
    refused = dynctl("ops", "follow", "latest", config=config)
    assert refused.returncode == 3 and "nothing was changed" in refused.stderr

    unknown = dynctl("ops", "follow", "20260101T000000-deploy-abcdef", config=config)
    assert unknown.returncode == 2 and "no operation 20260101T000000-deploy-abcdef" in unknown.stderr


def test_ctrl_c_before_the_host_had_the_request_cancels_it(local_demo):
    """op_detach claims an id the host has not seen, so the request, if it still arrives, starts nothing."""
    agent = local_demo.agent
    op_id = operations.new_op_id("deploy")
    assert agent.call("op_detach", op_id=op_id, kind="deploy")["state"] == "cancelled"
    plan = core.plan_deploy(agent, local_demo.host, 5)
    late = list(operations.run(agent, "deploy", {"files": plan.files}, op_id))
    assert late[-1]["kind"] == "cancelled" and "nothing was changed" in late[-1]["error"]
    assert core.list_releases(agent) == [] and agent.call("op_current")["holder"] is None
    said = str(operations.interrupted(agent, "deploy", op_id))
    assert "the deploy had already ended there" in said and "nothing was changed" in said


# --------------------------------------------------------------------------- a full disk


@contextlib.contextmanager
def nearly_full(folder: Path) -> Iterator[None]:
    """`folder` as it is, on a tmpfs mounted over it with 8 KiB left: less than any file the patch writes there."""
    keep = folder.with_name(folder.name + ".kept")
    shutil.copytree(folder, keep)
    used = sum(p.stat().st_size for p in keep.rglob("*") if p.is_file())
    with _mounted([["mount", "-t", "tmpfs", "-o", f"size={used // 1024 + 256}k", "tmpfs", str(folder)]], folder):
        shutil.copytree(keep, folder, dirs_exist_ok=True)
        filler = folder / "filler"
        filler.write_bytes(b"\0" * (shutil.disk_usage(folder).free - 8192))
        try:
            yield
        finally:
            filler.unlink()


def test_disk_full_while_writing_a_candidate_leaves_no_partial_file(make_box):
    """srt/speculative/ nearly full: the candidate write itself hits ENOSPC."""
    pbox = make_box("0.5.9")
    with nearly_full(pbox.path("srt/speculative")):
        with pytest.raises(AgentError) as err:
            apply_plan(pbox.agent, plan_for_apply(read_patch_state(pbox.agent)))
        leftovers = pbox.leftovers()
    assert err.value.exit_code == 3, err.value
    assert "No space left on device" in str(err.value) and "nothing was changed" in str(err.value)
    assert leftovers == [], f"a partly written candidate was left: {leftovers}"
    assert pbox.hashes() == pbox.pristine and pbox.releases() == []


def test_disk_full_while_reverting_reverts_nothing(make_box):
    """srt/speculative/ full: the other folders' files must not be put back while this one cannot be."""
    pbox = make_box("0.5.9")
    apply_plan(pbox.agent, plan_for_apply(read_patch_state(pbox.agent)))
    patched = pbox.hashes()
    with nearly_full(pbox.path("srt/speculative")):
        with pytest.raises(AgentError) as err:
            pbox.agent.call("patch_revert")
        during = pbox.hashes()
        leftovers = pbox.leftovers()
    assert err.value.exit_code == 3 and "nothing was reverted" in str(err.value), err.value
    assert "No space left on device" in str(err.value)
    assert during == patched, "a revert that could not finish put some files back"
    assert leftovers == []
    pbox.agent.call("patch_revert")
    assert pbox.hashes() == pbox.pristine


def test_disk_full_workdir_refuses_the_agent_upload_and_leaves_no_temp_file(make_box):
    pbox = make_box("0.5.9")
    pbox.workdir.mkdir()
    with _mounted([["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(pbox.workdir)]], pbox.workdir):
        with pytest.raises(PreflightError) as err:
            pbox.agent.call("releases")
        left = os.listdir(pbox.workdir)
    assert err.value.exit_code == 3
    assert f"cannot write the dynctl agent into {pbox.workdir}: No space left on device" in str(err.value)
    assert left == []


def test_disk_full_workdir_refuses_the_deploy_naming_the_disk(local_demo):
    agent, host = local_demo.agent, local_demo.host
    workdir = Path(host.workdir)
    pristine = {p: p.read_bytes() for p in (Path(host.env["PYTHONPATH"]) / "sglang" / "srt").glob("*.py")}
    plan = core.plan_deploy(agent, host, 5)  # uploads the agent while there is room
    saved = workdir.parent / "agent-saved"
    shutil.copytree(workdir / "agent", saved)
    with _mounted([["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(workdir)]], workdir):
        shutil.copytree(saved, workdir / "agent")
        filler = workdir / "filler"
        with open(filler, "wb") as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        with pytest.raises(DynctlError) as err:
            core.deploy(agent, plan, ready_timeout=60)
        leftovers = [p.name for p in workdir.rglob("*") if ".tmp." in p.name]
        lock = (workdir / "lock").exists()
        filler.unlink()
    assert err.value.exit_code == 3
    assert "no space left in workdir" in str(err.value).lower() and "nothing was changed" in str(err.value)
    assert leftovers == [] and not lock
    assert {p: p.read_bytes() for p in pristine} == pristine


def test_disk_full_while_backing_up_during_a_deploy_exits_3(local_demo):
    """releases/ on a 64 KiB tmpfs: the backup fails before any swap, so nothing changed: exit 3, not 1."""
    agent, host = local_demo.agent, local_demo.host
    site = Path(host.env["PYTHONPATH"]) / "sglang"
    pristine = {p: p.read_bytes() for p in site.joinpath("srt").rglob("*.py")}
    releases = Path(host.workdir) / "releases"
    releases.mkdir(parents=True, exist_ok=True)
    plan = core.plan_deploy(agent, host, 5)
    with _mounted([["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(releases)]], releases):
        with pytest.raises(PreflightError) as err:
            core.deploy(agent, plan, ready_timeout=60)
        assert os.listdir(releases) == []
    assert err.value.exit_code == 3
    assert "No space left on device" in str(err.value) and "nothing was changed" in str(err.value)
    assert {p: p.read_bytes() for p in pristine} == pristine
    assert [p for p in site.rglob(".*.dynctl-*")] == []


def test_old_releases_and_operation_records_are_pruned_to_keep_history(make_box):
    pbox = make_box("0.5.12")
    agent = AgentClient(Local(), HostConfig(name="box", python=sys.executable, workdir=str(pbox.workdir),
                                            env={"PYTHONPATH": str(pbox.site)}, keep_history=2))
    first = apply_plan(agent, plan_for_apply(read_patch_state(agent)), threshold=5)["release"]
    made = []
    for threshold in (6, 7, 8):  # threshold-only releases on top, each reverted again
        made.append(agent.call("patch_apply", files=[], sglang_version="0.5.12", threshold=threshold)["release"])
        agent.call("patch_revert")
    last = agent.call("patch_apply", files=[], sglang_version="0.5.12", threshold=9)["release"]
    kept = pbox.releases()
    assert last in kept and made[-1] in kept  # the newest two
    assert first in kept  # older than keep_history, but in force: a rollback needs its backups
    assert made[0] not in kept and made[1] not in kept
    assert agent.call("releases")["current"] == last

    ops = pbox.workdir / "ops"
    ops.mkdir(exist_ok=True)
    stale = [ops / "20261201T000000-rollback-abcdef.json.tmp.999999999",  # what killed writers leave
             pbox.workdir / "state.json.tmp.999999999"]
    for path in stale:
        path.write_text("{")
    for _ in range(4):
        list(operations.run(agent, "rollback", {"baseline_argv": ["x"], "to": "nope"}))
    records = sorted(p.name for p in ops.iterdir() if p.name.endswith(".json"))
    assert len(records) == 2  # keep_history of them, the one just started included
    assert not [p for p in stale if p.exists()]


@pytest.mark.parametrize("value", ["0", "-3", "'10'", "true", "2.5"])
def test_keep_history_is_validated_like_the_other_keys(tmp_path, value):
    config = tmp_path / "dynctl.toml"
    config.write_text(f"[hosts.a]\nkeep_history = {value}\n")
    out = dynctl("releases", config=config)
    assert out.returncode == 2
    assert f"{config}: hosts.a.keep_history: expected" in " ".join(out.stderr.split())


# --------------------------------------------------------------------------- a relative workdir


@pytest.mark.parametrize("route", ["local", "ssh", "ssh+pct"])
def test_a_relative_workdir_is_refused_for_every_transport(sshd, tmp_path, monkeypatch, route):
    """One rule: absolute or ~/...; a relative one would follow the cwd (local) or the login/container home."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    entry: dict = {"python": sys.executable, "workdir": "dynctl-work"}
    if route != "local":
        entry["ssh"] = sshd.target
    if route == "ssh+pct":
        entry["pct"] = CTID
        sshd.make_ct(CTID)
    config = sshd.write_config(tmp_path / "dynctl.toml", {"box": entry}, default_host="box")
    out = dynctl("releases", config=config)
    assert out.returncode == 2, out.stdout + out.stderr
    said = " ".join(out.stderr.split())
    assert f"{config}: hosts.box.workdir: 'dynctl-work' is relative" in said and "~/" in said
    places = [cwd, sshd.tmp / "home", sshd.ct_root(CTID)]
    assert not [p for p in places if (p / "dynctl-work").exists()]
    with pytest.raises(ConfigError, match="workdir: 'w' is relative"):
        AgentClient(Local(), HostConfig(name="coded", workdir="w"))


def test_the_agent_refuses_a_relative_workdir_itself(tmp_path, monkeypatch):
    """Whatever a client sends: the host side does not guess which directory a relative workdir meant."""
    monkeypatch.chdir(tmp_path)
    request = {"protocol": 1, "verb": "releases", "params": {}, "host": {"workdir": "rel"}, "client": {}}
    proc = subprocess.run([sys.executable, "-m", "dynctl_agent"], env={**os.environ, "PYTHONPATH": str(archive.remote_dir())},
                          input=json.dumps(request), capture_output=True, text=True, timeout=60)
    answer = json.loads(proc.stdout.splitlines()[-1])
    assert proc.returncode == 2 and answer["kind"] == "usage" and "'rel' is relative" in answer["error"]
    assert not (tmp_path / "rel").exists()


# --------------------------------------------------------------------------- release ids and messages


def test_release_ids_are_shown_whole_and_rollback_takes_prefixes(local_demo, tmp_path):
    config = tmp_path / "dynctl.toml"
    agent, host = local_demo.agent, local_demo.host
    first = core.deploy(agent, core.plan_deploy(agent, host, 5), ready_timeout=60, soak=0)["release"]
    second = core.deploy(agent, core.plan_deploy(agent, host, 7), ready_timeout=60, soak=0)["release"]
    listing = subprocess.run([sys.executable, "-m", "dynctl", "releases", "--config", str(config)],
                             capture_output=True, text=True, env=dict(os.environ, COLUMNS="80"), timeout=120)
    assert listing.returncode == 0 and first in listing.stdout and second in listing.stdout

    ambiguous = dynctl("rollback", "--to", "000", "--yes", config=config)
    assert ambiguous.returncode == 2, ambiguous.stderr
    said = " ".join(ambiguous.stderr.split())
    assert "ambiguous" in said and first in said and second in said and "nothing was changed" in said
    unknown = dynctl("rollback", "--to", "0042", "--yes", config=config)
    assert unknown.returncode == 2 and "in force: " in unknown.stderr
    assert server_threshold(local_demo) == 7 and core.list_releases(agent)[0]["state"] == "applied"

    back = dynctl("rollback", "--to", "1", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0, back.stdout + back.stderr
    assert f"to {first}" in back.stdout and server_threshold(local_demo) == 5
    same = dynctl("rollback", "--to", "latest", "--yes", config=config)
    assert same.returncode == 0 and f"already on {first}" in same.stdout


def server_threshold(local_demo) -> int | None:
    info = local_demo.agent.call("server_info")["info"] or {}
    return (info.get("internal_states") or [{}])[0].get("speculative_disable_batch_threshold")


def test_an_interrupted_release_names_the_host_and_rollback_recovers_it(local_demo, tmp_path):
    config = tmp_path / "dynctl.toml"
    agent, host = local_demo.agent, local_demo.host
    site = Path(host.env["PYTHONPATH"]) / "sglang"
    pristine = {p: p.read_bytes() for p in site.joinpath("srt").rglob("*.py")}
    release = core.deploy(agent, core.plan_deploy(agent, host, 5), ready_timeout=60, soak=0)["release"]
    manifest = Path(host.workdir) / "releases" / release / "manifest.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), state="applying")))

    refused = dynctl("deploy", "--threshold", "7", "--yes", config=config)
    assert refused.returncode == 3
    said = " ".join(refused.stderr.split())
    assert f"box: release {release} was interrupted" in said and "`dynctl rollback` reverts it" in said
    back = dynctl("rollback", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0, back.stdout + back.stderr
    assert f"release {release} was interrupted; reverting it first" in back.stdout + back.stderr
    assert {p: p.read_bytes() for p in pristine} == pristine
    assert server_threshold(local_demo) is None and server_info_ok(local_demo)


def server_info_ok(local_demo) -> bool:
    return local_demo.agent.call("server_info")["info"] is not None
