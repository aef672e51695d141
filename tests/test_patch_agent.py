"""The patch on a host: the agent's patch_read / patch_apply / patch_revert / releases on real sglang trees.

The host is this machine (Local transport, sys.executable as the server's python); the sglang tree is a
real wheel from PyPI unpacked into tmp_path. Failure cases use real mechanisms: a bind mount made
read-only (EROFS), a small tmpfs that fills up (ENOSPC), a real symlink.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import py_compile
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from patch_checks import check_all
from sglang_trees import install_sglang
from typer.testing import CliRunner

from dynctl.agent.client import AgentClient, AgentError
from dynctl.cli import app
from dynctl.base.config import HostConfig
from dynctl.base.errors import PreflightError
from dynctl.patching import TARGET_FILES, PatchRefused, variant_for
from dynctl.patching.host import apply_plan, plan_for_apply, read_patch_state
from dynctl.patching.recipe import target_files
from dynctl.patching.versions import is_measured
from dynctl.transport.local import Local

pytestmark = pytest.mark.slow

PATCH_VERSIONS = ["0.5.6", "0.5.7", "0.5.8", "0.5.9", "0.5.10", "0.5.11", "0.5.12", "0.5.14"]
SERVER_ARGS = "srt/server_args.py"


@dataclass
class Box:
    version: str
    site: Path
    package: Path
    workdir: Path
    agent: AgentClient
    pristine: dict[str, str | None]

    def path(self, rel: str) -> Path:
        return self.package / rel

    def hashes(self) -> dict[str, str | None]:
        return {rel: _sha(self.path(rel)) for rel in _files(self.version)}

    def releases(self) -> list[str]:
        root = self.workdir / "releases"
        return sorted(os.listdir(root)) if root.is_dir() else []

    def leftovers(self) -> list[Path]:
        """Candidate or restore temp files left next to the targets."""
        return [p for rel in _files(self.version) for p in self.path(rel).parent.glob(".*.dynctl-*")]

    def journal(self) -> list[dict]:
        path = self.workdir / "journal.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _files(version: str) -> list[str]:
    """The files the patch of `version` changes; for a release it cannot patch, every file it may touch."""
    try:
        return target_files(variant_for(version))
    except PreflightError:
        return target_files()


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


# What the patch reads and writes, for the tests that need no whole tree (unpacking one takes ~2 s).
PATCH_SUBTREE = ("sglang/srt/server_args.py", "sglang/srt/managers/", "sglang/srt/speculative/",
                 "sglang/srt/arg_groups/",  # 0.5.19 on: the pipeline and, from 0.5.20, the spec fields
                 "sglang/srt/mem_cache/allocation.py")  # 0.5.16-0.5.18: the spec decode's allocation


@pytest.fixture
def make_box(tmp_path: Path):
    def make(version: str, name: str = "box", whole: bool = False, strategy: str = "auto") -> Box:
        site = tmp_path / f"site-{name}"
        package = install_sglang(version, site, only=None if whole else PATCH_SUBTREE)
        workdir = tmp_path / f"wd-{name}"
        host = HostConfig(name=name, python=sys.executable, workdir=str(workdir), env={"PYTHONPATH": str(site)},
                          strategy=strategy)
        box = Box(version, site, package, workdir, AgentClient(Local(), host), {})
        box.pristine = box.hashes()
        return box

    return make


def _compile_cached(path: Path) -> Path:
    """Leave a __pycache__ entry for `path`, as a server start would."""
    return Path(py_compile.compile(str(path), doraise=True))


# --------------------------------------------------------------------------- the round trip, every version


@pytest.mark.parametrize("version", ["0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18",
                                     "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"])
def test_current_releases_round_trip(make_box, version: str, tmp_path: Path) -> None:
    """The variants of 0.5.15 on apply and revert byte for byte: the measured ones (to 0.5.17) under
    strategy = "auto", saying the targets their GPU runs miss; the others when the host asks for the
    patch, saying they were not measured."""
    measured = is_measured(version)
    auto = read_patch_state(make_box(version, name="auto").agent)
    assert auto.strategy == ("patch" if measured else "native")
    box = make_box(version, strategy="auto" if measured else "patch")
    state = read_patch_state(box.agent)
    assert (state.strategy, state.status) == ("patch", "not applied")
    said = "patch measured on a GPU; short of a target: " if measured else "patch not measured on a GPU for sglang "
    assert said in state.detail
    result = apply_plan(box.agent, plan_for_apply(state), threshold=5)
    texts = {rel: box.path(rel).read_text() for rel in _files(version)}
    for rel, text in texts.items():
        compile(text, rel, "exec")
    check_all(texts, variant_for(version))
    assert read_patch_state(box.agent).status == "applied"
    assert box.agent.call("patch_revert")["reverted"][0]["release"] == result["release"]
    assert box.hashes() == box.pristine


@pytest.mark.parametrize("version", PATCH_VERSIONS)
def test_apply_check_revert_round_trip(make_box, version: str, tmp_path: Path) -> None:
    box = make_box(version, whole=True)
    stale = [_compile_cached(box.path(rel)) for rel in TARGET_FILES(version)[:3]]

    state = read_patch_state(box.agent)
    assert (state.version, state.strategy, state.status) == (version, "patch", "not applied")
    result = apply_plan(box.agent, plan_for_apply(state), threshold=5)

    # every touched file compiles, and carries every piece of the patch
    texts = {}
    for rel in TARGET_FILES(version):
        py_compile.compile(str(box.path(rel)), cfile=str(tmp_path / "check.pyc"), doraise=True)
        texts[rel] = box.path(rel).read_text()
    check_all(texts, variant_for(version))
    assert not any(p.exists() for p in stale), "stale __pycache__ entries survived the swap"
    assert sorted(result["pycache_dropped"]) == sorted(p.name for p in stale)
    assert box.leftovers() == []

    manifest = json.loads((box.workdir / "releases" / result["release"] / "manifest.json").read_text())
    assert manifest["state"] == "applied" and manifest["threshold"] == 5 and manifest["sglang_version"] == version
    assert {f["path"]: f["sha256_before"] for f in manifest["files"]} == box.pristine
    assert {f["path"]: f["sha256_after"] for f in manifest["files"]} == box.hashes()
    assert (box.workdir / "current").read_text().strip() == result["release"]
    for rel, sha in box.pristine.items():
        backup = box.workdir / "releases" / result["release"] / "orig" / rel
        assert _sha(backup) == sha  # None for the new module: nothing to back up
    # sglang's own deps are not installed here: the import check says so instead of failing
    assert result["import_check"]["ran"] is False
    assert result["import_check"]["detail"].startswith("import check could not run: ModuleNotFoundError")

    # applying again changes nothing and makes no release
    again = read_patch_state(box.agent)
    assert again.status == "applied" and again.detail.startswith("already applied, intact")
    assert apply_plan(box.agent, plan_for_apply(again))["already"] is True
    assert box.releases() == [result["release"]]

    stale = [_compile_cached(box.path(rel)) for rel in TARGET_FILES(version)]
    reverted = box.agent.call("patch_revert")
    assert reverted["current"] is None and reverted["reverted"][0]["release"] == result["release"]
    assert box.hashes() == box.pristine  # byte for byte, and the new module is gone
    assert not box.path("srt/speculative/spec_batch_threshold.py").exists()
    assert not any(p.exists() for p in stale)
    assert not (box.workdir / "current").exists()
    # reverting twice is harmless
    assert box.agent.call("patch_revert", release=result["release"])["reverted"][0]["already"] is True
    events = [e["event"] for e in box.journal()]
    for step in ("patch.apply.begin", "patch.candidates.written", "patch.candidates.compiled", "patch.backup.done",
                 "patch.swap.file", "patch.pycache.dropped", "patch.import_check", "patch.apply.done",
                 "patch.revert.begin", "patch.revert.file", "patch.revert.done"):
        assert step in events, step
    assert oct((box.workdir / "journal.jsonl").stat().st_mode & 0o777) == "0o600"


# --------------------------------------------------------------------------- refusals that change nothing


def test_hand_edited_file_is_refused_and_nothing_written(make_box) -> None:
    box = make_box("0.5.9")
    target = box.path(SERVER_ARGS)
    target.write_text(target.read_text().replace("# Handle model loading format.", "# edited on the box"))
    edited = box.hashes()
    state = read_patch_state(box.agent)
    assert state.status == "refused" and "srt/server_args.py: edited by hand" in state.detail
    with pytest.raises(PatchRefused) as err:
        plan_for_apply(state)
    assert err.value.exit_code == 3
    assert box.hashes() == edited and box.releases() == [] and box.leftovers() == []


def test_seed_bug_missing_comma_is_reported_with_file_and_line(make_box) -> None:
    """The failure SPEC §1 tells of: a candidate server_args.py with a missing comma in add_argument."""
    box = make_box("0.5.9")
    plan = plan_for_apply(read_patch_state(box.agent))
    files = plan.files_for_agent()
    entry = next(f for f in files if f["path"] == SERVER_ARGS)
    broken = entry["text"].replace('            metavar="N",\n', '            metavar="N"\n', 1)
    assert broken != entry["text"]
    line = broken[: broken.index('            metavar="N"\n')].count("\n") + 1
    entry.update(text=broken, sha256_after=hashlib.sha256(broken.encode()).hexdigest())

    with pytest.raises(AgentError) as err:
        box.agent.call("patch_apply", files=files, sglang_version="0.5.9")
    message = str(err.value)
    assert err.value.kind == "preflight" and err.value.exit_code == 3
    assert f"candidate for {box.path(SERVER_ARGS)} does not compile" in message
    assert f"line {line}: SyntaxError: invalid syntax. Perhaps you forgot a comma?" in message
    assert message.endswith('(metavar="N"); nothing was changed')
    assert err.value.answer["compile_errors"][0]["lineno"] == line
    assert box.hashes() == box.pristine, "an original was touched"
    assert box.releases() == [], "a backup or release directory was left behind"
    assert box.leftovers() == [], "a candidate was left next to its target"
    assert next(e for e in box.journal() if e["event"] == "patch.apply.refused")["step"] == "py_compile"


def test_file_changed_between_read_and_apply_is_refused(make_box) -> None:
    box = make_box("0.5.10")
    plan = plan_for_apply(read_patch_state(box.agent))
    box.path("srt/managers/scheduler.py").write_text(box.path("srt/managers/scheduler.py").read_text() + "\n")
    changed = box.hashes()
    with pytest.raises(AgentError, match=r"scheduler.py changed since it was read.*nothing was changed"):
        apply_plan(box.agent, plan)
    assert box.hashes() == changed and box.releases() == [] and box.leftovers() == []


def test_symlinked_target_is_refused(make_box, tmp_path: Path) -> None:
    box = make_box("0.5.11")
    real = tmp_path / "elsewhere" / "server_args.py"
    real.parent.mkdir()
    os.replace(box.path(SERVER_ARGS), real)
    box.path(SERVER_ARGS).symlink_to(real)
    state = read_patch_state(box.agent)
    assert state.files[SERVER_ARGS]["symlink"] == str(box.path(SERVER_ARGS))
    with pytest.raises(AgentError, match=r"server_args.py is a symlink \(to .*elsewhere/server_args.py\): refusing"):
        apply_plan(box.agent, plan_for_apply(state))
    assert box.path(SERVER_ARGS).is_symlink() and _sha(real) == box.pristine[SERVER_ARGS]
    assert box.hashes() == box.pristine and box.releases() == [] and box.leftovers() == []


@contextlib.contextmanager
def _mounted(argv_mount: list[list[str]], where: Path) -> Iterator[None]:
    """Run mount commands (root); skip, saying why, where this machine does not allow it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount (CI runs as root); as a normal user chmod would do instead")
    for argv in argv_mount:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            subprocess.run(["umount", str(where)], capture_output=True, check=False)
            pytest.skip(f"{' '.join(argv)} is not allowed here: {proc.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_read_only_site_packages_is_refused(make_box) -> None:
    """A read-only bind mount over the sglang package (EROFS, which root cannot write through either)."""
    box = make_box("0.5.8")
    pkg = str(box.package)
    with _mounted([["mount", "--bind", pkg, pkg], ["mount", "-o", "remount,bind,ro", pkg, pkg]], box.package):
        refusal = r"cannot write next to .*Read-only file system; nothing was changed"
        with pytest.raises(AgentError, match=refusal) as err:
            apply_plan(box.agent, plan_for_apply(read_patch_state(box.agent)))
        assert err.value.exit_code == 3
        assert box.hashes() == box.pristine and box.leftovers() == []
    assert box.releases() == []


def test_revert_on_a_read_only_package_changes_nothing(make_box) -> None:
    box = make_box("0.5.9")
    apply_plan(box.agent, plan_for_apply(read_patch_state(box.agent)))
    patched = box.hashes()
    pkg = str(box.package)
    with _mounted([["mount", "--bind", pkg, pkg], ["mount", "-o", "remount,bind,ro", pkg, pkg]], box.package):
        with pytest.raises(AgentError, match=r"cannot write in .*Read-only file system; nothing was reverted"):
            box.agent.call("patch_revert")
        assert box.hashes() == patched
    assert box.agent.call("patch_revert")["current"] is None and box.hashes() == box.pristine


def test_disk_full_while_backing_up_swaps_nothing(make_box) -> None:
    """releases/ on a 64 KiB tmpfs: the server_args.py backup (300+ KB) hits a real ENOSPC."""
    box = make_box("0.5.12")
    releases = box.workdir / "releases"
    releases.mkdir(parents=True)
    with _mounted([["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(releases)]], releases):
        with pytest.raises(AgentError) as err:
            apply_plan(box.agent, plan_for_apply(read_patch_state(box.agent)))
        # nothing was swapped, so nothing changed: a pre-flight refusal (3), not a failed operation (1)
        assert err.value.kind == "preflight" and err.value.exit_code == 3
        assert "No space left on device" in str(err.value)
        assert "nothing was swapped and no release was kept: nothing was changed" in str(err.value)
        assert box.hashes() == box.pristine and box.leftovers() == []
        assert os.listdir(releases) == [], "a half-made backup was left on the full disk"
    assert not (box.workdir / "current").exists()


# --------------------------------------------------------------------------- the import check and rollback


def test_failing_import_check_restores_every_original(make_box) -> None:
    """Where sglang imports, launch_server --help must list the flag; if not, the swap is rolled back.

    This machine has no torch, so sglang's real launch_server cannot import here: the package's
    __init__ and launch_server are replaced by stand-ins whose help text lacks the flag, which
    exercises the agent's check and rollback for real.
    """
    box = make_box("0.5.9")
    box.path("__init__.py").write_text("")
    box.path("launch_server.py").write_text("print('usage: launch_server [--model-path MODEL_PATH]')\n")
    with pytest.raises(AgentError, match=r"does not list --speculative-disable-batch-threshold; every original "
                                         r"was restored") as err:
        apply_plan(box.agent, plan_for_apply(read_patch_state(box.agent)))
    assert err.value.exit_code == 1
    assert box.hashes() == box.pristine and box.releases() == [] and box.leftovers() == []
    assert "patch.apply.rolled_back" in [e["event"] for e in box.journal()]


def test_passing_import_check_is_recorded(make_box) -> None:
    """Stand-ins for sglang's __init__ and launch_server (no torch here): --help lists server_args.py's flags."""
    box = make_box("0.5.10")
    box.path("__init__.py").write_text("")
    box.path("launch_server.py").write_text(
        "import pathlib, re\n"
        "text = (pathlib.Path(__file__).parent / 'srt' / 'server_args.py').read_text()\n"
        "print('\\n'.join(sorted(set(re.findall(r'\"(--[a-z0-9-]+)\",', text)))))\n"
    )
    result = apply_plan(box.agent, plan_for_apply(read_patch_state(box.agent)))
    assert result["import_check"] == {"ran": True, "ok": True,
                                      "detail": "launch_server --help lists --speculative-disable-batch-threshold"}


# --------------------------------------------------------------------------- releases


def test_releases_stack_and_revert_in_order(make_box) -> None:
    box = make_box("0.5.12")
    first = apply_plan(box.agent, plan_for_apply(read_patch_state(box.agent)), threshold=5,
                       launch_argv=["python3", "-m", "sglang.launch_server",
                                    "--speculative-disable-batch-threshold", "5"])
    # a new threshold on an already patched tree: a release that changes no file
    second = box.agent.call("patch_apply", files=[], sglang_version="0.5.12", threshold=9,
                            launch_argv=["x", "--cfg", "{release_dir}/adaptive_spec.json"],
                            artifacts={"adaptive_spec.json": '{"1": {"candidate_steps": [3]}}\n'})
    listing = box.agent.call("releases")
    assert [r["id"] for r in listing["releases"]] == [second["release"], first["release"]]
    assert listing["current"] == second["release"]
    assert second["manifest"]["launch_argv"][-1] == f"{second['release_dir']}/adaptive_spec.json"
    assert Path(second["release_dir"], "adaptive_spec.json").read_text().startswith('{"1"')

    with pytest.raises(AgentError, match=f"release {first['release']} is not the newest in force"):
        box.agent.call("patch_revert", release=first["release"])
    out = box.agent.call("patch_revert")
    assert out["current"] == first["release"] and out["reverted"][0]["files"] == []
    assert box.hashes() != box.pristine  # the first release is still in force
    out = box.agent.call("patch_revert", all=True)
    assert [r["release"] for r in out["reverted"]] == [first["release"]] and out["current"] is None
    assert box.hashes() == box.pristine
    with pytest.raises(AgentError, match="no release is in force: nothing to revert") as err:
        box.agent.call("patch_revert")
    assert err.value.exit_code == 3


def test_interrupted_release_blocks_apply_until_reverted(make_box) -> None:
    box = make_box("0.5.9")
    result = apply_plan(box.agent, plan_for_apply(read_patch_state(box.agent)))
    manifest_path = Path(result["release_dir"]) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["state"] = "applying"  # what an agent killed after the swap leaves behind
    manifest_path.write_text(json.dumps(manifest))
    state = read_patch_state(box.agent)
    assert state.incomplete == [result["release"]]
    with pytest.raises(AgentError, match=f"release {result['release']} was interrupted"):
        box.agent.call("patch_apply", files=[], sglang_version="0.5.9")
    out = box.agent.call("patch_revert")
    assert out["reverted"][0]["release"] == result["release"] and box.hashes() == box.pristine


def test_a_plan_for_another_version_is_refused(make_box) -> None:
    box = make_box("0.5.8")
    plan = plan_for_apply(read_patch_state(box.agent))
    with pytest.raises(AgentError, match="sglang here is 0.5.8, but the plan was made for 0.5.9"):
        box.agent.call("patch_apply", files=plan.files_for_agent(), sglang_version="0.5.9")
    assert box.hashes() == box.pristine


# --------------------------------------------------------------------------- the CLI


def _config(tmp_path: Path, box: Box) -> Path:
    path = tmp_path / "dynctl.toml"
    path.write_text(
        f'default_host = "box"\n[hosts.box]\npython = "{sys.executable}"\nworkdir = "{box.workdir}"\n'
        f'env = {{ PYTHONPATH = "{box.site}" }}\n'
    )
    return path


def test_cli_status_diff_apply_revert(make_box, tmp_path: Path) -> None:
    box = make_box("0.5.11")
    cfg = str(_config(tmp_path, box))
    runner = CliRunner()
    status = runner.invoke(app, ["patch", "status", "--config", cfg, "--json"])
    assert status.exit_code == 0, status.output
    assert json.loads(status.output)["status"] == "not applied"
    diff = runner.invoke(app, ["patch", "diff", "--config", cfg])
    assert diff.exit_code == 0 and '+            "--speculative-disable-batch-threshold",' in diff.output
    refused = runner.invoke(app, ["patch", "apply", "--config", cfg])  # no TTY, no --yes
    assert refused.exit_code == 2 and "refusing without --yes" in refused.output
    assert box.hashes() == box.pristine
    applied = runner.invoke(app, ["patch", "apply", "--config", cfg, "--yes", "--threshold", "7", "--json"])
    assert applied.exit_code == 0, applied.output
    assert json.loads(applied.output)["manifest"]["threshold"] == 7
    again = runner.invoke(app, ["patch", "apply", "--config", cfg, "--yes"])
    assert again.exit_code == 0 and "already applied, intact" in again.output
    reverted = runner.invoke(app, ["patch", "revert", "--config", cfg, "--yes"])
    assert reverted.exit_code == 0 and "reverted" in reverted.output
    assert box.hashes() == box.pristine


@pytest.mark.parametrize("threshold", ["-2", "abc", "1e3", "1000001"])
def test_cli_bad_threshold_exits_2_before_touching_the_host(make_box, tmp_path: Path, threshold: str) -> None:
    box = make_box("0.5.9")
    result = CliRunner().invoke(app, ["patch", "apply", "--config", str(_config(tmp_path, box)), "--yes",
                                      f"--threshold={threshold}"])
    assert result.exit_code == 2 and "--threshold" in result.output
    assert box.hashes() == box.pristine and not box.workdir.exists()


@pytest.mark.parametrize(("version", "code", "text"), [
    ("0.5.13", 3, "sglang 0.5.13 is not supported"),
    ("0.5.23", 3, "sglang 0.5.23 uses the native strategy: there is no file to patch"),
])
def test_cli_apply_on_versions_without_a_patch(make_box, tmp_path: Path, version: str, code: int, text: str) -> None:
    box = make_box(version)
    result = CliRunner().invoke(app, ["patch", "apply", "--config", str(_config(tmp_path, box)), "--yes"])
    assert result.exit_code == code and text in " ".join(result.output.split())
    status = CliRunner().invoke(app, ["patch", "status", "--config", str(_config(tmp_path, box)), "--json"])
    assert json.loads(status.output)["strategy"] == ("unsupported" if version == "0.5.13" else "native")


# --------------------------------------------------------------------------- validation staged ahead of the switch


def _compile_events(box: Box) -> list[dict]:
    return [e for e in box.journal() if e["event"] == "patch.candidates.compiled"]


def test_staged_validation_touches_nothing_and_stands_in_for_the_apply_compile(make_box) -> None:
    box = make_box("0.5.9")
    files = plan_for_apply(read_patch_state(box.agent)).files_for_agent()
    staged = box.agent.call("deploy_stage", files=files, sglang_version="0.5.9")
    key = staged["staged"]
    assert key and staged["reused"] is False
    # staged, never switched: sglang's tree as it was, no release, no candidate; one record in the workdir
    assert box.hashes() == box.pristine and box.releases() == [] and box.leftovers() == []
    assert sorted(os.listdir(box.workdir / "staged")) == [f"{key}.json"]
    assert box.agent.call("deploy_stage", files=files, sglang_version="0.5.9") == {"staged": key, "reused": True}
    box.agent.call("patch_apply", files=files, sglang_version="0.5.9", staged=key)
    [compiled] = _compile_events(box)
    assert compiled["staged"] == key  # the apply ran no py_compile of its own
    assert not (box.workdir / "staged").exists()  # the record is used once
    assert box.hashes() != box.pristine


def test_a_staged_record_of_other_texts_is_not_trusted(make_box) -> None:
    box = make_box("0.5.9")
    files = plan_for_apply(read_patch_state(box.agent)).files_for_agent()
    key = box.agent.call("deploy_stage", files=files, sglang_version="0.5.9")["staged"]
    entry = next(f for f in files if f["path"] == SERVER_ARGS)
    broken = entry["text"].replace('            metavar="N",\n', '            metavar="N"\n', 1)
    entry.update(text=broken, sha256_after=hashlib.sha256(broken.encode()).hexdigest())
    with pytest.raises(AgentError, match="does not compile") as err:  # validated again, and refused
        box.agent.call("patch_apply", files=files, sglang_version="0.5.9", staged=key)
    assert err.value.exit_code == 3
    assert box.hashes() == box.pristine and box.releases() == [] and box.leftovers() == []
    assert not (box.workdir / "staged").exists()
    assert box.agent.call("deploy_stage", files=files, sglang_version="0.5.9")["staged"] is None  # nor staged
    assert box.hashes() == box.pristine and not any((box.workdir / "staged").glob("*.json"))
