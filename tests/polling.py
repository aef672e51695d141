"""Waiting in tests: poll a condition until a deadline, never sleep a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psutil


def alive(pid: int) -> bool:
    """Whether `pid` still runs; a zombie does not (init may reap it a moment later)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_for(cond: Callable[[], Any], timeout: float = 30.0, what: str = "condition", interval: float = 0.02) -> Any:
    """Poll `cond` until it is truthy and return its value; fail the test with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)

