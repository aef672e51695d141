# What the checks found, in words for the operator. The boot program compiles these only when it has
# something to say (it gets them as an argument of their own: each call compiles what it runs, and a ping
# should not pay for refusals); the upload program carries them. Uses U, os and stat of checks.py.
import shlex


def name(u):
    try:
        import pwd

        return pwd.getpwuid(u).pw_name
    except (ImportError, KeyError):
        return str(u)


def who(u):
    return "uid %d" % u if name(u) == str(u) else "%s (uid %d)" % (name(u), u)


def fault(p, st, mine):
    if stat.S_ISLNK(st.st_mode):
        return "%s is a symlink (to %s) owned by %s" % (p, os.readlink(p), who(st.st_uid))
    if st.st_uid != U and (mine or st.st_uid):
        return "%s is owned by %s, not by %s (mode %04o)" % (
            p, who(st.st_uid), who(U) if mine or not U else who(U) + " or root", stat.S_IMODE(st.st_mode))
    return "%s is %s-writable (mode %04o, owner %s)" % (
        p, "world" if st.st_mode & 2 else "group", stat.S_IMODE(st.st_mode), who(st.st_uid))


def unexpanded(a):
    """Why workdir `a` did not expand to an absolute path."""
    u = a[1:].split("/")[0]
    if a.startswith("~") and u:
        return "workdir %r: there is no user %r on this host; nothing was changed" % (a, u)
    if a.startswith("~"):
        return "workdir %r: the home directory of %s is unknown here; nothing was changed" % (a, who(U))
    return "workdir %r is relative: use an absolute path, or ~/... for the home directory on the host" % a


def say(w, x):
    """The refusal for what workdir_fault (or copy_fault, with True for "inside") found about workdir w."""
    q = shlex.quote(w)
    if x[0] == "dangling":
        return ("workdir %s: %s is a symlink to %s, which does not exist; create that directory or point the "
                "workdir elsewhere; nothing was changed" % (w, x[1], os.readlink(x[1])))
    if x[0] == "home":
        return ("refusing workdir %s: it is %s itself, where dynctl would keep its lock, journal and agent copies "
                "and clean up after itself; use a directory of its own such as ~/.dynctl; nothing was changed"
                % (w, "the root directory" if x[1] == "/" else "the home directory of " + who(U)))
    if x[2]:
        return ("refusing workdir %s: %s; another user could change what dynctl runs or trusts there. Check what "
                "is in it, then make it yours alone (chown -R %s %s && chmod -R go-w %s; remove %s, dynctl installs "
                "it again), or point the host's workdir at a directory of your own; nothing was changed"
                % (w, fault(*x), shlex.quote(name(U)), q, q, shlex.quote(os.path.join(w, "agent"))))
    how = "make it writable by its owner alone (chmod go-w %s), or " % shlex.quote(x[0]) if x[1].st_uid in (0, U) else ""
    return ("refusing workdir %s: %s, so another user could replace the workdir: %spoint the host's workdir at a "
            "directory under ones that only you or root can write; nothing was changed" % (w, fault(*x), how))
