"""The patch as one transaction: apply a release (validate, back up, swap) and revert one byte for byte."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile

from dynctl_agent import hostinfo, lock, releases, sgltree, store
from dynctl_agent.protocol import AgentError

def patch_read(ctx, files=()):
    """The sglang found on the host, the text and sha256 of `files`, RECORD hashes, and the releases."""
    found = sgltree.installed(ctx)
    package_dir = found["sglang"]["package_dir"]
    out = {}
    for rel in files:
        path = sgltree.target_path(package_dir, rel)
        link = sgltree.symlink_on_path(package_dir, rel)
        if not os.path.isfile(path):
            out[rel] = None if link is None else {"text": None, "sha256": None, "symlink": link}
            continue
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise AgentError("%s is not UTF-8 (byte %d)" % (path, err.start), "preflight")
        out[rel] = {"text": text, "sha256": hashlib.sha256(data).hexdigest(), "symlink": link}
    manifests = releases.manifests(ctx)
    current = releases.current(ctx)
    return {
        "python": found["python"],
        "python_version": found["python_version"],
        "sglang": found["sglang"],
        "files": out,
        "record": sgltree.record_hashes(package_dir, files),
        "current": current,
        "release": next((m for m in manifests if m["id"] == current), None),
        "incomplete": [m["id"] for m in manifests if m.get("state") == "applying"],
    }


def apply_release(ctx, files, sglang_version, strategy="patch", threshold=None, launch_argv=None,
                  artifacts=None, import_check_timeout=300.0, effective_threshold=None, staged=None,
                  package_dir=None, import_checked=None):
    """Swap in new file texts as one transaction and record a release (caller holds the host lock).

    files: [{path, sha256_before, sha256_after, text}] (paths relative to the sglang package).
    Order: preflight → candidates written next to targets → py_compile with the host's python →
    originals backed up → manifest (state applying) → os.replace each → stale __pycache__ dropped →
    import check → manifest (state applied) and `current`. A failure before the swap changes nothing
    and leaves no release directory; a failure after it restores every original first.

    staged: the key stage_release answered for these files; when its record still matches (the same texts,
    the same interpreter), their py_compile was done there and is not run again. The record is removed.
    package_dir, import_checked: what prepare_release found and checked for these files (the sglang package
    is not looked up again, the import check not run again).
    """
    try:
        package_dir = _preflight(ctx, sglang_version, artifacts, package_dir)
        entries = _entries(package_dir, files)
        releases.journal(ctx, "patch.apply.begin", sglang_version=sglang_version, strategy=strategy,
                         threshold=threshold, files=[e["path"] for e in entries])
        apply = _Apply(ctx, package_dir, entries)
        apply.write_candidates()
        if not (staged and _staged_ok(ctx, entries, staged)):
            apply.compile_candidates()
    finally:
        if staged:
            drop_staged(ctx)
    manifest = apply.back_up(sglang_version, strategy, threshold, effective_threshold, launch_argv, artifacts)
    apply.swap()
    if import_checked is not None and strategy == "patch":
        check = import_checked
        releases.journal(ctx, "patch.import_check", release=apply.release_id, ahead=True, **check)
    else:
        check = apply.import_check(strategy, import_check_timeout)
    current = apply.record(manifest, check)
    with contextlib.suppress(OSError):
        releases.prune(ctx)
    return {"release": apply.release_id, "release_dir": apply.release_dir, "current": current, "manifest": manifest,
            "import_check": check, "pycache_dropped": apply.dropped}


STAGED = "staged"  # workdir/staged/<key>.json: a deploy's candidates validated ahead of its switch


def _interpreter(ctx):
    """What decides whether a text compiles: the server's interpreter as resolved now (path, inode, size,
    mtime) and the environment variables it reads; None when it cannot be found."""
    env = hostinfo.server_env(ctx)
    exe = ctx.python if os.sep in ctx.python else shutil.which(ctx.python, path=env.get("PATH"))
    try:
        real = os.path.realpath(exe)
        st = os.stat(real)
    except (OSError, TypeError):
        return None
    return [ctx.python, exe, real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
            sorted((k, v) for k, v in env.items() if k.startswith("PYTHON") or k in ("PATH", "VIRTUAL_ENV"))]


def _staged_key(ctx, entries):
    interpreter = _interpreter(ctx)
    if interpreter is None:
        return None
    what = [interpreter, sorted([e["path"], e["sha256_after"]] for e in entries)]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]


def _staged_ok(ctx, entries, key):
    """Whether the staged record `key` is the validation of exactly these candidates with this interpreter."""
    record = store.read_json(ctx.path(STAGED, "%s.json" % os.path.basename(str(key))))
    if not (isinstance(record, dict) and record.get("ok") and record.get("key") == key
            and _staged_key(ctx, entries) == key):
        return False
    releases.journal(ctx, "patch.candidates.compiled", files=[e["path"] for e in entries], staged=key)
    return True


def drop_staged(ctx):
    """Remove every staged record (each is of use to the next deploy only)."""
    shutil.rmtree(ctx.path(STAGED), ignore_errors=True)


def stage_release(ctx, files, sglang_version):
    """A deploy's validation ahead of its switch, while the gateway drains the host: the same checks of the
    targets and texts as the apply, and py_compile of each text with the server's interpreter, in a folder of
    the workdir. Nothing of sglang's tree or the server is touched, and no lock is taken: what is left is a
    record naming the validated texts and interpreter (reused by a deploy of the same files, a re-run's
    included, and removed by it). Answers {"staged": key} or {"staged": None, "errors": [...]}."""
    package_dir = _preflight(ctx, sglang_version, None)
    return _stage(ctx, _entries(package_dir, files))


def prepare_release(ctx, files, sglang_version, artifacts=None, strategy="patch", import_check_timeout=300.0):
    """What apply_release checks and validates before its first change, done ahead of it (a prepared deploy):
    the installed sglang, the targets as the plan saw them, py_compile of the texts (staged as stage_release
    does) and, for the patch strategy, the import check as it would go with the texts swapped in
    (sgltree.import_check_candidates). Changes nothing; a text that does not compile, or a patched sglang
    that would not start, is refused here, named. Returns {"package_dir", "staged", "import_check"} for
    apply_release."""
    package_dir = _installed_package(ctx, sglang_version)
    for name in artifacts or {}:
        _check_artifact(name)
    entries = _entries(package_dir, files)
    staged = _stage(ctx, entries)
    if staged.get("errors"):
        errors = staged["errors"]
        raise _not_compiled(ctx, None if isinstance(errors[0], dict) else errors[0],
                            [e for e in errors if isinstance(e, dict)])
    check = _import_check_ahead(ctx, package_dir, entries, float(import_check_timeout)) if strategy == "patch" \
        else None
    if check is not None:
        releases.journal(ctx, "patch.import_check.ahead", **check)
    if check is not None and check["ran"] and not check["ok"]:
        raise AgentError("the patched sglang would not start: %s; nothing was changed" % check["detail"], "preflight")
    return {"package_dir": package_dir, "staged": staged["staged"], "import_check": check}


def _write_candidates(folder, entries):
    """Each candidate text as a private file of `folder`; [[that file, the target it stands for], ...]."""
    pairs = []
    for i, e in enumerate(entries):
        name = os.path.join(folder, "%d-%s" % (i, os.path.basename(e["target"])))
        store.write_bytes(name, e["data"], 0o600)
        pairs.append([name, e["target"]])
    return pairs


def _compile(ctx, pairs):
    """py_compile of [[candidate, target], ...] with the server's interpreter: (why it could not run, or None;
    the results of the candidates that do not compile)."""
    rc, out, err = hostinfo.run_python(ctx, hostinfo.program("compile_candidates"), json.dumps(pairs), timeout=120)
    if rc != 0:
        return err.strip()[-500:], []
    return None, [r for r in json.loads(out.strip().splitlines()[-1]) if not r["ok"]]


def _not_compiled(ctx, failed, bad):
    """The refusal for what _compile answered: the first candidate that does not compile, named, or why the
    compile could not run."""
    if failed is not None:
        return AgentError("py_compile with %s failed: %s; nothing was changed" % (ctx.python, failed), "preflight")
    first = bad[0]
    return AgentError("candidate for %s does not compile with %s: line %s: %s: %s%s; nothing was changed"
                      % (first["target"], ctx.python, first["lineno"], first["type"], first["msg"],
                         " (%s)" % first["line"] if first["line"] else ""), "preflight", compile_errors=bad)


def _import_check_ahead(ctx, package_dir, entries, timeout):
    """The import check of the candidates, from a folder of the workdir (the tree is not touched)."""
    if not entries:
        return None
    os.makedirs(ctx.path(STAGED), mode=0o700, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="import-", dir=ctx.path(STAGED))
    try:
        return sgltree.import_check_candidates(ctx, package_dir, _write_candidates(folder, entries), timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _stage(ctx, entries):
    key = _staged_key(ctx, entries)
    if key is None or not entries:
        return {"staged": None, "errors": []}
    record_path = ctx.path(STAGED, "%s.json" % key)
    record = store.read_json(record_path)
    if isinstance(record, dict) and record.get("ok") and record.get("key") == key:
        return {"staged": key, "reused": True}
    drop_staged(ctx)
    os.makedirs(ctx.path(STAGED), mode=0o700, exist_ok=True)
    folder = ctx.path(STAGED, key)
    os.makedirs(folder, mode=0o700)
    try:
        failed, bad = _compile(ctx, _write_candidates(folder, entries))
        if failed is not None or bad:
            return {"staged": None, "errors": [failed] if failed is not None else bad}
        store.write_json_atomic(record_path, {"key": key, "ok": True, "created": store.now_iso(),
                                              "files": [[e["path"], e["sha256_after"]] for e in entries]})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"staged": key, "reused": False}


def _installed_package(ctx, sglang_version):
    """The sglang package directory, once the installed version is the one the plan was made for."""
    found = sgltree.installed(ctx)
    if found["sglang"]["version"] != sglang_version:
        raise AgentError("sglang here is %s, but the plan was made for %s; plan again"
                         % (found["sglang"]["version"], sglang_version), "preflight")
    return found["sglang"]["package_dir"]


def _check_artifact(name):
    if not releases.ARTIFACT.match(name) or name in ("manifest.json", "orig"):
        raise AgentError("bad release artifact name %r" % (name,), "usage")


def _preflight(ctx, sglang_version, artifacts, package_dir=None):
    """The sglang package directory (looked up unless given), once the host is as the plan saw it and no
    release was left half done."""
    if package_dir is None:
        package_dir = _installed_package(ctx, sglang_version)
    ctx.ensure_workdir()
    os.makedirs(releases.root(ctx), mode=0o700, exist_ok=True)
    releases.require_records(ctx)
    incomplete = [m["id"] for m in releases.manifests(ctx) if m.get("state") == "applying"]
    if incomplete:
        raise AgentError(releases.interrupted_message(incomplete[0]), "preflight")
    for name in artifacts or {}:
        _check_artifact(name)
    return package_dir


def _entries(package_dir, files):
    """The files to swap, each target as the plan saw it and none reached through a symlink."""
    entries = []
    for item in files:
        rel = item["path"]
        target = sgltree.target_path(package_dir, rel)
        link = sgltree.symlink_on_path(package_dir, rel)
        if link is not None:
            raise AgentError("%s is a symlink (to %s): refusing to patch through it; nothing was changed"
                             % (link, os.path.realpath(link)), "preflight")
        now = sgltree.sha_or_none(target)
        if now != item["sha256_before"]:
            raise AgentError("%s changed since it was read (sha256 %s, expected %s); nothing was changed"
                             % (target, now, item["sha256_before"]), "preflight")
        data = item["text"].encode("utf-8")
        if hashlib.sha256(data).hexdigest() != item["sha256_after"]:
            raise AgentError("%s: the new text does not match its sha256_after" % rel, "usage")
        entries.append({"path": rel, "target": target, "data": data, "sha256_before": item["sha256_before"],
                        "sha256_after": item["sha256_after"]})
    return entries


class _Apply:
    """One apply's steps and what each left behind, so that a failure undoes exactly that: candidates
    written (removed before the swap), originals swapped out (put back after it)."""

    def __init__(self, ctx, package_dir, entries):
        self.ctx, self.package_dir, self.entries = ctx, package_dir, entries
        self.candidates = []  # written next to their targets and not swapped in yet
        self.swapped = []
        self.dropped = []  # stale __pycache__ files removed
        self.release_id = self.release_dir = None

    def drop_candidates(self):
        for e in self.candidates:
            with contextlib.suppress(OSError):  # absent, or never created (a read-only folder)
                os.unlink(e["candidate"])

    def write_candidates(self):
        """Each new text next to its target, with the target's mode (and owner, when we may)."""
        try:
            for e in self.entries:
                target = e["target"]
                e["candidate"] = os.path.join(os.path.dirname(target),
                                              ".%s.dynctl-new.%d" % (os.path.basename(target), os.getpid()))
                st = os.stat(target) if e["sha256_before"] is not None else None
                e["mode"], e["uid"], e["gid"] = ((stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) if st
                                                 else (0o644, None, None))
                self.candidates.append(e)  # before the write: a half-written candidate (a full disk) is ours to remove
                store.write_bytes(e["candidate"], e["data"], e["mode"])
                os.chmod(e["candidate"], e["mode"])  # not narrowed by the umask
                if st is not None and os.geteuid() == 0:
                    os.chown(e["candidate"], st.st_uid, st.st_gid)
        except OSError as err:
            self.drop_candidates()
            releases.journal(self.ctx, "patch.apply.refused", step="candidates", error=str(err))
            raise AgentError("cannot write next to %s: %s; nothing was changed" % (e["target"], err.strerror or err),
                             "preflight")
        releases.journal(self.ctx, "patch.candidates.written", files=[e["path"] for e in self.entries])

    def compile_candidates(self):
        """py_compile every candidate with the server's interpreter; the first error is refused, named."""
        if not self.entries:
            return
        ctx = self.ctx
        failed, bad = _compile(ctx, [[e["candidate"], e["target"]] for e in self.entries])
        if failed is not None or bad:
            self.drop_candidates()
            if bad:
                releases.journal(ctx, "patch.apply.refused", step="py_compile", errors=bad)
            raise _not_compiled(ctx, failed, bad)
        releases.journal(ctx, "patch.candidates.compiled", files=[e["path"] for e in self.entries])

    def back_up(self, sglang_version, strategy, threshold, effective_threshold, launch_argv, artifacts):
        """The originals and artifacts into a new release directory, then its manifest (state applying)."""
        ctx = self.ctx
        seq, self.release_id = releases.next_id(ctx)
        release_dir = self.release_dir = os.path.join(releases.root(ctx), self.release_id)
        manifest = {
            "id": self.release_id, "seq": seq, "created": store.now_iso(), "who": ctx.who,
            "client": ctx.client.get("hostname"), "sglang_version": sglang_version, "package_dir": self.package_dir,
            "python": ctx.python, "strategy": strategy, "threshold": threshold,
            # what the server enforces when that differs from the threshold asked for (native: CUDA-graph padding)
            "effective_threshold": threshold if effective_threshold is None else effective_threshold,
            "launch_argv": None if launch_argv is None else [str(a).replace("{release_dir}", release_dir)
                                                              for a in launch_argv],
            "files": [{"path": e["path"], "sha256_before": e["sha256_before"], "sha256_after": e["sha256_after"],
                       "mode": e["mode"], "uid": e["uid"], "gid": e["gid"]} for e in self.entries],
            "artifacts": sorted(artifacts or {}), "import_check": None, "state": "applying",
        }
        try:
            os.makedirs(release_dir, mode=0o700)
            for e in self.entries:
                if e["sha256_before"] is not None:
                    self._back_up_one(e)
            for name, text in (artifacts or {}).items():
                store.write_bytes(os.path.join(release_dir, name), text.encode("utf-8"), 0o600)
            store.write_json_atomic(os.path.join(release_dir, "manifest.json"), manifest)
        except (OSError, AgentError) as err:
            self.drop_candidates()
            shutil.rmtree(release_dir, ignore_errors=True)
            releases.journal(ctx, "patch.apply.failed", step="backup", release=self.release_id, error=str(err))
            if isinstance(err, AgentError):
                raise
            raise AgentError("cannot back up the originals into %s on %s: %s; nothing was swapped and no release "
                             "was kept: nothing was changed" % (release_dir, ctx.name, err.strerror or err),
                             "preflight")
        releases.journal(ctx, "patch.backup.done", release=self.release_id, dir=release_dir)
        return manifest

    def _back_up_one(self, e):
        backup = os.path.join(self.release_dir, "orig", *e["path"].split("/"))
        os.makedirs(os.path.dirname(backup), mode=0o700, exist_ok=True)
        with open(e["target"], "rb") as f:
            original = f.read()
        if hashlib.sha256(original).hexdigest() != e["sha256_before"]:
            raise AgentError("%s changed during the backup; nothing was changed" % e["target"], "preflight")
        store.write_bytes(backup, original, 0o600)
        if store.sha256_file(backup) != e["sha256_before"]:
            raise AgentError("backup of %s does not read back intact; nothing was changed" % e["target"],
                             "preflight")

    def roll_back(self, reason):
        """Put every swapped original back, then raise: "failed", with what could not be restored, if any."""
        problems = []
        try:
            staged = sgltree.stage_originals(self.release_dir, list(reversed(self.swapped)), self.package_dir)
        except (OSError, AgentError) as err:
            staged = []
            problems.append("staging the originals: %s" % (getattr(err, "strerror", None) or err))
        for e, tmp in staged:
            try:
                sgltree.put_back(e, tmp, self.package_dir)
            except (OSError, AgentError) as err:
                problems.append("%s: %s" % (e["target"], err))
                sgltree.discard_staged([(e, tmp)])
        self.drop_candidates()
        if not problems:
            shutil.rmtree(self.release_dir, ignore_errors=True)
        releases.journal(self.ctx, "patch.apply.rolled_back", release=self.release_id, reason=reason,
                         problems=problems)
        if problems:
            raise AgentError("%s; rolling back FAILED for %s (backups kept in %s)"
                             % (reason, "; ".join(problems), self.release_dir), "failed")
        self.ctx.changed = False
        raise AgentError("%s; every original was restored" % reason, "failed")

    def swap(self):
        """os.replace each candidate over its target; from the first one on, a failure puts every original back."""
        try:
            for e in self.entries:
                os.replace(e["candidate"], e["target"])
                self.swapped.append(e)
                self.candidates.remove(e)
                releases.journal(self.ctx, "patch.swap.file", release=self.release_id, path=e["path"],
                                 sha256=e["sha256_after"])
                self.ctx.changed = True
                self.dropped += sgltree.drop_pycache(e["target"])
        except Exception as err:  # whatever broke the swap, every original goes back
            self.roll_back("swapping %s failed: %s" % (e["target"], getattr(err, "strerror", None) or err))
        if self.dropped:
            releases.journal(self.ctx, "patch.pycache.dropped", release=self.release_id, files=self.dropped)

    def import_check(self, strategy, timeout):
        """Where sglang imports, the patched tree must start (`launch_server --help` with the flag); else undo."""
        if not self.entries or strategy != "patch":
            return None
        try:
            check = sgltree.import_check(self.ctx, {os.path.realpath(e["target"]) for e in self.swapped}, timeout)
        except Exception as err:  # the check itself broke: what it would have found is unknown, so undo the swap
            self.roll_back("the import check could not run: %s: %s" % (type(err).__name__, err))
        releases.journal(self.ctx, "patch.import_check", release=self.release_id, **check)
        if check["ran"] and not check["ok"]:
            self.roll_back("the patched sglang does not start: %s" % check["detail"])
        return check

    def record(self, manifest, check):
        """The manifest as applied and the release in force; `current` as it is now."""
        manifest["import_check"] = check
        manifest["state"] = "applied"
        manifest["applied"] = store.now_iso()
        try:
            store.write_json_atomic(os.path.join(self.release_dir, "manifest.json"), manifest)
            current = releases.update_current(self.ctx)
        except Exception as err:
            self.roll_back("cannot record release %s: %s" % (self.release_id, getattr(err, "strerror", None) or err))
        self.ctx.changed = True
        releases.journal(self.ctx, "patch.apply.done", release=self.release_id, files=len(self.entries),
                         current=current)
        return current


def revert_release(ctx, release=None):
    """Restore the originals of a release byte for byte (caller holds the host lock).

    release None: the one in force. Idempotent: an already reverted release is reported, not touched.
    Every file is checked before the first is touched, so a refusal changes nothing.
    """
    manifests = releases.manifests(ctx)
    if release is None:
        release = releases.current(ctx)
        pending = [m for m in manifests if m.get("state") == "applying"]
        if pending:
            release = pending[0]["id"]
        if release is None:
            raise AgentError("no release is in force: nothing to revert", "preflight")
    manifest = next((m for m in manifests if m["id"] == release), None)
    if manifest is None:
        raise AgentError("no release %s here (known: %s)" % (release,
                         ", ".join(m["id"] for m in manifests) or "none"), "usage")
    if manifest.get("state") == "reverted":
        return {"release": release, "reverted": False, "already": True, "current": releases.current(ctx), "files": []}
    newer = [m["id"] for m in manifests
             if m.get("seq", 0) > manifest.get("seq", 0) and m.get("state") in ("applied", "applying")]
    if newer:
        raise AgentError("release %s is not the newest in force (%s is); revert that first"
                         % (release, newer[0]), "preflight")
    package_dir = manifest["package_dir"]
    release_dir = os.path.join(releases.root(ctx), release)
    todo = []
    for entry in manifest["files"]:
        target = sgltree.target_path(package_dir, entry["path"])
        now = sgltree.sha_or_none(target)
        if now == entry["sha256_before"]:
            continue  # an interrupted apply never got this far
        if now != entry["sha256_after"]:
            raise AgentError("%s was modified after release %s was applied (sha256 %s); nothing was reverted"
                             % (target, release, now), "preflight")
        if entry["sha256_before"] is not None and not os.path.isfile(
                os.path.join(release_dir, "orig", *entry["path"].split("/"))):
            raise AgentError("release %s has no backup of %s; nothing was reverted" % (release, entry["path"]),
                             "failed")
        todo.append(entry)
    try:
        staged = sgltree.stage_originals(release_dir, todo, package_dir)
    except OSError as err:
        folder = os.path.dirname(err.filename) if err.filename else package_dir
        raise AgentError("cannot write in %s: %s; nothing was reverted" % (folder, err.strerror or err), "preflight")
    releases.journal(ctx, "patch.revert.begin", release=release, files=[e["path"] for e in todo])
    restored = []
    for i, (entry, tmp) in enumerate(staged):
        try:
            sgltree.put_back(entry, tmp, package_dir)
        except OSError as err:
            sgltree.discard_staged(staged[i:])
            raise AgentError("restoring %s failed: %s (restored so far: %s)"
                             % (entry["path"], err.strerror or err, ", ".join(restored) or "none"), "failed")
        restored.append(entry["path"])
        ctx.changed = True
        releases.journal(ctx, "patch.revert.file", release=release, path=entry["path"], sha256=entry["sha256_before"])
    for entry in manifest["files"]:  # candidates an interrupted apply left behind
        target = sgltree.target_path(package_dir, entry["path"])
        prefix = ".%s.dynctl-new." % os.path.basename(target)
        with contextlib.suppress(OSError):
            for name in os.listdir(os.path.dirname(target)):
                if name.startswith(prefix):
                    os.unlink(os.path.join(os.path.dirname(target), name))
    manifest["state"] = "reverted"
    manifest["reverted"] = store.now_iso()
    manifest["reverted_by"] = ctx.who
    try:
        store.write_json_atomic(os.path.join(release_dir, "manifest.json"), manifest)
        current = releases.update_current(ctx)
    except OSError as err:  # the files are back; only the record lags, and reverting again completes it
        raise AgentError("every file of release %s was restored, but its record in %s could not be updated (%s): "
                         "`dynctl rollback` records it once there is room" % (release, release_dir,
                                                                              err.strerror or err),
                         "failed", files_restored=True)
    ctx.changed = True
    releases.journal(ctx, "patch.revert.done", release=release, current=current)
    with contextlib.suppress(OSError):
        releases.prune(ctx)
    return {"release": release, "reverted": True, "already": False, "current": current, "files": restored}


def patch_apply(ctx, files, sglang_version, strategy="patch", threshold=None, launch_argv=None, artifacts=None,
                import_check_timeout=300.0, staged=None):
    with lock.host_lock(ctx, "patch apply"), lock.hangup_shield():
        return apply_release(ctx, files, sglang_version, strategy, threshold, launch_argv, artifacts,
                             float(import_check_timeout), staged=staged)


def patch_revert(ctx, release=None, all=False):
    """Revert the release in force (or `release`); all=True reverts every applied release, newest first."""
    with lock.host_lock(ctx, "patch revert"), lock.hangup_shield():
        releases.require_records(ctx)
        if not all:
            return {"reverted": [revert_release(ctx, release)], "current": releases.current(ctx)}
        done = []
        while True:
            pending = [m for m in releases.manifests(ctx) if m.get("state") in ("applied", "applying")]
            if not pending:
                break
            done.append(revert_release(ctx, pending[0]["id"]))
        return {"reverted": done, "current": releases.current(ctx)}
