"""The TOML config of SPEC §3: where it is looked up, what it holds, and errors that name file and key."""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dynctl.base import hostspec
from dynctl.base.errors import ConfigError, UsageError
from dynctl.base.hostspec import workdir_problem

DEFAULT_LAUNCH = ("{python}", "-m", "sglang.launch_server")
DEFAULT_KEEP_HISTORY = hostspec.DEFAULT_KEEP_HISTORY
LOCAL_HOST = "local"
# A host's `strategy`: "auto" patches sglang where dynctl has a patch variant for the release that was
# measured on a GPU and passes the native adaptive config elsewhere; "patch" and "native" insist on one
# ("patch" also takes a variant that was not measured on a GPU).
STRATEGIES = ("auto", "patch", "native")
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_SSH_TARGET = re.compile(r"^(?:(?P<user>[^@\s]+)@)?(?P<host>\[[^\]]+\]|[^:@\s]+)(?::(?P<port>\d+))?$")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch: "A\n" is no name (`$` would let it through)
# Flags dynctl puts on the launch argv itself (SPEC §3): `args` that set them would fight with it.
OWN_FLAGS = ("--port", "--enable-metrics", "--speculative-disable-batch-threshold")
OWN_FLAG_PREFIXES = ("--speculative-adaptive",)  # --speculative-adaptive, --speculative-adaptive-config, ...


def user_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "dynctl" / "config.toml"


def user_state_dir() -> Path:
    """Where dynctl keeps its own files on the client (known_hosts, caches)."""
    return user_config_path().parent


@dataclass(frozen=True)
class SSHTarget:
    user: str | None
    host: str
    port: int | None

    def __str__(self) -> str:
        s = f"{self.user}@{self.host}" if self.user else self.host
        return f"{s}:{self.port}" if self.port else s


@dataclass(frozen=True)
class HostConfig:
    name: str
    ssh: SSHTarget | None = None
    pct: int | None = None
    python: str = "python3"
    workdir: str = hostspec.DEFAULT_WORKDIR
    port: int = hostspec.DEFAULT_PORT
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    launch: tuple[str, ...] = DEFAULT_LAUNCH
    identity_file: str | None = None
    accept_new_host_key: bool = False
    simulated: bool = False
    keep_history: int = DEFAULT_KEEP_HISTORY
    strategy: str = "auto"  # auto | patch | native: how the threshold reaches sglang
    worker_url: str | None = None  # the URL a gateway knows this host's server by (default: ssh host and port)

    @property
    def gateway_url(self) -> str:
        """The URL under which a gateway routes to this host's server: `worker_url`, else http://<ssh host>:<port>."""
        if self.worker_url:
            return self.worker_url.rstrip("/")
        host = self.ssh.host if self.ssh else "127.0.0.1"
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    @property
    def route(self) -> str:
        """How the host is reached, in words: `local`, `ssh root@pve`, `ssh root@pve → pct 129`."""
        hops = [f"ssh {self.ssh}" if self.ssh else "local"]
        if self.pct is not None:
            hops.append(f"pct {self.pct}")
        return " → ".join(hops)

    def launch_argv(self) -> list[str]:
        return [part.replace("{python}", self.python) for part in self.launch]


@dataclass(frozen=True)
class Config:
    path: Path | None
    hosts: dict[str, HostConfig]
    default_host: str | None = None
    ssh_config: str | None = None
    known_hosts: str | None = None
    groups: dict[str, Any] = field(default_factory=dict)  # name -> dynctl.base.groups.GroupConfig

    def host(self, name: str | None) -> HostConfig:
        """The host called `name`, else the default host, else this machine."""
        if name is not None and not name.strip():
            # `--host "$HOST"` with HOST unset must not quietly act on the default host.
            known = ", ".join(sorted(self.hosts)) or f"none; '{LOCAL_HOST}' is this machine"
            raise UsageError(f"--host: empty host name {name!r}; give a host defined in {self._where} ({known}), "
                             "or leave --host out for the default host")
        chosen = name or self.default_host
        if chosen is None:
            if len(self.hosts) == 1:
                return next(iter(self.hosts.values()))
            if not self.hosts:
                return HostConfig(name=LOCAL_HOST)
            raise ConfigError(
                f"{self._where}: several hosts are defined ({', '.join(sorted(self.hosts))}) and no "
                "default_host is set; pass --host NAME"
            )
        if chosen in self.hosts:
            return self.hosts[chosen]
        if chosen == LOCAL_HOST:
            return HostConfig(name=LOCAL_HOST)
        if chosen in self.groups:
            raise UsageError(f"--host {chosen}: '{chosen}' is a group in {self._where}; this command acts on one "
                             "host (status, releases, threshold, deploy and rollback take a group)")
        known = ", ".join(sorted(self.hosts)) or "none"
        raise ConfigError(f"{self._where}: no host named '{chosen}' (defined: {known})")

    @property
    def _where(self) -> str:
        return str(self.path) if self.path else "config"


def lookup_order(explicit: str | os.PathLike | None = None) -> list[tuple[str, Path | None]]:
    """Where a config is looked for, in SPEC §3 order: (source, path); path None where the source is not set."""
    env = os.environ.get("DYNCTL_CONFIG")
    return [("--config", Path(explicit).expanduser() if explicit else None),
            ("$DYNCTL_CONFIG", Path(env).expanduser() if env else None),
            ("./dynctl.toml", Path.cwd() / "dynctl.toml"),
            ("user config", user_config_path())]


def find_config_path(explicit: str | os.PathLike | None = None) -> Path | None:
    """SPEC §3 order: --config, $DYNCTL_CONFIG, ./dynctl.toml, ~/.config/dynctl/config.toml."""
    for source, path in lookup_order(explicit):
        if path is None:
            continue
        if path.is_file():
            return path
        if source == "--config":
            raise ConfigError(f"{path}: config file not found (given with --config)")
        if source == "$DYNCTL_CONFIG":
            raise ConfigError(f"{path}: config file not found (named by $DYNCTL_CONFIG)")
    return None


def load_config(explicit: str | os.PathLike | None = None) -> Config:
    path = find_config_path(explicit)
    if path is None:
        return Config(path=None, hosts={})
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: TOML syntax error: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read config: {err}") from None
    return parse_config(data, path)


def parse_config(data: dict[str, Any], path: Path | None = None) -> Config:
    where = str(path) if path else "config"
    known_top = {"default_host", "hosts", "ssh_config", "known_hosts", "groups"}
    for key in data:
        if key not in known_top:
            raise ConfigError(f"{where}: unknown key '{key}' (expected one of {', '.join(sorted(known_top))})")
    hosts_raw = data.get("hosts", {})
    if not isinstance(hosts_raw, dict):
        raise ConfigError(f"{where}: 'hosts' must be a table of [hosts.NAME] sections")
    hosts = {name: _parse_host(name, raw, where) for name, raw in hosts_raw.items()}
    default = _opt_str(data, "default_host", where, "default_host")
    if default is not None and default not in hosts:
        raise ConfigError(
            f"{where}: default_host = '{default}' names no [hosts.{default}] section "
            f"(defined: {', '.join(sorted(hosts)) or 'none'})"
        )
    from dynctl.base.groups import parse_groups

    return Config(
        path=path,
        hosts=hosts,
        default_host=default,
        ssh_config=_opt_str(data, "ssh_config", where, "ssh_config"),
        known_hosts=_opt_str(data, "known_hosts", where, "known_hosts"),
        groups=parse_groups(data.get("groups", {}), hosts, where),
    )


def parse_ssh_target(text: str) -> SSHTarget:
    m = _SSH_TARGET.match(text.strip())
    if not m or not text.strip():
        raise ValueError(f"'{text}' is not user@host[:port] or an ssh_config alias")
    port = int(m["port"]) if m["port"] else None
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"port {port} is out of range 1-65535")
    host = m["host"].strip("[]")
    return SSHTarget(user=m["user"], host=host, port=port)


_HOST_KEYS = {
    "ssh", "pct", "python", "workdir", "port", "env", "args", "launch",
    "identity_file", "accept_new_host_key", "simulated", "keep_history", "strategy", "worker_url",
}


def own_flag_in(args: tuple[str, ...] | list[str]) -> str | None:
    """The first of `args` that is a flag dynctl adds to the launch argv itself, or None."""
    for arg in args:
        flag = arg.partition("=")[0]
        if flag in OWN_FLAGS or flag.startswith(OWN_FLAG_PREFIXES):
            return flag
    return None


def _refuse_nul(value: str, where: str, key: str) -> None:
    """A NUL byte cannot be part of an argv or environment string on any host: refuse it here, named."""
    if "\0" in value:
        raise ConfigError(f"{where}: {key}: contains a NUL byte (\\u0000) at position {value.index(chr(0))}, "
                          "which no command line or environment can carry")


def _parse_host(name: str, raw: Any, where: str) -> HostConfig:
    key = f"hosts.{name}"
    if not _HOST_NAME.match(name):
        raise ConfigError(f"{where}: [{key}]: a host name uses letters, digits, '.', '_' and '-'")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {key} must be a table")
    for k in raw:
        if k not in _HOST_KEYS:
            raise ConfigError(f"{where}: {key}.{k}: unknown key (expected one of {', '.join(sorted(_HOST_KEYS))})")
    host = HostConfig(name=name)
    if "ssh" in raw:
        text = _opt_str(raw, "ssh", where, f"{key}.ssh")
        try:
            host = replace(host, ssh=parse_ssh_target(text))
        except ValueError as err:
            raise ConfigError(f"{where}: {key}.ssh: {err}") from None
    if "pct" in raw:
        pct = raw["pct"]
        if isinstance(pct, str) and pct.isdigit():
            pct = int(pct)
        if not isinstance(pct, int) or isinstance(pct, bool) or not 100 <= pct <= 999_999_999:
            raise ConfigError(
                f"{where}: {key}.pct: expected a Proxmox container id (an integer ≥ 100), got {raw['pct']!r}"
            )
        host = replace(host, pct=pct)
    for k in ("python", "workdir", "identity_file"):
        if k in raw:
            value = _opt_str(raw, k, where, f"{key}.{k}")
            if not value:
                raise ConfigError(f"{where}: {key}.{k}: must not be empty")
            _refuse_nul(value, where, f"{key}.{k}")
            if k == "workdir" and (problem := workdir_problem(value)):
                raise ConfigError(f"{where}: {key}.workdir: {problem}")
            host = replace(host, **{k: value})
    if "port" in raw:
        port = raw["port"]
        if problem := hostspec.port_problem(port):
            raise ConfigError(f"{where}: {key}.port: {problem}")
        host = replace(host, port=port)
    if "keep_history" in raw:
        keep = raw["keep_history"]
        if problem := hostspec.keep_history_problem(keep):
            raise ConfigError(f"{where}: {key}.keep_history: {problem}")
        host = replace(host, keep_history=keep)
    if "env" in raw:
        env = raw["env"]
        if not isinstance(env, dict) or not all(isinstance(v, (str, int, float, bool)) for v in env.values()):
            raise ConfigError(f"{where}: {key}.env: expected a table of NAME = \"value\"")
        for var, value in env.items():
            if not _ENV_NAME.fullmatch(var):
                shown = var if var.isprintable() else repr(var)
                raise ConfigError(f"{where}: {key}.env.{shown}: not a valid environment variable name")
            if isinstance(value, str):
                _refuse_nul(value, where, f"{key}.env.{var}")
        host = replace(host, env={k: _env_value(v) for k, v in env.items()})
    for k in ("args", "launch"):
        if k in raw:
            value = raw[k]
            if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
                raise ConfigError(f"{where}: {key}.{k}: expected a list of strings")
            if k == "launch" and not value:
                raise ConfigError(f"{where}: {key}.launch: must not be empty")
            for i, arg in enumerate(value):
                _refuse_nul(arg, where, f"{key}.{k}[{i}]")
            if k == "args" and (flag := own_flag_in(value)):
                raise ConfigError(f"{where}: {key}.args: remove {flag}; dynctl adds it itself (SPEC §3)")
            host = replace(host, **{k: tuple(value)})
    if "strategy" in raw:
        strategy = raw["strategy"]
        if strategy not in STRATEGIES:
            raise ConfigError(f"{where}: {key}.strategy: expected one of {', '.join(repr(s) for s in STRATEGIES)} "
                              f"(auto: the patch where dynctl has one for the release, else native), got {strategy!r}")
        host = replace(host, strategy=strategy)
    if "worker_url" in raw:
        from dynctl.base.groups import url_problem

        url = _opt_str(raw, "worker_url", where, f"{key}.worker_url")
        if problem := url_problem(url):
            raise ConfigError(f"{where}: {key}.worker_url: {problem}")
        host = replace(host, worker_url=url)
    for k in ("accept_new_host_key", "simulated"):
        if k in raw:
            if not isinstance(raw[k], bool):
                raise ConfigError(f"{where}: {key}.{k}: expected true or false, got {raw[k]!r}")
            host = replace(host, **{k: raw[k]})
    return host


def _env_value(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def _opt_str(table: dict[str, Any], k: str, where: str, key: str) -> str | None:
    if k not in table:
        return None
    value = table[k]
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key}: expected a string, got {value!r}")
    return value
