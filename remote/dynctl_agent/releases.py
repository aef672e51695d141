"""Releases on the host: their records in workdir, which one is in force, and how many are kept.

Files of the speculation patch are changed as one transaction on the host, and every change is a
release that can be reverted byte for byte.

  workdir/current                          id of the release in force (absent: none)
  workdir/releases/<id>/manifest.json      {id, seq, created, who, sglang_version, strategy, threshold,
                                            launch_argv, package_dir, files: [{path, sha256_before,
                                            sha256_after}], artifacts, import_check, state}
  workdir/releases/<id>/orig/<relpath>     original bytes of each file the release changed (none for
                                            files it created: sha256_before is null)
  workdir/releases/<id>/<artifact>         files the client asked to keep with the release (the native
                                            strategy's adaptive config JSON); "{release_dir}" in
                                            launch_argv is replaced by this directory

<id> is "<seq:04d>-<UTC time>"; seq grows by one per release. state is "applying" (backups complete,
swap under way, or interrupted), "applied", or "reverted". A release may change no file at all (native
strategy, or a new threshold on an already patched tree): it still records threshold and launch_argv.
`current` is the newest release whose state is "applied". Releases stack: only the one in force can be
reverted, so rollback = patch.revert_release(current) + restart with the launch_argv of the new `current`.

patch.apply_release() and patch.revert_release() take no lock themselves: the patch_* verbs wrap them in host_lock,
and an operation worker that already holds the lock calls them directly.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import shutil

from dynctl.base import hostspec, sglang
from dynctl_agent import store
from dynctl_agent.protocol import AgentError

BASELINE = "baseline"  # no release: the sglang tree as installed
ID = re.compile(r"^(\d{4,})-\d{8}T\d{6}Z$")
ARTIFACT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def interrupted_message(release):
    return ("release %s was interrupted mid-switch: `dynctl rollback` reverts it and restarts what ran before it "
            "(`dynctl patch revert --release %s` reverts the files alone); nothing was changed" % (release, release))


def journal(ctx, event, **fields):
    """Journal a step; a full disk must not stop a transaction half way (the manifest is the record)."""
    with contextlib.suppress(OSError, AgentError):
        store.journal(ctx, event, **fields)


def root(ctx):
    return ctx.path("releases")


def manifests(ctx):
    """All release manifests, newest first."""
    folder = root(ctx)
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if ID.match(name):
            manifest = store.read_json(os.path.join(folder, name, "manifest.json"))
            if manifest:
                found.append(manifest)
    return sorted(found, key=lambda m: m.get("seq", 0), reverse=True)


def _manifest_problem(folder, name):
    """Why releases/<name>/manifest.json cannot serve as that release's record (None: it can; "missing": absent)."""
    path = os.path.join(folder, name, "manifest.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as err:
        return "unreadable (%s)" % (getattr(err, "strerror", None) or err)
    if not isinstance(data, dict) or data.get("id") != name or not isinstance(data.get("files"), list):
        return "not a release record of %s" % name
    return None


def require_records(ctx):
    """Refuse (pre-flight) when a release's record is missing or unreadable: the release may have changed files,
    so going on would skip its revert or stack a new release on it.

    A directory without manifest.json that is newer than every release and not named by `current` is what
    an apply killed before its manifest leaves (the manifest is written before the first swap): no file was
    swapped, and prune() removes it.
    """
    folder = root(ctx)
    try:
        names = sorted(n for n in os.listdir(folder) if ID.match(n)) if os.path.isdir(folder) else []
    except OSError as err:
        raise AgentError("cannot list the releases in %s: %s; nothing was changed" % (folder, err.strerror or err),
                         "preflight")
    problems = {n: _manifest_problem(folder, n) for n in names}
    readable = [int(ID.match(n).group(1)) for n, p in problems.items() if p is None]
    named = current(ctx)
    if named is not None and named not in problems:
        problems[named] = "missing (no directory %s)" % os.path.join(folder, named)
    for name, problem in sorted(problems.items()):
        if problem is None:
            continue
        if problem == "missing" and name != named and int(ID.match(name).group(1)) > max(readable, default=0):
            continue
        why = "named by %s as the release in force" % ctx.path("current") if name == named else "a release"
        raise AgentError(
            "the record of release %s (%s) is %s: %s; it may have changed files in the sglang tree, so nothing "
            "can be reverted or deployed on top of it. Recover by hand: the original files it replaced are in "
            "%s (paths relative to the sglang package); put them back (or reinstall sglang), then move %s out "
            "of %s%s; nothing was changed"
            % (name, why, problem, os.path.join(folder, name, "manifest.json"), os.path.join(folder, name, "orig"),
               os.path.join(folder, name), folder,
               " and remove %s" % ctx.path("current") if name == named else ""),
            "preflight", release=name)


def prune(ctx):
    """Keep the newest ctx.keep releases. Older ones go only when reverted: a release in force (rollback needs
    its backups), an interrupted one, and the one the server was started from (its argv may name a file in it)
    always stay. Directories a killed apply left without a manifest never held a swap and go too."""
    folder = root(ctx)
    known = manifests(ctx)  # newest first
    protected = {current(ctx), (store.read_pidfile(ctx) or {}).get("release")}
    doomed = [m["id"] for m in known[ctx.keep:] if m.get("state") == "reverted" and m["id"] not in protected]
    with contextlib.suppress(OSError):
        listed = {m["id"] for m in known}
        doomed += [n for n in os.listdir(folder) if ID.match(n) and n not in listed
                   and not os.path.exists(os.path.join(folder, n, "manifest.json"))]
    for release in doomed:
        shutil.rmtree(os.path.join(folder, release), ignore_errors=True)
    if doomed:
        journal(ctx, "releases.pruned", releases=doomed, keep=ctx.keep)
    return doomed


def next_id(ctx):
    seqs = [int(m.group(1)) for m in (ID.match(n) for n in os.listdir(root(ctx))) if m]
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    seq = max(seqs, default=0) + 1
    return seq, "%04d-%s" % (seq, stamp)


def update_current(ctx):
    """Point `current` at the newest applied release (or remove it); return that id."""
    applied = [m for m in manifests(ctx) if m.get("state") == "applied"]
    path = ctx.path("current")
    if applied:
        tmp = "%s.tmp.%d" % (path, os.getpid())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a leftover of a killed writer with our pid
        store.write_bytes(tmp, (applied[0]["id"] + "\n").encode(), 0o600)
        os.replace(tmp, path)
        return applied[0]["id"]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return None


def current(ctx):
    """The id workdir/current names (the release in force), or None."""
    try:
        with open(ctx.path("current")) as f:
            release_id = f.read().strip()
    except OSError:
        return None
    return release_id if ID.match(release_id) else None


def in_force(ctx):
    """The manifest of the release in force (its "id" always set), or None."""
    release_id = current(ctx)
    if release_id is None:
        return None
    manifest = store.read_json(os.path.join(root(ctx), release_id, "manifest.json")) or {}
    manifest["id"] = release_id
    return manifest


def list_releases(ctx):
    """Release manifests, newest first, and the id in force."""
    return {"current": current(ctx), "releases": manifests(ctx)}


def launch_in_force(ctx):
    """{"release": id, "argv": its recorded launch argv or None} of the release in force, or None."""
    manifest = in_force(ctx)
    return None if manifest is None else {"release": manifest["id"], "argv": manifest.get("launch_argv")}


# -- the adopted baseline: the launch of an operator's server that dynctl took over

ADOPTED = "adopted.json"  # {pid, pid_start, argv, env, cwd, adopted, who}; 0600, env values are never shown


def adopted(ctx):
    """The adopted launch (the baseline a rollback to "baseline" restarts), or None."""
    rec = store.read_json(ctx.path(ADOPTED)) if os.path.isdir(ctx.workdir) else None
    if not rec or not isinstance(rec.get("argv"), list) or not rec["argv"]:
        return None
    return rec


def adopted_summary(ctx):
    """The adopted baseline without its environment's values: what status may show."""
    rec = adopted(ctx)
    if rec is None:
        return None
    return {"pid": rec.get("pid"), "argv": rec["argv"], "cwd": rec.get("cwd"), "env_keys": sorted(rec.get("env") or {}),
            "log": rec.get("log"), "python": rec.get("python"), "adopted": rec.get("adopted"), "who": rec.get("who")}


def record_adopted(ctx, launch):
    """Make `launch` (an adoption record) the baseline release: written 0600, journalled without env values."""
    ctx.ensure_workdir()
    store.write_json_atomic(ctx.path(ADOPTED), launch)
    ctx.changed = True
    journal(ctx, "adopt", pid=launch["pid"], argv=launch["argv"], cwd=launch.get("cwd"),
            env_keys=sorted(launch.get("env") or {}))


def adopted_launch_for(ctx, argv):
    """The adopted server's environment and cwd for `argv` when argv is that launch plus dynctl's own flags (a
    release deployed on top of it), so it starts exactly as the operator ran it; else None."""
    rec = adopted(ctx)
    if rec is None or not sglang.same_launch(argv, rec["argv"]):
        return None
    return adopted_launch(rec)


def baseline_launch(ctx, baseline_argv):
    """(argv, launch) of the baseline: the adopted server's argv with its environment and cwd, else the
    configured argv (launch None: the configured environment, the home directory); hostspec.plain_start's
    rule without a release in force."""
    argv, _, chosen = hostspec.plain_start(None, adopted(ctx), baseline_argv)
    return argv, adopted_launch(chosen)


def adopted_launch(rec):
    """The environment, cwd and pid an adopted server's launch runs with (startup.start_server), or None."""
    if rec is None:
        return None
    return {"env": dict(rec.get("env") or {}), "cwd": rec.get("cwd"), "adopted": rec.get("pid")}
