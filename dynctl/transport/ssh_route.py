"""Where an SSH target really is: ~/.ssh/config resolved into the hops to connect through (ProxyJump)."""

from __future__ import annotations

import fnmatch
import getpass
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import paramiko

from dynctl.base.config import SSHTarget, parse_ssh_target
from dynctl.base.errors import ConfigError, UnreachableError

_MAX_HOPS = 8


@dataclass(frozen=True)
class Hop:
    """One SSH server on the way, with everything needed to log in to it."""

    user: str
    hostname: str
    port: int
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    alias: str = ""

    def __str__(self) -> str:
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        return f"{self.user}@{host}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        """The name OpenSSH files this host's key under."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def load_ssh_config(path: str | None) -> tuple[paramiko.SSHConfig, str]:
    """The user's ssh_config (an explicit path must exist; the default one may be absent)."""
    chosen = os.path.expanduser(path) if path else os.path.expanduser("~/.ssh/config")
    if not os.path.exists(chosen):
        if path:
            raise ConfigError(f"ssh_config file {chosen} not found (named by ssh_config in the dynctl config)")
        return paramiko.SSHConfig(), chosen
    try:
        return paramiko.SSHConfig.from_path(chosen), chosen
    except (paramiko.ssh_exception.ConfigParseError, OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{chosen}: cannot parse ssh config: {err}") from None


def resolve_route(target: SSHTarget, ssh_config_path: str | None = None,
                  identity_file: str | None = None) -> list[Hop]:
    """The hops to connect through, in order; the last one is `target`."""
    config, where = load_ssh_config(ssh_config_path)
    return _route(target, config, where, identity_file, seen=())


def _route(target: SSHTarget, config: paramiko.SSHConfig, where: str, identity_file: str | None,
           seen: tuple[str, ...], *, is_target: bool = True) -> list[Hop]:
    if len(seen) >= _MAX_HOPS or str(target) in seen:
        chain = " → ".join([*seen, str(target)])
        raise UnreachableError(f"ProxyJump loop or chain too long in {where}: {chain}")
    hop = _hop(target, config, where, identity_file, is_target=is_target)
    opts = config.lookup(target.host)
    jump = opts.get("proxyjump", "none").strip()
    if jump.lower() == "none" or not jump:
        if opts.get("proxycommand", "none").strip().lower() != "none":
            # Connecting directly instead would quietly take another path than the user's ssh does.
            raise ConfigError(f"{where}: Host {target.host}: ProxyCommand is not supported by dynctl; "
                              "use ProxyJump (or reach the host directly)")
        return [hop]
    # `ProxyJump a,b` reaches b through a and the target through b; a itself follows its own config,
    # which is what OpenSSH's `ssh -J a,b` does.
    specs = [s.strip() for s in jump.split(",") if s.strip()]
    hops: list[Hop] = []
    for i, spec in enumerate(specs):
        try:
            jt = parse_jump_spec(spec)
        except ValueError as err:
            raise ConfigError(f"{where}: Host {target.host}: ProxyJump {jump!r}: {err}") from None
        if i == 0:
            hops = _route(jt, config, where, identity_file, (*seen, str(target)), is_target=False)
        else:
            hops.append(_hop(jt, config, where, identity_file, is_target=False))
    return [*hops, hop]


def _hop(target: SSHTarget, config: paramiko.SSHConfig, where: str, identity_file: str | None,
         *, is_target: bool) -> Hop:
    """Settings for one host. dynctl's identity_file wins for the target and backs up a jump host's own."""
    _require_known_alias(target, config, where)
    opts = config.lookup(target.host)
    port_text = str(target.port) if target.port else opts.get("port", "22")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{where}: Host {target.host}: Port {port_text!r} is not a number") from None
    files = list(opts.get("identityfile", []))
    if identity_file and (is_target or not files):
        files = [identity_file]
    return Hop(
        user=target.user or opts.get("user") or getpass.getuser(),
        hostname=opts.get("hostname", target.host),
        port=port,
        identity_files=tuple(os.path.expanduser(f) for f in files),
        identities_only=opts.get("identitiesonly", "no").lower() == "yes",
        alias=target.host,
    )


def parse_jump_spec(spec: str) -> SSHTarget:
    """`[ssh://][user@]host[:port]` as ProxyJump takes it."""
    return parse_ssh_target(spec.removeprefix("ssh://"))


def _require_known_alias(target: SSHTarget, config: paramiko.SSHConfig, where: str) -> None:
    """A bare word (no user@, no :port, no dot) must be a Host alias: dynctl's `ssh` key says so.

    Checking here also keeps a typo from turning into a DNS query for a name nobody meant.
    """
    name = target.host
    if target.user or target.port or "." in name or ":" in name or name == "localhost" or _is_ip(name):
        return
    for pattern in config.get_hostnames():
        if pattern == "*" or pattern.startswith("!"):
            continue
        if fnmatch.fnmatchcase(name, pattern):
            return
    shown = where if Path(where).exists() else f"{where} (absent)"
    raise UnreachableError(
        f"ssh target '{name}' is not a Host alias in {shown}; write user@host[:port] "
        f"or add a 'Host {name}' block with its HostName"
    )


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
