"""Client side of the host agent: upload once under its hash, call verbs with JSON, map answers to errors."""

from __future__ import annotations

import getpass
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

from dynctl import resources
from dynctl.config import HostConfig, workdir_problem
from dynctl.errors import (
    ConfigError,
    DynctlError,
    HostKeyError,
    OperationFailed,
    PreflightError,
    UnreachableError,
    UsageError,
)
from dynctl.transport.base import Transport

PROTOCOL = 1
_MISSING_RC = 97  # the boot program found no copy of this agent: upload it
_DAMAGED_RC = 96  # the copy is there but damaged (a file changed or gone, a module that does not load): repair it

# OpenSSH's StrictModes for the workdir, run by _BOOT and _UPLOAD before any code of the agent copy: the
# workdir, agent/, the copy and each of its files must be the effective user's alone (owned by them, neither
# group- nor world-writable, no symlink), and every directory above the workdir theirs or root's and writable
# by its owner alone; a root-owned sticky directory (/tmp) ends that walk, as nobody else may rename what we
# own in it. The home directory itself and / are no workdir: dynctl cleans up after itself there.
# The copy's MANIFEST, written last at upload, holds the size and CRC-32 of each of its files, and a copy that
# does not match them is damaged: a checksum against accidents (a torn write, a deleted or edited file, a
# corrupt .pyc), read on every call at a fraction of sha256's cost. Keeping other users out is the ownership
# rule's part, not the checksum's: whoever may write the copy may rewrite its MANIFEST too.
# sys.path loses the current directory first: a json.py there must not be what `import json` runs.
# workdir_fault -> ("dangling", link) | ("home", path) | (path, stat, inside the workdir) | None
# copy_fault -> ("refuse", (path, stat)) | ("damaged", what) | None
_CHECKS = (
    "import sys\n"
    "sys.path=[p for p in sys.path if p not in('','.')]\n"
    "import json,os,stat\n"
    "from binascii import crc32\n"
    "U=os.geteuid()\n"
    "class Refused(Exception): pass\n"
    "def bad(st,mine): return stat.S_ISLNK(st.st_mode) or st.st_uid!=U and (mine or st.st_uid) or st.st_mode&0o22\n"
    "def homes():\n"
    " h=[os.path.expanduser('~')]\n"
    " try:\n"
    "  import pwd;h.append(pwd.getpwuid(U).pw_dir)\n"
    " except (ImportError,KeyError): pass\n"
    " return [os.path.realpath(x) for x in h if x.startswith('/')]\n"
    "def workdir_fault(w):\n"
    " p=w\n"
    " while not os.path.exists(p):\n"
    "  if os.path.islink(p): return 'dangling',p\n"
    "  p=os.path.dirname(p)\n"
    " r=os.path.realpath(w)\n"
    " if r=='/' or r in homes(): return 'home',r\n"
    " for q in {os.path.abspath(p),os.path.realpath(p)}:\n"
    "  mine=p==w\n"
    "  while True:\n"
    "   st=os.stat(q)\n"
    "   if not mine and not st.st_uid and st.st_mode&stat.S_ISVTX: break\n"
    "   if bad(st,mine): return q,st,mine\n"
    "   if q==os.path.dirname(q): break\n"
    "   q,mine=os.path.dirname(q),False\n"
    "def own(p):\n"
    " f=os.open(p,os.O_RDONLY|os.O_NOFOLLOW)\n"
    " try:\n"
    "  st=os.fstat(f)\n"
    "  if bad(st,True): raise Refused((p,st))\n"
    "  if not stat.S_ISREG(st.st_mode): raise OSError(0,'not a regular file',p)\n"
    "  return os.read(f,st.st_size+1)\n"
    " finally: os.close(f)\n"
    "def copy_fault(r):\n"
    " try:\n"
    "  for p in (os.path.dirname(r),r):\n"
    "   st=os.lstat(p)\n"
    "   if bad(st,True): raise Refused((p,st))\n"
    "  c=json.loads(own(os.path.join(r,'MANIFEST')))\n"
    "  for d in c['dirs']:\n"
    "   p=os.path.join(r,d);st=os.lstat(p)\n"
    "   if not stat.S_ISDIR(st.st_mode): raise OSError(0,'not a directory',p)\n"
    "   if bad(st,True): raise Refused((p,st))\n"
    "  for n,v in c['files'].items():\n"
    "   b=own(os.path.join(r,n))\n"
    "   if [len(b),crc32(b)]!=v: return 'damaged','%s differs from what was installed'%n\n"
    " except Refused as e: return 'refuse',e.args[0]\n"
    " except OSError as e: return 'damaged','%s: %s'%(e.filename or r,e.strerror or e)\n"
    " except (ValueError,KeyError,TypeError,AttributeError) as e: return 'damaged','MANIFEST: %r'%e\n"
)

# The words for what _CHECKS found, compiled only when there is something to say (the boot program gets them
# as an argument of their own: each call compiles what it runs, and a ping should not pay for refusals).
_SAY = (
    "import shlex\n"
    "def name(u):\n"
    " try:\n"
    "  import pwd;return pwd.getpwuid(u).pw_name\n"
    " except (ImportError,KeyError): return str(u)\n"
    "def who(u): return 'uid %d'%u if name(u)==str(u) else '%s (uid %d)'%(name(u),u)\n"
    "def fault(p,st,mine):\n"
    " if stat.S_ISLNK(st.st_mode): return '%s is a symlink (to %s)'%(p,os.readlink(p))\n"
    " if st.st_uid!=U and (mine or st.st_uid): return '%s is owned by %s, not by %s (mode %04o)'%(\n"
    "  p,who(st.st_uid),who(U) if mine or not U else who(U)+' or root',stat.S_IMODE(st.st_mode))\n"
    " return '%s is %s-writable (mode %04o, owner %s)'%(\n"
    "  p,'world' if st.st_mode&2 else 'group',stat.S_IMODE(st.st_mode),who(st.st_uid))\n"
    "def unexpanded(a):\n"
    " u=a[1:].split('/')[0]\n"
    " if a.startswith('~') and u: return 'workdir %r: there is no user %r on this host; nothing was changed'%(a,u)\n"
    " if a.startswith('~'): return 'workdir %r: the home directory of %s is unknown here; nothing was changed'%(a,who(U))\n"
    " return 'workdir %r is relative: use an absolute path, or ~/... for the home directory on the host'%a\n"
    "def say(w,x):\n"
    " q=shlex.quote(w)\n"
    " if x[0]=='dangling': return ('workdir %s: %s is a symlink to %s, which does not exist; create that directory '\n"
    "  'or point the workdir elsewhere; nothing was changed'%(w,x[1],os.readlink(x[1])))\n"
    " if x[0]=='home': return ('refusing workdir %s: it is %s itself, where dynctl would keep its lock, journal and '\n"
    "  'agent copies and clean up after itself; use a directory of its own such as ~/.dynctl; nothing was changed'\n"
    "  %(w,'the root directory' if x[1]=='/' else 'the home directory of '+who(U)))\n"
    " if x[2]: return ('refusing workdir %s: %s; another user could change what dynctl runs or trusts there. Check '\n"
    "  'what is in it, then make it yours alone (chown -R %s %s && chmod -R go-w %s; remove %s, dynctl installs it '\n"
    "  'again), or point the host\\'s workdir at a directory of your own; nothing was changed'\n"
    "  %(w,fault(*x),shlex.quote(name(U)),q,q,shlex.quote(os.path.join(w,'agent'))))\n"
    " how='make it writable by its owner alone (chmod go-w %s), or'%shlex.quote(x[0]) if x[1].st_uid in (0,U) else ''\n"
    " return ('refusing workdir %s: %s, so another user could replace the workdir: %s point the host\\'s workdir '\n"
    "  'at a directory under ones that only you or root can write; nothing was changed'%(w,fault(*x),how))\n"
)

# Runs the agent unpacked under its hash if that version is present, else says so with exit 97: one round
# trip per call in the common case, and no knowledge of the remote $HOME needed on this side. A workdir or
# copy another user could change is refused with a pre-flight answer; a damaged copy exits 96 (the client
# installs it again). Its modules were byte-compiled at upload (compiling costs more than starting the
# interpreter, and the host may set PYTHONDONTWRITEBYTECODE), are read from the copy's own __pycache__ and
# never rewritten there, and each verb imports only its own. argv: workdir, hash, _SAY.
_BOOT = _CHECKS + (
    "a=sys.argv[1];w=os.path.expanduser(a);r=os.path.join(w,'agent',sys.argv[2])\n"
    "def refuse(x):\n"
    " exec(sys.argv[3],globals())\n"
    " sys.stdout.write(json.dumps({'protocol':%d,'ok':False,'kind':'preflight','error':unexpanded(a) if x is None "
    "else say(w,x),'changed':False,'done':True})+'\\n');sys.exit(3)\n"
    "if not os.path.isabs(w): refuse(None)\n"
    "if not os.path.isdir(r): sys.exit(%d)\n"
    "x=workdir_fault(w)\n"
    "if x: refuse(x)\n"
    "s=copy_fault(r)\n"
    "if s and s[0]=='refuse': refuse(s[1]+(True,))\n"
    "if s: sys.stderr.write('the dynctl agent in %%s is damaged: %%s\\n'%%(r,s[1]));sys.exit(%d)\n"
    "sys.path.insert(0,r);sys.argv=[r];sys.pycache_prefix=None;sys.dont_write_bytecode=True\n"
    "try: from dynctl_agent.verbs import main\n"
    "except Exception as e:\n"
    " sys.stderr.write('the dynctl agent in %%s does not load: %%s: %%s\\n'%%(r,type(e).__name__,e));sys.exit(%d)\n"
    "sys.exit(main())\n"
) % (PROTOCOL, _MISSING_RC, _DAMAGED_RC, _DAMAGED_RC)

# Installs the archive from stdin (no SFTP: works through pct too): checked against its hash, unpacked
# beside its place, compiled with the host's own interpreter (checked-hash bytecode: a .pyc is used only
# while it matches its source), its MANIFEST written last, then renamed into workdir/agent/<hash> in one
# step, so a concurrent upload or a dropped connection never leaves half an agent where _BOOT looks. A copy
# already there is kept while it is intact, else (and always with "repair") replaced. Copies beyond the
# newest few (and an hour old) are pruned, as are the one-file agents of older dynctls: by the exact names
# dynctl gives them, nothing else.
_UPLOAD = _CHECKS + _SAY + (
    "import compileall,hashlib,io,py_compile,re,shutil,time,zipfile\n"
    "a=sys.argv[1];w=os.path.expanduser(a);h=sys.argv[2];g=os.path.join(w,'agent');d=os.path.join(g,h)\n"
    "t=os.path.join(g,'.tmp-%s-%d'%(h,os.getpid()));o=os.path.join(g,'.old-%s-%d'%(h,os.getpid()))\n"
    "def fail(m): sys.stderr.write(m+'\\n');sys.exit(3)\n"
    "if sys.version_info<(3,9):\n"
    " fail('the dynctl agent needs Python 3.9 or later; %s is %d.%d'%(sys.executable,"
    "sys.version_info[0],sys.version_info[1]))\n"
    "data=sys.stdin.buffer.read()\n"
    "if hashlib.sha256(data).hexdigest()[:16]!=h: fail('the dynctl agent arrived damaged (%d bytes); nothing was written'%len(data))\n"
    "if not os.path.isabs(w): fail(unexpanded(a))\n"
    "x=workdir_fault(w)\n"
    "if x: fail(say(w,x))\n"
    "os.umask(0o077)\n"
    "try:\n"
    " os.makedirs(g,exist_ok=True)\n"
    " st=os.lstat(g)\n"
    " if bad(st,True): fail(say(w,(g,st,True)))\n"
    " s=copy_fault(d) if os.path.isdir(d) else ('missing','')\n"
    " if s and s[0]=='refuse': fail(say(w,s[1]+(True,)))\n"
    " if s or sys.argv[3:]==['repair']:\n"
    "  zipfile.ZipFile(io.BytesIO(data)).extractall(t)\n"
    "  if not compileall.compile_dir(t,quiet=2,invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH):\n"
    "   raise OSError(0,'%s cannot compile it'%sys.executable)\n"
    "  c={'dirs':[],'files':{}}\n"
    "  for top,dirs,names in os.walk(t):\n"
    "   c['dirs']+=[os.path.relpath(os.path.join(top,n),t) for n in dirs]\n"
    "   for n in names:\n"
    "    with open(os.path.join(top,n),'rb') as f: b=f.read()\n"
    "    c['files'][os.path.relpath(os.path.join(top,n),t)]=[len(b),crc32(b)]\n"
    "  with open(os.path.join(t,'MANIFEST'),'w') as f: json.dump(c,f,sort_keys=True)\n"
    "  if os.path.isdir(d) and (sys.argv[3:]==['repair'] or copy_fault(d)): os.rename(d,o)\n"
    "  try: os.rename(t,d)\n"
    "  except OSError:\n"
    "   if not os.path.isdir(d): raise\n"
    "except OSError as e:\n"
    " shutil.rmtree(t,ignore_errors=True)\n"
    " try: os.rmdir(g)\n"
    " except OSError: pass\n"
    " fail('cannot write the dynctl agent into %s: %s'%(w,e.strerror or e))\n"
    "for p in (t,o): shutil.rmtree(p,ignore_errors=True)\n"
    "def gone(n):\n"
    " try: os.kill(int(n),0)\n"
    " except ProcessLookupError: return True\n"
    " except (OSError,ValueError): pass\n"
    " return False\n"
    "def mtime(n):\n"
    " try: return os.lstat(os.path.join(g,n)).st_mtime\n"
    " except OSError: return time.time()\n"
    "old=sorted((mtime(n),n) for n in os.listdir(g) if re.match(r'[0-9a-f]{16}\\Z',n))[::-1][3:]\n"
    "for m,n in old:\n"
    " if n!=h and time.time()-m>3600: shutil.rmtree(os.path.join(g,n),ignore_errors=True)\n"
    "for n in os.listdir(g):\n"
    " x=re.match(r'\\.(?:tmp|old)-[0-9a-f]{16}-(\\d+)\\Z',n)\n"
    " if x and gone(x.group(1)): shutil.rmtree(os.path.join(g,n),ignore_errors=True)\n"
    "for n in os.listdir(w):\n"
    " p=os.path.join(w,n)\n"
    " if re.match(r'agent-[0-9a-f]{16}\\.py(?:c|\\.tmp\\.\\d+)?\\Z',n):\n"
    "  try:\n"
    "   st=os.lstat(p)\n"
    "   if stat.S_ISREG(st.st_mode) and st.st_uid==U: os.unlink(p)\n"
    "  except OSError: pass\n"
)


class AgentError(DynctlError):
    """A refusal or failure reported by the agent; `kind` says which."""

    def __init__(self, message: str, kind: str, answer: dict[str, Any]) -> None:
        super().__init__(message)
        self.kind = kind
        self.answer = answer
        # "down": the server an operation needs is not running; nothing was changed, so exit 3 too.
        self.exit_code = {"preflight": 3, "busy": 3, "down": 3, "usage": 2, "protocol": 2}.get(kind, 1)


class AgentClient:
    def __init__(self, transport: Transport, host: HostConfig, timeout: float = 120.0) -> None:
        if problem := workdir_problem(host.workdir):  # config files are checked; hosts built in code are not
            raise ConfigError(f"hosts.{host.name}.workdir: {problem}")
        self.transport = transport
        self.host = host
        self.timeout = timeout
        self.round_trips = 0

    def _request(self, verb: str, params: dict[str, Any]) -> bytes:
        return json.dumps({
            "protocol": PROTOCOL,
            "verb": verb,
            "params": params,
            "host": {
                "name": self.host.name,
                "workdir": self.host.workdir,
                "python": self.host.python,
                "port": self.host.port,
                "env": self.host.env,
                "launch": self.host.launch_argv(),
                "args": list(self.host.args),
                "keep_history": self.host.keep_history,
            },
            "client": {"user": getpass.getuser(), "hostname": socket.gethostname()},
        }).encode()

    def _boot_argv(self) -> list[str]:
        # The host's env is applied by the agent to what it runs (with $VARS expanded there), not here:
        # `env PATH=/x:${PATH}` would hand the agent a literal "${PATH}".
        return [self.host.python, "-c", _BOOT, self.host.workdir, resources.agent_digest(), _SAY]

    def upload(self, repair: bool = False) -> None:
        """Install the agent unless an intact copy is there; `repair`: replace the copy in any case."""
        argv = [self.host.python, "-c", _UPLOAD, self.host.workdir, resources.agent_digest(), *(["repair"] * repair)]
        self.round_trips += 1
        res = self.transport.run(argv, stdin=resources.agent_archive(), timeout=self.timeout)
        # exit 3: the upload program's own refusal, whatever its text says
        if res.rc == 127 or (res.rc != 3 and b"No such file" in res.err and not res.out):
            raise PreflightError(
                f"{self.host.name}: python interpreter '{self.host.python}' not found "
                f"({self.transport.description}); set hosts.{self.host.name}.python"
            )
        if not res.ok:
            raise PreflightError(f"{self.host.name}: {res.stderr.strip() or 'agent upload failed'}")

    def call(self, verb: str, **params: Any) -> Any:
        """Run a verb; return its `result`, or raise AgentError with the agent's message."""
        answer = self._call_raw(verb, params)
        return answer.get("result")

    def call_through_drop(self, verb: str, lock: str, reconnect_for: float = 60.0, **params: Any) -> Any:
        """call() for a verb that is safe to send twice because it finds what an earlier one did (stop, start).

        After a dropped connection: reconnect and send it again, so the answer says what the host did rather
        than "unreachable"; while the first request still holds the host (`lock`, taken by us), wait for it.
        """
        dropped_at: float | None = None
        while True:
            try:
                return self.call(verb, **params)
            except HostKeyError:
                raise
            except UnreachableError as err:
                dropped_at = _pause_after_drop(err, dropped_at, reconnect_for)
            except AgentError as err:
                holder = err.answer.get("holder") or {}
                ours = (holder.get("operation") == lock and holder.get("who") == getpass.getuser()
                        and holder.get("client_host") == socket.gethostname())
                if dropped_at is None or err.kind != "busy" or not ours:
                    raise
                self._wait_unlocked(dropped_at + reconnect_for + self.timeout)

    def stream_through_drop(self, verb: str, reconnect_for: float = 60.0, **params: Any) -> Iterator[dict[str, Any]]:
        """stream() for a verb that only looks (a readiness wait): after a dropped connection, open it again."""
        dropped_at: float | None = None
        while True:
            try:
                yield from self.stream(verb, **params)
                return
            except HostKeyError:
                raise
            except UnreachableError as err:
                dropped_at = _pause_after_drop(err, dropped_at, reconnect_for)

    def _wait_unlocked(self, deadline: float) -> None:
        while self.call("op_current")["holder"] is not None:
            if time.monotonic() > deadline:
                raise UnreachableError(f"{self.host.name}: the request sent before the connection dropped still "
                                       "holds the host; see `dynctl status`")
            time.sleep(0.5)

    def _call_raw(self, verb: str, params: dict[str, Any]) -> dict[str, Any]:
        request = self._request(verb, params)
        for attempt in (1, 2):
            self.round_trips += 1
            res = self.transport.run(self._boot_argv(), stdin=request, timeout=self.timeout)
            if res.rc in (_MISSING_RC, _DAMAGED_RC) and attempt == 1:
                self.upload(repair=res.rc == _DAMAGED_RC)
                continue
            return self._parse(verb, res.rc, res.out, res.err)
        raise OperationFailed(f"{self.host.name}: the agent vanished right after upload")

    def _parse(self, verb: str, rc: int, out: bytes, err: bytes) -> dict[str, Any]:
        lines = [ln for ln in out.decode("utf-8", "replace").splitlines() if ln.strip()]
        if rc == _DAMAGED_RC and not lines:
            raise PreflightError(f"{self.host.name}: {err.decode('utf-8', 'replace').strip()[-800:]}; installing the "
                                 f"agent again did not repair it: check the disk under {self.host.workdir}, or remove "
                                 f"{self.host.workdir}/agent for a fresh copy; nothing was changed")
        if rc == 127 or (not lines and b"not found" in err):
            raise PreflightError(
                f"{self.host.name}: python interpreter '{self.host.python}' not found "
                f"({self.transport.description}); set hosts.{self.host.name}.python"
            )
        if not lines:
            raise OperationFailed(
                f"{self.host.name}: agent verb '{verb}' exited {rc} without an answer: "
                f"{err.decode('utf-8', 'replace').strip()[-800:]}"
            )
        try:
            answer = json.loads(lines[-1])
        except ValueError:
            raise OperationFailed(f"{self.host.name}: agent answered garbage: {lines[-1][:200]!r}") from None
        return self._check(answer)

    def _check(self, answer: dict[str, Any]) -> dict[str, Any]:
        if answer.get("protocol") != PROTOCOL:
            raise UsageError(
                f"{self.host.name}: agent protocol {answer.get('protocol')} does not match client protocol {PROTOCOL}"
            )
        if not answer.get("ok"):
            raise AgentError(f"{self.host.name}: {answer.get('error')}", answer.get("kind", "failed"), answer)
        return answer

    def stream(self, verb: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Run a streaming verb; yield each JSON line until the agent says done."""
        request = self._request(verb, params)
        for attempt in (1, 2):
            self.round_trips += 1
            stream = self.transport.open_stream(self._boot_argv(), stdin=request)
            got_any = False
            try:
                for raw in stream.lines():
                    if not raw.strip():
                        continue
                    got_any = True
                    item = self._check(json.loads(raw))
                    if item.get("done"):
                        return
                    yield item
            finally:
                stream.close()
            if not got_any and stream.rc in (_MISSING_RC, _DAMAGED_RC) and attempt == 1:
                self.upload(repair=stream.rc == _DAMAGED_RC)
                continue
            if not got_any and stream.rc == _DAMAGED_RC:
                raise PreflightError(f"{self.host.name}: the dynctl agent in {self.host.workdir}/agent is damaged and "
                                     "installing it again did not repair it (`dynctl hosts` shows why); nothing was "
                                     "changed")
            if stream.rc is None or stream.rc < 0:  # no exit status: the connection went away
                raise UnreachableError(f"{self.host.name}: connection lost during agent stream '{verb}'")
            raise OperationFailed(f"{self.host.name}: agent stream '{verb}' ended early (rc {stream.rc})")


def _pause_after_drop(err: UnreachableError, dropped_at: float | None, reconnect_for: float) -> float:
    """A moment before the next attempt; `err` again once the host has stayed away for `reconnect_for`."""
    dropped_at = dropped_at or time.monotonic()
    if time.monotonic() - dropped_at > reconnect_for:
        raise err
    time.sleep(1.0)
    return dropped_at
