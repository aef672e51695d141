"""A real OpenSSH server on loopback with throwaway keys and a `pct` stand-in on its PATH.

Used by tests/conftest.py and benchmarks/bench_transport.py. Processes are stopped strictly by pid:
the listener's session children, the listener, then anything carrying this server's DYNTEST_RUN
marker in its environment (that catches setsid/nohup-detached servers). Zombies count as gone.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from polling import alive

HERE = Path(__file__).resolve().parent
SSHD = shutil.which("sshd", path="/usr/sbin:/usr/bin:/sbin:/bin") or "/usr/sbin/sshd"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# sshd honours only the first SetEnv line, so every variable sits on one line.
SSHD_CONFIG = """\
Port {port}
ListenAddress {host}
HostKey {host_key}
PidFile {tmp}/sshd.pid
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM {use_pam}
StrictModes no
AllowTcpForwarding yes
MaxSessions {max_sessions}
UseDNS no
Subsystem sftp internal-sftp
LogLevel VERBOSE
SetEnv {set_env}
"""


# Under pytest-xdist each worker draws its ports from a block of its own below the kernel's ephemeral range
# (32768-60999 by default), so two workers never pick the same port and no outgoing connection takes one
# between the pick and the bind. Outside xdist (or past the blocks) the kernel picks.
PORT_BLOCKS_START, PORT_BLOCK_SIZE, PORT_BLOCKS = 20000, 1000, 12
_next_port: dict[str, int] = {}


def _worker_block() -> range | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and int(worker[2:]) < PORT_BLOCKS):
        return None
    start = PORT_BLOCKS_START + int(worker[2:]) * PORT_BLOCK_SIZE
    return range(start, start + PORT_BLOCK_SIZE)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to on `host` now (this worker's own, under xdist)."""
    block = _worker_block()
    if block is None:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    offset = _next_port.get(host, random.randrange(len(block)))
    for step in range(len(block)):
        port = block[(offset + step) % len(block)]
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # taken, or still in TIME_WAIT from an earlier test
                continue
        _next_port[host] = (offset + step + 1) % len(block)
        return port
    raise RuntimeError(f"no free port on {host} in {block.start}-{block.stop - 1}")


def wait_gone(procs: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    left = [p for p in procs if alive(p.pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if alive(p.pid)]
    return left


def kill_procs(procs: Iterable[psutil.Process], grace: float = 3.0) -> None:
    procs = [p for p in procs if alive(p.pid)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    for p in wait_gone(procs, grace):
        with contextlib.suppress(psutil.Error):
            p.kill()
    wait_gone(procs, grace)


def procs_with_marker(marker: str) -> list[psutil.Process]:
    found = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        with contextlib.suppress(psutil.Error):
            if p.environ().get("DYNTEST_RUN") == marker:
                found.append(p)
    return found


def root_account_locked() -> bool:
    """A '!' password field makes `UsePAM no` refuse the login ("account is locked")."""
    with contextlib.suppress(OSError):
        for line in Path("/etc/shadow").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == getpass.getuser():
                return rest.startswith("!")
    return False


def generate_key(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dynctl-test", "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL)
    return path


@dataclass
class SSHServer:
    """One running sshd listener."""

    host: str
    port: int
    proc: subprocess.Popen
    log: Path
    marker: str

    def session_processes(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.proc.pid).children(recursive=True)
        return []

    def drop_connections(self) -> None:
        """Kill every open session, as a dropped connection ends it: the per-connection sshd processes and
        what runs in the sessions sshd made for their commands. The listener keeps running. A process that
        left its session (setsid, as dynctl's detached operation worker does) is no longer the session's,
        and sshd does not reach it; taking every descendant at the instant of the cut would also hit such
        a worker in the moment between its fork and its parent's exit."""
        procs = self.session_processes()
        sessions = set()
        for p in procs:
            with contextlib.suppress(psutil.Error, OSError):
                if p.parent().name().startswith("sshd"):
                    sessions.add(os.getsid(p.pid))

        def in_a_session(p: psutil.Process) -> bool:
            with contextlib.suppress(psutil.Error, OSError):
                return p.name().startswith("sshd") or os.getsid(p.pid) in sessions
            return False

        kill_procs([p for p in procs if in_a_session(p)])

    def stop(self) -> None:
        kill_procs(self.session_processes())  # each session has its own SID: the listener's TERM misses them
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        kill_procs(procs_with_marker(self.marker))


def start_sshd(tmp: Path, *, host_key: Path, authorized_keys: Path, env: Mapping[str, str], marker: str,
               host: str = "127.0.0.1", port: int | None = None, max_sessions: int = 10,
               tries: int = 5, extra_config: str = "") -> SSHServer:
    use_pam = "yes" if os.geteuid() == 0 and root_account_locked() else "no"
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
    variables = {**env, "DYNTEST_RUN": marker}
    if any(c.isspace() or c in "\"'" for v in variables.values() for c in v):
        raise ValueError(f"sshd SetEnv values cannot hold spaces or quotes: {variables}")
    set_env = " ".join(f"{k}={v}" for k, v in variables.items())
    log = tmp / "sshd.log"
    for _ in range(tries):
        chosen = port or free_port(host)
        cfg = tmp / "sshd_config"
        cfg.write_text(SSHD_CONFIG.format(port=chosen, host=host, host_key=host_key, tmp=tmp,
                                          authorized_keys=authorized_keys, use_pam=use_pam,
                                          max_sessions=max_sessions, set_env=set_env) + extra_config)
        with open(log, "ab") as logf:
            proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdout=logf, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        if wait_for_banner(host, chosen, proc, timeout=10):
            return SSHServer(host, chosen, proc, log, marker)
        if proc.poll() is None:  # the port raced away or sshd is stuck: retry on another one
            proc.kill()
        proc.wait()
    raise RuntimeError(f"sshd did not start on {host}:\n{log.read_text()[-3000:]}")


def wait_for_banner(host: str, port: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5) as s:
            if s.recv(64).startswith(b"SSH-2.0-"):
                return True
        time.sleep(0.02)
    return False


@dataclass
class FakeHost:
    """A loopback SSH host whose PATH has the `pct` shim; containers are directories under ct/."""

    host: str
    port: int
    user: str
    client_key: Path
    host_key_line: str
    tmp: Path
    server: SSHServer

    @property
    def target(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def marker(self) -> str:
        return self.server.marker

    @property
    def ct_dir(self) -> Path:
        return self.tmp / "ct"

    def ct_root(self, ctid: int) -> Path:
        """The container's `/root`: the cwd of `pct exec` there."""
        return self.ct_dir / str(ctid) / "root"

    def make_ct(self, ctid: int, state: str = "running", *, lose_exit_status: bool = False) -> Path:
        """Create (or update) container `ctid`; `lose_exit_status` mimics LXC 3.0.4-3.2.1 (always exit 0)."""
        base = self.ct_dir / str(ctid)
        (base / "root").mkdir(parents=True, exist_ok=True)
        (base / "state").write_text(state + "\n")
        bug = base / "lose_exit_status"
        if lose_exit_status:
            bug.write_text("1\n")
        elif bug.exists():
            bug.unlink()
        return base / "root"

    def pct_calls(self) -> list[str]:
        log = self.ct_dir / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def write_config(self, path: Path, hosts: Mapping[str, Mapping[str, Any]],
                     default_host: str | None = None, ssh_config: str = "") -> Path:
        """A dynctl TOML for `hosts`, with this host's key pre-trusted and the client key as identity_file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        known = path.with_name(path.stem + ".known_hosts")
        known.write_text(self.host_key_line + "\n")
        known.chmod(0o600)
        sshcfg = path.with_name(path.stem + ".ssh_config")
        sshcfg.write_text(ssh_config)
        lines = [f"known_hosts = {toml_value(str(known))}", f"ssh_config = {toml_value(str(sshcfg))}"]
        if default_host:
            lines.append(f"default_host = {toml_value(default_host)}")
        for name, values in hosts.items():
            values = dict(values)
            if "ssh" in values:
                values.setdefault("identity_file", str(self.client_key))
            lines.append(f"\n[hosts.{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        path.write_text("\n".join(lines) + "\n")
        return path

    def trusted_known_hosts(self) -> Path:
        """A known_hosts file that trusts this host's key (and nothing else)."""
        path = self.tmp / "trusted_known_hosts"
        path.write_text(self.host_key_line + "\n")
        path.chmod(0o600)
        return path

    def ssh(self, **kwargs: Any):
        """A dynctl SSH transport to this host: its key trusted, the client key as identity."""
        from dynctl.base.config import SSHTarget
        from dynctl.transport.ssh import SSH

        kwargs.setdefault("known_hosts_path", str(self.trusted_known_hosts()))
        kwargs.setdefault("identity_file", str(self.client_key))
        return SSH(SSHTarget(self.user, self.host, self.port), **kwargs)

    def stop(self) -> None:
        self.server.stop()


def toml_value(value: Any) -> str:
    """A TOML literal for the few types dynctl's config uses (JSON strings are valid TOML strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(str(value), ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def start_fake_host(tmp: Path, *, host: str = "127.0.0.1", client_key: Path | None = None,
                    marker: str | None = None, max_sessions: int = 10,
                    extra_config: Callable[[Path], str] | None = None) -> FakeHost:
    """Keys, shim and sshd under `tmp`; `client_key` shares one login key between several fake hosts.

    `extra_config(host_key_path)` returns more sshd_config lines (e.g. a HostCertificate made for that key).
    """
    if not os.path.exists(SSHD):
        raise RuntimeError("sshd not found: apt-get install -y openssh-server")
    tmp.mkdir(parents=True, exist_ok=True)
    for d in ("home", "bin", "ct"):
        (tmp / d).mkdir(exist_ok=True)
    host_key = generate_key(tmp / "host_ed25519")
    if client_key is None:
        client_key = generate_key(tmp / "client_ed25519")
    authorized = tmp / "authorized_keys"
    shutil.copy(f"{client_key}.pub", authorized)
    shutil.copy(HERE / "pct_shim.sh", tmp / "bin" / "pct")
    (tmp / "bin" / "pct").chmod(0o755)
    env = {"HOME": str(tmp / "home"), "PATH": f"{tmp / 'bin'}:{SYSTEM_PATH}", "PCT_SHIM_ROOT": str(tmp / "ct")}
    server = start_sshd(tmp, host_key=host_key, authorized_keys=authorized, env=env,
                        marker=marker or uuid.uuid4().hex, host=host, max_sessions=max_sessions,
                        extra_config=extra_config(host_key) if extra_config else "")
    keytype, b64 = Path(f"{host_key}.pub").read_text().split()[:2]
    name = host if server.port == 22 else f"[{host}]:{server.port}"
    return FakeHost(host=host, port=server.port, user=getpass.getuser(), client_key=client_key,
                    host_key_line=f"{name} {keytype} {b64}", tmp=tmp, server=server)


def connection_owner(local_port: int, remote_port: int, host: str = "127.0.0.1") -> int | None:
    """The pid owning the TCP connection host:local_port -> host:remote_port (both ends are needed:
    Linux reuses one ephemeral port for connections to different destinations)."""
    for conn in psutil.net_connections(kind="tcp"):
        if (conn.laddr and conn.raddr and conn.pid and conn.laddr.port == local_port and conn.laddr.ip == host
                and conn.raddr.port == remote_port):
            return conn.pid
    return None
