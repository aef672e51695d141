"""Files dynctl ships to hosts: the agent and the patch payload.

In a source checkout they live at the repository root (`remote/`, `patches/`); in a wheel they are
packaged as `dynctl/_remote` and `dynctl/_patches`.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _shipped_dir(checkout_name: str, wheel_name: str) -> Path:
    for candidate in (_PKG.parent / checkout_name, _PKG / wheel_name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"dynctl is installed without its {checkout_name}/ directory")


def remote_dir() -> Path:
    return _shipped_dir("remote", "_remote")


def patches_dir() -> Path:
    return _shipped_dir("patches", "_patches")


@cache
def agent_source() -> bytes:
    return (remote_dir() / "dynctl_agent.py").read_bytes()


def agent_digest() -> str:
    return hashlib.sha256(agent_source()).hexdigest()[:16]
