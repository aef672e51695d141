"""Files inside the installed sglang package: targets, candidates checked with the server's interpreter,
originals staged back, stale bytecode dropped."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess

from dynctl.base import sglang
from dynctl_agent import hostinfo, store
from dynctl_agent.protocol import AgentError

def target_path(package_dir, rel):
    """Absolute path of `rel` inside the sglang package; refuses paths that leave it."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/"):
        raise AgentError("bad file path %r: expected a path relative to the sglang package" % (rel,), "usage")
    return os.path.join(package_dir, *rel.split("/"))


def symlink_on_path(package_dir, rel):
    """The first symlink among the target and its directories below the package dir, else None."""
    path = package_dir
    for part in rel.split("/"):
        path = os.path.join(path, part)
        if os.path.islink(path):
            return path
    return None


def sha_or_none(path):
    return store.sha256_file(path) if os.path.isfile(path) else None


def record_hashes(package_dir, files):
    """sha256 (hex) of `files` as listed in the installed wheel's RECORD, when there is one."""
    import base64
    import csv

    parent = os.path.dirname(package_dir)
    want = {"sglang/" + rel: rel for rel in files}
    out = {}
    for name in os.listdir(parent):
        if not (name.startswith("sglang-") and name.endswith(".dist-info")):
            continue
        try:
            with open(os.path.join(parent, name, "RECORD"), newline="") as f:
                for row in csv.reader(f):
                    if len(row) >= 2 and row[0] in want and row[1].startswith("sha256="):
                        digest = base64.urlsafe_b64decode(row[1][7:] + "=" * (-len(row[1][7:]) % 4))
                        out[want[row[0]]] = digest.hex()
        except (OSError, ValueError):
            continue
    return out


def installed(ctx):
    found = hostinfo.find_sglang(ctx)
    if not found.get("sglang"):
        raise AgentError("sglang is not importable by %s" % (found.get("python") or ctx.python), "preflight")
    return found


def drop_pycache(target):
    """Remove the compiled copies of `target`, so no stale bytecode outlives a swap."""
    cache = os.path.join(os.path.dirname(target), "__pycache__")
    stem = os.path.splitext(os.path.basename(target))[0] + "."
    dropped = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(cache):
            if name.startswith(stem) and name.endswith(".pyc") and name.count(".") >= 2:
                os.unlink(os.path.join(cache, name))
                dropped.append(name)
    return dropped


def import_check(ctx, swapped, timeout):
    """Run `python -m sglang.launch_server --help` and require the flag.

    Returns {"ran": bool, "ok": bool, "detail": str}; ran=False when sglang's dependencies are not
    importable here (a host without torch, say), which says nothing about the patch.
    """
    return _judged([ctx.python, "-m", sglang.LAUNCH_MODULE, "--help"], ctx, swapped, timeout)


def import_check_candidates(ctx, package_dir, pairs, timeout):
    """import_check as it would go once the candidates are swapped in, with the tree untouched (the
    import_candidates program): pairs are [candidate, target] inside `package_dir`."""
    root = os.path.dirname(package_dir)
    modules = {}
    for candidate, target in pairs:
        name = os.path.relpath(target, root)[:-len(".py")].replace(os.sep, ".")
        modules[name[:-len(".__init__")] if name.endswith(".__init__") else name] = [candidate, target]
    argv = [ctx.python, "-c", hostinfo.program("import_candidates"), json.dumps(modules)]
    return _judged(argv, ctx, {os.path.realpath(t) for _, t in pairs}, timeout)


def _judged(argv, ctx, swapped, timeout):
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=hostinfo.server_env(ctx),
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"ran": False, "ok": False, "detail": "import check could not run: %s" % err}
    if proc.returncode == 0:
        if sglang.THRESHOLD_FLAG in proc.stdout:
            return {"ran": True, "ok": True, "detail": "launch_server --help lists %s" % sglang.THRESHOLD_FLAG}
        return {"ran": True, "ok": False, "detail": "launch_server --help does not list %s" % sglang.THRESHOLD_FLAG}
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else "exit code %d" % proc.returncode
    frames = re.findall(r'^\s*File "([^"]+)", line (\d+)', proc.stderr, re.M)
    # Ours only when it breaks in a file we swapped; a dependency the host lacks (torch, numpy,
    # ...) stops the import before any of our code runs and says nothing about the patch.
    ours = bool(frames) and os.path.realpath(frames[-1][0]) in swapped
    if ours and last.startswith(("ModuleNotFoundError", "ImportError")):
        ours = "'sglang" in last or '"sglang' in last
    if ours:
        return {"ran": True, "ok": False, "detail": "%s line %s: %s" % (frames[-1][0], frames[-1][1], last)}
    return {"ran": False, "ok": False, "detail": "import check could not run: %s" % last}


def stage_original(release_dir, entry, package_dir):
    """Write the original of one file beside its target (mode and owner as recorded); return that temp path,
    or None for a file the release created. A write that fails leaves nothing behind."""
    if entry["sha256_before"] is None:
        return None
    target = target_path(package_dir, entry["path"])
    backup = os.path.join(release_dir, "orig", *entry["path"].split("/"))
    with open(backup, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != entry["sha256_before"]:
        raise AgentError("backup %s does not match its recorded sha256; %s left as is" % (backup, target), "failed")
    tmp = os.path.join(os.path.dirname(target), ".%s.dynctl-restore.%d" % (os.path.basename(target), os.getpid()))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of a killed restore with our pid
    store.write_bytes(tmp, data, entry.get("mode") or 0o644)
    try:
        os.chmod(tmp, entry.get("mode") or 0o644)  # not narrowed by the umask
        if entry.get("uid") is not None and os.geteuid() == 0:
            os.chown(tmp, entry["uid"], entry["gid"])
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def stage_originals(release_dir, entries, package_dir):
    """Every original written beside its target before the first is put back, so a full disk or a read-only
    folder stops the restore with nothing restored, never half way. Returns [(entry, temp path or None)]."""
    staged = []
    try:
        for entry in entries:
            staged.append((entry, stage_original(release_dir, entry, package_dir)))
    except BaseException:
        discard_staged(staged)
        raise
    return staged


def discard_staged(staged):
    for _, tmp in staged:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def put_back(entry, tmp, package_dir):
    """Rename a staged original over its target (or remove a file the release created); check its sha256."""
    target = target_path(package_dir, entry["path"])
    if tmp is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
    else:
        os.replace(tmp, target)
        if store.sha256_file(target) != entry["sha256_before"]:
            raise AgentError("%s does not match its original sha256 after restore" % target, "failed")
    drop_pycache(target)
