# Installs the archive from stdin (no SFTP: works through pct too): checked against its hash, unpacked
# beside its place, compiled with the host's own interpreter (checked-hash bytecode: a .pyc is used only
# while it matches its source), its MANIFEST written last, then renamed into workdir/agent/<hash> in one
# step, so a concurrent upload or a dropped connection never leaves half an agent where the boot program
# looks. A copy already there is kept while it is intact, else (and always with "repair") replaced. Copies
# beyond the newest few (and an hour old) are pruned: by the exact names dynctl gives them, nothing else.
#
# Sent as checks.py + words.py + this file; argv: workdir, hash[, "repair"]. Exit 3: refused, nothing written.
import compileall
import hashlib
import io
import py_compile
import re
import shutil
import time
import zipfile

a = sys.argv[1]
w = os.path.expanduser(a)
h = sys.argv[2]
repair = sys.argv[3:] == ["repair"]
g = os.path.join(w, "agent")
d = os.path.join(g, h)
t = os.path.join(g, ".tmp-%s-%d" % (h, os.getpid()))  # the unpacking, renamed into place when whole
o = os.path.join(g, ".old-%s-%d" % (h, os.getpid()))  # a damaged copy, moved aside for the new one


def fail(m):
    sys.stderr.write(m + "\n")
    sys.exit(3)


if sys.version_info < (3, 9):
    fail("the dynctl agent needs Python 3.9 or later; %s is %d.%d"
         % (sys.executable, sys.version_info[0], sys.version_info[1]))
data = sys.stdin.buffer.read()
if hashlib.sha256(data).hexdigest()[:16] != h:
    fail("the dynctl agent arrived damaged (%d bytes); nothing was written" % len(data))
if not os.path.isabs(w):
    fail(unexpanded(a))
x = workdir_fault(w)
if x:
    fail(say(w, x))
os.umask(0o077)
try:
    os.makedirs(g, exist_ok=True)
    st = os.lstat(g)
    if bad(st, True):
        fail(say(w, (g, st, True)))
    s = copy_fault(d) if os.path.isdir(d) else ("missing", "")
    if s and s[0] == "refuse":
        fail(say(w, s[1] + (True,)))
    if s or repair:
        zipfile.ZipFile(io.BytesIO(data)).extractall(t)
        if not compileall.compile_dir(t, quiet=2, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH):
            raise OSError(0, "%s cannot compile it" % sys.executable)
        listed = {"dirs": [], "files": {}}
        for top, dirs, names in os.walk(t):
            listed["dirs"] += [os.path.relpath(os.path.join(top, n), t) for n in dirs]
            for n in names:
                with open(os.path.join(top, n), "rb") as f:
                    b = f.read()
                listed["files"][os.path.relpath(os.path.join(top, n), t)] = [len(b), crc32(b)]
        with open(os.path.join(t, "MANIFEST"), "w") as f:
            json.dump(listed, f, sort_keys=True)
        if os.path.isdir(d) and (repair or copy_fault(d)):  # still damaged: another upload may have repaired it
            os.rename(d, o)
        try:
            os.rename(t, d)
        except OSError:
            if not os.path.isdir(d):
                raise
except OSError as e:
    shutil.rmtree(t, ignore_errors=True)
    try:
        os.rmdir(g)
    except OSError:
        pass
    fail("cannot write the dynctl agent into %s: %s" % (w, e.strerror or e))
for p in (t, o):
    shutil.rmtree(p, ignore_errors=True)


def gone(pid):
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):
        pass
    return False


def mtime(n):
    try:
        return os.lstat(os.path.join(g, n)).st_mtime
    except OSError:
        return time.time()


old = sorted((mtime(n), n) for n in os.listdir(g) if re.match(r"[0-9a-f]{16}\Z", n))[::-1][3:]
for m, n in old:
    if n != h and time.time() - m > 3600:
        shutil.rmtree(os.path.join(g, n), ignore_errors=True)
for n in os.listdir(g):
    x = re.match(r"\.(?:tmp|old)-[0-9a-f]{16}-(\d+)\Z", n)
    if x and gone(x.group(1)):
        shutil.rmtree(os.path.join(g, n), ignore_errors=True)
