# Runs the agent unpacked under its hash if that version is present, else says so with exit MISSING: one
# round trip per call in the common case, and no knowledge of the remote $HOME needed on the client. A
# workdir or copy another user could change is refused with a pre-flight answer; a damaged copy exits
# DAMAGED (the client installs it again). The modules were byte-compiled at upload (compiling costs more
# than starting the interpreter, and the host may set PYTHONDONTWRITEBYTECODE), are read from the copy's own
# __pycache__ and never rewritten there, and each verb imports only its own.
#
# Sent as checks.py + this file, after PROTOCOL, MISSING and DAMAGED from the client;
# argv: workdir, hash, words.py.
a = sys.argv[1]
w = os.path.expanduser(a)
r = os.path.join(w, "agent", sys.argv[2])


def refuse(x):
    exec(sys.argv[3], globals())
    error = unexpanded(a) if x is None else say(w, x)
    sys.stdout.write(json.dumps({"protocol": PROTOCOL, "ok": False, "kind": "preflight", "error": error,
                                 "changed": False, "done": True}) + "\n")
    sys.exit(3)


if not os.path.isabs(w):
    refuse(None)
if not os.path.isdir(r):
    sys.exit(MISSING)
x = workdir_fault(w)
if x:
    refuse(x)
s = copy_fault(r)
if s and s[0] == "refuse":
    refuse(s[1] + (True,))
if s:
    sys.stderr.write("the dynctl agent in %s is damaged: %s\n" % (r, s[1]))
    sys.exit(DAMAGED)
sys.path.insert(0, r)
sys.argv = [r]
sys.pycache_prefix = None
sys.dont_write_bytecode = True
try:
    from dynctl_agent.verbs import main
except Exception as e:
    sys.stderr.write("the dynctl agent in %s does not load: %s: %s\n" % (r, type(e).__name__, e))
    sys.exit(DAMAGED)
sys.exit(main())
