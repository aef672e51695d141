"""Live data for the TUI: one thread per host streaming the agent's `watch` verb into snapshots (UI-free).

Each host has one long-lived agent call, not an exec per refresh (SPEC §6). A dropped or silent stream
turns into a "disconnected since ..." snapshot and a reconnect with backoff 1, 2, 4 ... 30 s; the last
minutes live in a `HostHistory` that any thread may read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from dynctl.base.config import Config, HostConfig
from dynctl.base.errors import DynctlError
from dynctl.live.snapshot import HostHistory, HostSnapshot, build_snapshot, disconnected

OnUpdate = Callable[[HostSnapshot, HostHistory], None]
BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


class WatchClient(Protocol):
    """What the feed needs of `dynctl.agent.client.AgentClient`."""

    def stream(self, verb: str, **params: Any) -> Iterator[dict[str, Any]]: ...


class Feed(Protocol):
    """What the TUI needs of a feed: it is built with the app's `on_update` and started on mount."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


def describe_error(err: BaseException) -> str:
    if isinstance(err, DynctlError):
        return str(err)
    return f"{type(err).__name__}: {err}".rstrip(": ")


class HostFeed:
    """One host: a reader thread per connection attempt; a stalled reader is abandoned, not waited for."""

    def __init__(self, host: HostConfig, open_client: Callable[[], WatchClient], on_update: OnUpdate, *,
                 interval: float = 1.0, log_lines: int = 50, history_s: float = 600.0,
                 backoff: Sequence[float] = BACKOFF, stall_after: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.host = host
        self.interval = interval
        self.log_lines = log_lines
        self.backoff = tuple(backoff)
        # A sample is due every interval; several missing in a row means the channel hangs.
        self.stall_after = stall_after if stall_after is not None else max(5.0, 5 * interval)
        self.history = HostHistory(host.name, window_s=history_s)
        self._open_client = open_client
        self._on_update = on_update
        self._clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._generation = 0
        self._threads: list[threading.Thread] = []
        self._heard_at: float | None = None  # last item, or the start of the attempt; None while backing off
        self._got_item = False
        self._failures = 0
        self.reconnects = 0

    def start(self) -> None:
        self._spawn()

    def stop(self, timeout: float = 3.0) -> None:
        """Ask every reader to end; readers blocked on a silent channel are daemons and do not hold us up."""
        self.request_stop()
        self.join(time.monotonic() + timeout)

    def request_stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._generation += 1

    def join(self, deadline: float) -> None:
        """Wait (until the monotonic `deadline`) for readers to close their streams, which ends the agents."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _spawn(self) -> None:
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._heard_at = None
            thread = threading.Thread(target=self._run, args=(generation,), daemon=True,
                                      name=f"feed-{self.host.name}-{generation}")
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _current(self, generation: int) -> bool:
        return not self._stop.is_set() and generation == self._generation

    def _run(self, generation: int) -> None:
        while self._current(generation):
            self._heard_at, self._got_item = self._clock(), False
            try:
                client = self._open_client()
                items: Iterable[dict[str, Any]] = client.stream(
                    "watch", interval=self.interval, log_lines=self.log_lines, gpu_procs=True)
                for item in items:
                    if not self._current(generation):
                        return  # leaving the loop closes the stream, which ends the agent
                    self._publish_item(item)
                    self._failures = 0
                error = "the watch stream ended"
            except Exception as err:  # any failure of the channel is a disconnect, never the end of the feed
                error = describe_error(err)
            if not self._current(generation):
                return
            self._heard_at = None
            delay = self.backoff[min(self._failures, len(self.backoff) - 1)]
            self._failures += 1
            self._publish_disconnected(error, delay)
            self._stop.wait(delay)
            if self._current(generation):
                self.reconnects += 1

    def _publish_item(self, item: dict[str, Any]) -> None:
        self._heard_at, self._got_item = self._clock(), True
        snap = build_snapshot(item, self.host.name, self.history.last_live, simulated=self.host.simulated)
        self.history.add(snap)
        self._on_update(snap, self.history)

    def _publish_disconnected(self, error: str, delay: float | None) -> None:
        now = self._clock()
        prev = self.history.latest
        snap = disconnected(self.host.name, now, error, prev, retry_at=now + delay if delay is not None else None,
                            simulated=self.host.simulated)
        self.history.add(snap)
        self._on_update(snap, self.history)

    def check_stall(self) -> bool:
        """Called every interval: a connected stream silent for `stall_after` is reported and replaced."""
        last = self._heard_at
        # the first item may wait for an agent upload and an interpreter start: give it longer
        limit = self.stall_after if self._got_item else self.stall_after + 15.0
        if self._stop.is_set() or last is None or self._clock() - last < limit:
            return False
        silent = self._clock() - last
        self._publish_disconnected(f"no data for {silent:.0f} s (channel stalled); reconnecting", None)
        self.reconnects += 1
        self._spawn()
        return True


def default_client_opener(host: HostConfig, config: Config | None) -> Callable[[], WatchClient]:
    def open_client() -> WatchClient:
        from dynctl.agent.client import LOOK_TIMEOUT, open_agent

        return open_agent(host, config, timeout=LOOK_TIMEOUT)

    return open_client


class LiveFeed:
    """The feed of several hosts, plus the watchdog that notices stalled channels."""

    def __init__(self, hosts: Sequence[HostConfig], on_update: OnUpdate, *, config: Config | None = None,
                 interval: float = 1.0, log_lines: int = 50, history_s: float = 600.0,
                 open_client: Callable[[HostConfig], Callable[[], WatchClient]] | None = None,
                 backoff: Sequence[float] = BACKOFF, stall_after: float | None = None) -> None:
        opener = open_client or (lambda h: default_client_opener(h, config))
        self.interval = interval
        self.hosts = {h.name: HostFeed(h, opener(h), on_update, interval=interval, log_lines=log_lines,
                                       history_s=history_s, backoff=backoff, stall_after=stall_after)
                      for h in hosts}
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_stalls, daemon=True, name="feed-watchdog")

    def start(self) -> None:
        for feed in self.hosts.values():
            feed.start()
        self._watchdog.start()

    def stop(self, timeout: float = 3.0) -> None:
        """All hosts at once, one shared deadline: quitting never waits on each slow host in turn."""
        self._stop.set()
        for feed in self.hosts.values():
            feed.request_stop()
        deadline = time.monotonic() + timeout
        for feed in self.hosts.values():
            feed.join(deadline)

    def history(self, host: str) -> HostHistory:
        return self.hosts[host].history

    def _watch_stalls(self) -> None:
        while not self._stop.wait(self.interval):
            for feed in self.hosts.values():
                feed.check_stall()
