# The host-side checks the boot and upload programs share, run before any code of the agent copy
# (dynctl/agent/archive.py strips comments and docstrings from these files for the wire).
#
# OpenSSH's StrictModes for the workdir: the workdir, agent/, the copy and each of its files must be the
# effective user's alone (owned by them, neither group- nor world-writable, no symlink), and every directory
# above the workdir theirs or root's and writable by its owner alone; a root-owned sticky directory (/tmp)
# ends that walk, as nobody else may rename what we own in it. The home directory itself and / are no
# workdir: dynctl cleans up after itself there.
#
# The copy's MANIFEST, written last at upload, holds the size and CRC-32 of each of its files, and a copy
# that does not match them is damaged: a checksum against accidents (a torn write, a deleted or edited file,
# a corrupt .pyc), read on every call at a fraction of sha256's cost. Keeping other users out is the
# ownership rule's part, not the checksum's: whoever may write the copy may rewrite its MANIFEST too.
import sys

# the current directory goes first: a json.py there must not be what `import json` runs
sys.path = [p for p in sys.path if p not in ("", ".")]

import json
import os
import stat
from binascii import crc32

U = os.geteuid()


class Refused(Exception):
    """args[0]: (path, stat) of something another user could change."""


def bad(st, mine):
    """Another user could change it: a symlink, not ours (nor root's, above the workdir), or group/world-writable."""
    return stat.S_ISLNK(st.st_mode) or st.st_uid != U and (mine or st.st_uid) or st.st_mode & 0o22


def homes():
    found = [os.path.expanduser("~")]
    try:
        import pwd

        found.append(pwd.getpwuid(U).pw_dir)
    except (ImportError, KeyError):
        pass
    return [os.path.realpath(h) for h in found if h.startswith("/")]


def workdir_fault(w):
    """("dangling", link) | ("home", path) | (path, stat, inside the workdir) | None; a workdir not there yet
    is judged by the directories above it."""
    p = w
    while not os.path.exists(p):
        if os.path.islink(p):
            return "dangling", p
        p = os.path.dirname(p)
    r = os.path.realpath(w)
    if r == "/" or r in homes():
        return "home", r
    q = os.path.abspath(p)
    while q != os.path.dirname(q):  # a symlink on the way is its owner's to point elsewhere: ours or root's only
        if os.path.islink(q):
            st = os.lstat(q)
            if st.st_uid not in (0, U):
                return q, st, False
        q = os.path.dirname(q)
    for q in {os.path.abspath(p), os.path.realpath(p)}:
        mine = p == w
        while True:
            st = os.stat(q)
            if not mine and not st.st_uid and st.st_mode & stat.S_ISVTX:
                break
            if bad(st, mine):
                return q, st, mine
            if q == os.path.dirname(q):
                break
            q, mine = os.path.dirname(q), False
    return None


def own(p):
    """The bytes of regular file p, refused (Refused) where another user could have written them."""
    f = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(f)
        if bad(st, True):
            raise Refused((p, st))
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "not a regular file", p)
        return os.read(f, st.st_size + 1)
    finally:
        os.close(f)


def copy_fault(r):
    """("refuse", (path, stat)) | ("damaged", what) | None for the agent copy r."""
    try:
        for p in (os.path.dirname(r), r):
            st = os.lstat(p)
            if bad(st, True):
                raise Refused((p, st))
        listed = json.loads(own(os.path.join(r, "MANIFEST")))
        for d in listed["dirs"]:
            p = os.path.join(r, d)
            st = os.lstat(p)
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(0, "not a directory", p)
            if bad(st, True):
                raise Refused((p, st))
        for n, v in listed["files"].items():
            b = own(os.path.join(r, n))
            if [len(b), crc32(b)] != v:
                return "damaged", "%s differs from what was installed" % n
    except Refused as e:
        return "refuse", e.args[0]
    except OSError as e:
        return "damaged", "%s: %s" % (e.filename or r, e.strerror or e)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return "damaged", "MANIFEST: %r" % e
    return None
