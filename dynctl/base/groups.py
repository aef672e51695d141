"""Groups of hosts and their gateways in the config, and what `--host GROUP` / `--hosts a,b` name (UI-free).

    [groups.prod]
    hosts = ["a", "b", "edge"]          # host names, or other groups
    gateway = "http://10.0.0.2:30080"   # optional: the smg gateway in front of these hosts
    admin_key_env = "SMG_ADMIN_KEY"     # optional: the variable that holds the gateway's admin key

A host's gateways are those of every group that contains it, directly or through another group: whatever
target names the host, the gateway that routes to it is drained before its server restarts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dynctl.base.errors import ConfigError, UsageError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_GROUP_KEYS = ("hosts", "gateway", "admin_key_env")


@dataclass(frozen=True)
class Gateway:
    """An smg gateway; the admin key stays in the environment and is read only when a request needs it."""

    url: str
    admin_key_env: str | None = None
    group: str = ""  # the group that declared it, for messages

    def admin_key(self) -> str | None:
        """The key from the named variable; a clear error (exit 2) when the config names one that is unset."""
        if self.admin_key_env is None:
            return None
        value = os.environ.get(self.admin_key_env)
        if not value:
            raise UsageError(f"group {self.group}: gateway {self.url} needs its admin key from "
                             f"${self.admin_key_env} (admin_key_env), which is not set in this environment; "
                             "nothing was changed")
        return value


@dataclass(frozen=True)
class GroupConfig:
    name: str
    members: tuple[str, ...]  # host or group names, as written
    gateway: Gateway | None = None


def url_problem(url: str | None) -> str | None:
    """Why `url` cannot be a gateway or worker URL, or None."""
    if not url:
        return "must not be empty"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"expected http://HOST[:PORT] or https://..., got {url!r}"
    if parts.username or parts.password:
        return "must not carry credentials (keys are read from the variable named by admin_key_env)"
    if parts.query or parts.fragment:
        return f"expected a base URL without ?query or #fragment, got {url!r}"
    try:
        parts.port
    except ValueError as err:
        return f"{err} in {url!r}"
    return None


def parse_groups(raw: Any, hosts: dict[str, Any], where: str) -> dict[str, GroupConfig]:
    """The [groups.NAME] tables: names, members, gateways checked; cycles refused, each naming where."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: 'groups' must be a table of [groups.NAME] sections")
    groups: dict[str, GroupConfig] = {}
    for name, table in raw.items():
        key = f"groups.{name}"
        if not _NAME.match(name):
            raise ConfigError(f"{where}: [{key}]: a group name uses letters, digits, '.', '_' and '-'")
        if name in hosts or name == "local":
            raise ConfigError(f"{where}: [{key}]: '{name}' is also a host name; a name given to --host must say "
                              "one thing")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {key} must be a table")
        for k in table:
            if k not in _GROUP_KEYS:
                raise ConfigError(f"{where}: {key}.{k}: unknown key (expected one of {', '.join(_GROUP_KEYS)})")
        members = table.get("hosts")
        if not isinstance(members, list) or not members or not all(isinstance(m, str) for m in members):
            raise ConfigError(f"{where}: {key}.hosts: expected a non-empty list of host or group names")
        seen: set[str] = set()
        for member in members:
            if member in seen:
                raise ConfigError(f"{where}: {key}.hosts: '{member}' is listed twice")
            seen.add(member)
        gateway = None
        if "gateway" in table:
            url = table["gateway"]
            if not isinstance(url, str) or (problem := url_problem(url)):
                raise ConfigError(f"{where}: {key}.gateway: {problem if isinstance(url, str) else 'expected a URL'}")
            env = table.get("admin_key_env")
            if env is not None and (not isinstance(env, str) or not _ENV_NAME.fullmatch(env)):
                raise ConfigError(f"{where}: {key}.admin_key_env: expected the name of an environment variable "
                                  f"(the key itself never goes in the file), got {env!r}")
            gateway = Gateway(url.rstrip("/"), env, name)
        elif "admin_key_env" in table:
            raise ConfigError(f"{where}: {key}.admin_key_env: set without a gateway")
        groups[name] = GroupConfig(name, tuple(members), gateway)
    for group in groups.values():
        for member in group.members:
            if member not in hosts and member not in groups:
                known = ", ".join(sorted(hosts)) or "none"
                raise ConfigError(f"{where}: groups.{group.name}.hosts: '{member}' is neither a host nor a group "
                                  f"(hosts: {known})")
    for name in groups:
        _refuse_cycle(name, groups, [], where)
    return groups


def _refuse_cycle(name: str, groups: dict[str, GroupConfig], path: list[str], where: str) -> None:
    if name in path:
        cycle = " → ".join([*path[path.index(name):], name])
        raise ConfigError(f"{where}: groups form a cycle: {cycle}")
    for member in groups[name].members:
        if member in groups:
            _refuse_cycle(member, groups, [*path, name], where)


def expand(name: str, groups: dict[str, GroupConfig]) -> list[str]:
    """The host names of group `name`, in the order written, each once."""
    out: list[str] = []
    for member in groups[name].members:
        for host in (expand(member, groups) if member in groups else [member]):
            if host not in out:
                out.append(host)
    return out


def gateways_of(host: str, groups: dict[str, GroupConfig]) -> tuple[Gateway, ...]:
    """Every gateway in front of `host`: those of the groups containing it, directly or not (one per URL)."""
    found: dict[str, Gateway] = {}
    for group in groups.values():
        if group.gateway is not None and host in expand(group.name, groups):
            found.setdefault(group.gateway.url, group.gateway)
    return tuple(found.values())
