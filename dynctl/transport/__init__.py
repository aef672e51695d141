"""Transports: `Local`, `SSH` (paramiko) and `Pct`, which wraps another transport."""

from __future__ import annotations

import threading

from dynctl.base.config import Config, HostConfig, user_state_dir
from dynctl.transport.base import Result, Stream, Transport, sh_join
from dynctl.transport.local import Local

__all__ = ["Result", "Stream", "Transport", "connect", "sh_join", "close_all"]

_pool: dict[tuple, Transport] = {}
_pool_lock = threading.Lock()


def connect(host: HostConfig, config: Config | None = None) -> Transport:
    """The transport for `host`, shared by everything in this process (one SSH connection per host)."""
    key = (host.ssh, host.pct, host.identity_file, host.accept_new_host_key,
           config.ssh_config if config else None, config.known_hosts if config else None)
    with _pool_lock:
        found = _pool.get(key)
        if found is not None:
            return found
        base: Transport
        if host.ssh is None:
            base = Local()
        else:
            from dynctl.transport.ssh import SSH

            base = SSH(
                host.ssh,
                ssh_config_path=config.ssh_config if config else None,
                known_hosts_path=(config.known_hosts if config and config.known_hosts
                                  else str(user_state_dir() / "known_hosts")),
                identity_file=host.identity_file,
                accept_new=host.accept_new_host_key,
            )
        if host.pct is not None:
            from dynctl.transport.pct import Pct

            base = Pct(base, host.pct)
        _pool[key] = base
        return base


def close_all() -> None:
    with _pool_lock:
        for t in _pool.values():
            t.close()
        _pool.clear()
