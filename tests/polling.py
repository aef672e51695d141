"""Waiting in tests: poll a condition until a deadline, never sleep a fixed time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psutil


T = TypeVar("T")


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


def finishes(call: Callable[[], T], timeout: float = 60.0, what: str = "the call") -> T:
    """call()'s value (or its exception); a failure when it still runs at the deadline, which only a hang reaches.

    For code whose failure mode is to block: the call runs in a daemon thread, left behind if it hangs.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread as it is
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True, name=f"finishes: {what}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"{what} still running after {timeout:g} s: it hangs")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def at_once(call: Callable[[], T], n: int, timeout: float = 30.0) -> list[Any]:
    """`call()` in `n` threads started together: each one's value or exception, in the order they ended."""
    outcomes: list[Any] = []

    def one() -> None:
        try:
            outcomes.append(call())
        except Exception as err:  # noqa: BLE001 - reported with the others
            outcomes.append(err)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return outcomes
