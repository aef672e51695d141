"""Files dynctl ships to hosts: the agent and the patch payload.

In a source checkout they live at the repository root (`remote/`, `patches/`); in a wheel they are
packaged as `dynctl/_remote` and `dynctl/_patches`.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _shipped_dir(checkout_name: str, wheel_name: str, marker: str) -> Path:
    # the wheel's copy first: next to an installed dynctl, "../remote" may be some other package
    for candidate in (_PKG / wheel_name, _PKG.parent / checkout_name):
        if (candidate / marker).is_file():
            return candidate
    raise FileNotFoundError(f"dynctl is installed without its {checkout_name}/ directory")


def remote_dir() -> Path:
    return _shipped_dir("remote", "_remote", "dynctl_agent.py")


def patches_dir() -> Path:
    return _shipped_dir("patches", "_patches", "spec_batch_threshold.py")


@cache
def agent_source() -> bytes:
    return (remote_dir() / "dynctl_agent.py").read_bytes()


def agent_digest() -> str:
    return hashlib.sha256(agent_source()).hexdigest()[:16]
