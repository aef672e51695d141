"""What the live view knows about one host at one moment, and the last minutes of it (UI-free).

`build_snapshot` turns one item of the agent's `watch` stream into a `HostSnapshot`; it is a pure
function of the item and the previous snapshot, which carries what a sample does not repeat
(the server info is sampled every few seconds, a drain is announced once in the log).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from dynctl.base import sglang
from dynctl.base.parsers import MetricsFormatError
from dynctl.base.parsers.nvidia_smi import GpuStat, parse_compute_apps_csv, parse_gpu_csv
from dynctl.base.parsers.prometheus import ServerMetrics, read_server_metrics
from dynctl.base.parsers.serverlog import (
    DecodeLine,
    parse_decode_line,
    parse_threshold_warning,
    parse_transition_line,
    split_log_prefix,
)

LOG_RESTARTED = "──── log restarted (new server run) ────"
SERVER_STATES = ("down", "starting", "ready", "draining", "unresponsive", "unknown")
_DRAIN_MARK = "SIGTERM received"  # sglang 0.5.9 tokenizer_manager.py:2502, logged when a drain begins
# tok/s is the rate of sglang:generation_tokens_total over this window: once load stops it reads 0 within it,
# while the gen_throughput gauge keeps its last value (sglang refreshes it on a decode log line only).
RATE_WINDOW_S = 5.0
MIN_RATE_SPAN_S = 1.0  # a shorter span between two counter readings says too little
STALE_AFTER_S = 10.0  # a number read from a gauge or a log line older than this is shown as stale


@dataclass(frozen=True)
class Reading:
    """Where a number came from and how old it was at the sample: `counter` (a rate over the window),
    `/v1/loads`, `metrics` (a gauge, as old as the last decode step that set it), `log`, `server_info`;
    for speculation also `threshold` (an idle server: what the live threshold gives a batch of one) and
    `inferred`."""

    source: str
    age_s: float | None = None  # None: unknown

    @property
    def stale(self) -> bool:
        return self.age_s is not None and self.age_s > STALE_AFTER_S

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "age_s": None if self.age_s is None else round(self.age_s, 1),
                "stale": self.stale}


@dataclass(frozen=True)
class Switch:
    """A moment speculation turned on (`enabled`) or off, in the host's clock."""

    time: float
    enabled: bool
    batch_size: int | None = None
    threshold: int | None = None
    source: str = "log"  # "gauge": the metrics gauge flipped before the log's line came; time is the sample's

    def replaces(self, other: Switch) -> bool:
        """This log line is of the flip `other` marked from the gauge (same way, sampled after the line)."""
        return (self.source == "log" and other.source == "gauge" and self.enabled == other.enabled
                and other.time >= self.time)


@dataclass(frozen=True)
class GpuHolder:
    """A process holding memory on a GPU, as nvitop lists it."""

    gpu: int | None  # the GPU's index; None when nvidia-smi named a GPU the GPU rows do not show
    pid: int
    user: str | None
    used_mib: float | None
    command: str | None


@dataclass(frozen=True)
class HostSnapshot:
    host: str
    time: float  # the host's clock for a live sample, this machine's when disconnected
    connected: bool = True
    disconnected_since: float | None = None
    error: str | None = None
    retry_at: float | None = None
    simulated: bool = False
    seq: int | None = None
    state: str = "unknown"
    pid: int | None = None
    uptime_s: float | None = None
    sglang_version: str | None = None
    strategy: str | None = None  # patch | native | None (unknown / not deployed)
    release: str | None = None
    operation: str | None = None  # "deploy by alice since ..." while the host lock is held
    threshold: int | None = None  # as the server reports it (read back), never from a record
    release_threshold: int | None = None  # what the release in force recorded: the release's, not the live one
    running_reqs: int | None = None  # the batch size
    idle: bool = False  # the scheduler says nothing runs or waits (live, from /v1/loads)
    queue_reqs: int | None = None
    token_usage: float | None = None
    used_tokens: int | None = None
    max_total_tokens: int | None = None
    gen_throughput: float | None = None
    accept_length: float | None = None
    spec_configured: bool | None = None  # a speculative algorithm is configured at all
    speculation: bool | None = None  # on / off right now; None when unknown
    last_switch: Switch | None = None
    disabled_steps: float | None = None
    gpus: tuple[GpuStat, ...] = ()
    gpu_error: str | None = None
    gpu_processes: tuple[GpuHolder, ...] = ()  # the last list read; its age is readings["gpu_processes"]
    log_lines: tuple[str, ...] = ()
    log_replace: bool = False  # a new stream: these lines replace the tail instead of extending it
    log_restarted: bool = False  # the log file was truncated or replaced (a new server run)
    switches: tuple[Switch, ...] = ()  # switches first seen in this sample
    metrics_error: str | None = None
    spec_warning: str | None = None  # the patch says the threshold cannot act (not armed / never fires)
    sample_ms: float | None = None
    utc_offset: float | None = None
    # what is on the port or looks like the server but is not ours: named, never claimed (agent's words)
    not_ours: str | None = None
    leftovers: tuple[int, ...] = ()  # live processes of our previous server (`dynctl stop` sweeps them)
    # carried from sample to sample, not shown as such
    server_info: dict[str, Any] = field(default_factory=dict, repr=False)
    drain_pid: int | None = None
    process_started: float | None = None
    readings: dict[str, Reading] = field(default_factory=dict)  # source and age of each live number
    counter_window: tuple[tuple[float, float], ...] = field(default=(), repr=False)  # (t, generation tokens)
    last_decode_time: float | None = field(default=None, repr=False)  # of the newest decode line seen
    info_time: float | None = field(default=None, repr=False)  # when /server_info last answered
    gpu_processes_time: float | None = field(default=None, repr=False)  # when that list was read


def latest_switch(switches: list[Switch] | tuple[Switch, ...]) -> Switch | None:
    """The newest switch; of several in the same second (log stamps have 1 s resolution), the last logged."""
    best = None
    for s in switches:
        if best is None or s.time >= best.time:
            best = s
    return best


def _answering(part: dict[str, Any] | None) -> bool:
    """The server answered HTTP, even if with an error status (e.g. /metrics without --enable-metrics)."""
    if not part:
        return False
    return bool(part.get("ok")) or str(part.get("error", "")).startswith("HTTP ")


def _server_state(alive: bool, answering: bool, draining: bool, prev: HostSnapshot | None, same_run: bool) -> str:
    if not alive:  # whatever answers on the port is not our server (the agent names it in not_ours)
        return "down"
    if draining:
        return "draining"
    if answering:
        return "ready"
    if prev is not None and same_run and prev.state in ("ready", "unresponsive"):
        return "unresponsive"
    return "starting"


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _float_or_none(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def build_snapshot(item: dict[str, Any], host: str, prev: HostSnapshot | None = None,
                   simulated: bool = False) -> HostSnapshot:
    """The snapshot for one `watch` item; `prev` is the previous live snapshot of the same host."""
    t = float(item["t"])
    offset = item.get("utc_offset")
    proc = item.get("process") or {}
    pid, alive, started = proc.get("pid"), bool(proc.get("alive")), proc.get("started")
    same_run = prev is not None and prev.pid == pid and pid is not None
    run_prev = prev if same_run else None  # what a sample does not repeat holds only within one server run

    metrics_part = item.get("metrics") or {}
    metrics, metrics_error = _read_metrics(metrics_part)
    info_part = item.get("server_info")
    info, info_time = _read_info(info_part, t, run_prev)
    info_age = None if info_time is None else max(0.0, t - info_time)
    state_info = info.get("internal_state") or {}

    log = item.get("log") or {}
    decode = parse_decode_line(log["decode"], offset) if log.get("decode") else None
    switches, drain_pid, spec_warning = _read_marks(
        log.get("marks") or (), t, offset, pid, started,
        prev.drain_pid if prev is not None else None, run_prev.spec_warning if run_prev else None)

    answering = _answering(metrics_part) or _answering(info_part)
    draining = (drain_pid == pid and pid is not None) or bool(proc.get("stopping"))  # log mark, or dynctl's stop
    state = _server_state(alive, answering, draining, prev, same_run)
    up = state != "down"

    algorithm = info.get("speculative_algorithm") if info else None
    spec_configured = (algorithm not in (None, "", "NONE")) if info else (run_prev.spec_configured if run_prev else None)
    release = item.get("release") or {}
    strategy = _first(release.get("strategy"),
                      "patch" if metrics.spec_enabled is not None or metrics.spec_threshold is not None else None,
                      "native" if info.get("speculative_adaptive") else None,
                      prev.strategy if prev is not None else None)

    newest = latest_switch(switches)
    if (newest is not None and metrics.spec_enabled is not None and not log.get("skipped_bytes")
            and newest.enabled != metrics.spec_enabled):
        # the agent reads /metrics before the log: a line of a flip that came in between is the newer word
        metrics = replace(metrics, spec_enabled=None)
    live = _live_loads(item.get("loads"))
    idle = up and live[0] == 0 and live[1] == 0
    speculation = _speculation(metrics, switches, spec_configured, strategy, run_prev) if up else None
    logged = bool(switches)  # before a flip seen in a gauge only joins them
    last_switch = _last_switch(switches, speculation, t, idle, run_prev)

    last_decode = _first(decode.time if decode else None, run_prev.last_decode_time if run_prev else None)
    gauge_age = None if last_decode is None else max(0.0, t - last_decode)
    window = _counter_window(run_prev.counter_window if run_prev else (), t, metrics.generation_tokens) if up else ()
    rate = _rate(window)
    readings = _readings(metrics, live, decode, logged, rate, gauge_age, info_age, state_info) if up else {}
    gpus, gpu_error = _read_gpus(item.get("gpus") or {})
    gpu_part = item.get("gpus") or {}
    if gpus:  # the looping nvidia-smi's last full block carries its time; a one-shot query is this sample's
        read_at = _first(_float_or_none(gpu_part.get("t")), t)
        readings["gpus"] = Reading("nvidia-smi", max(0.0, t - read_at))
    holders = _read_holders(item.get("gpu_procs"), gpus)
    if holders is not None:
        holders_time = _first(_float_or_none((item.get("gpu_procs") or {}).get("t")), t)
    else:  # the list is the host's, not one server run's: kept, and ageing, until a new one comes
        holders = prev.gpu_processes if prev is not None else ()
        holders_time = prev.gpu_processes_time if prev is not None else None
    if holders_time is not None:
        readings["gpu_processes"] = Reading("nvidia-smi", max(0.0, t - holders_time))

    threshold = None
    if up:
        threshold, readings["threshold"] = _read_threshold(metrics, info, state_info, info_age, gauge_age, t,
                                                           run_prev)
    release_threshold = _first(_int_or_none(release.get("effective_threshold")), _int_or_none(release.get("threshold")))
    if idle and strategy == "patch" and threshold is not None and spec_configured and not spec_warning:
        # Nothing runs, so no step decides; the gauge keeps the last decision (say, OFF after a burst that
        # was aborted at once). What matters now is what the next request gets: a batch of one.
        speculation = threshold < 0 or threshold >= 1
        # the value is the threshold's verdict on a batch of one, not a gauge read back
        readings["speculation"] = Reading("threshold", readings["threshold"].age_s)
    return HostSnapshot(
        host=host,
        time=t,
        simulated=simulated,
        seq=item.get("seq"),
        state=state,
        pid=pid if alive else None,
        uptime_s=(t - started) if alive and started else None,
        sglang_version=_first(info.get("version"), release.get("sglang_version"),
                              prev.sglang_version if prev is not None else None),
        strategy=strategy,
        release=release.get("id") or proc.get("release"),
        operation=_operation(item.get("lock") or None),
        threshold=threshold,
        release_threshold=release_threshold,
        idle=idle,
        **(_server_numbers(metrics, live, decode, rate, state_info, spec_configured) if up else {}),
        spec_configured=spec_configured,
        speculation=speculation,
        last_switch=last_switch,
        gpus=gpus,
        gpu_error=gpu_error,
        gpu_processes=holders,
        log_lines=tuple(log.get("lines") or ()),
        log_replace=item.get("seq") == 0,
        log_restarted=bool(log.get("reset")),
        switches=tuple(sorted(switches, key=lambda s: s.time)),
        metrics_error=metrics_error if up else None,
        spec_warning=spec_warning if up else None,
        sample_ms=item.get("sample_ms"),
        utc_offset=offset,
        not_ours=(proc.get("not_ours") or {}).get("text"),
        leftovers=tuple(proc.get("leftovers") or ()),
        server_info=info,
        drain_pid=drain_pid,
        process_started=started,
        readings=readings,
        counter_window=window,
        last_decode_time=last_decode,
        info_time=info_time,
        gpu_processes_time=holders_time,
    )


def _server_numbers(metrics: ServerMetrics, live: tuple[int | None, int | None, float | None],
                    decode: DecodeLine | None, rate: float | None, state_info: dict[str, Any],
                    spec_configured: bool | None) -> dict[str, Any]:
    """The live numbers of a running server, each from the most direct source that has it."""
    return dict(
        running_reqs=_first(live[0], metrics.running_reqs, decode.running_reqs if decode else None),
        queue_reqs=_first(live[1], metrics.queue_reqs, decode.queue_reqs if decode else None),
        token_usage=_first(live[2], metrics.token_usage, decode.token_usage if decode else None),
        used_tokens=_first(metrics.used_tokens, decode.tokens if decode else None),
        max_total_tokens=metrics.max_total_tokens,
        gen_throughput=_first(rate, metrics.gen_throughput, decode.gen_throughput if decode else None),
        accept_length=_first(metrics.accept_length, decode.accept_length if decode else None,
                             state_info.get("avg_spec_accept_length")) if spec_configured is not False else None,
        disabled_steps=metrics.spec_disabled_steps,
    )


def _read_metrics(part: dict[str, Any]) -> tuple[ServerMetrics, str | None]:
    if not part.get("ok"):
        return ServerMetrics(), part.get("error")
    try:
        return read_server_metrics(part.get("text", "")), None
    except MetricsFormatError as err:
        return ServerMetrics(), str(err)


def _read_info(part: dict[str, Any] | None, t: float,
               run_prev: HostSnapshot | None) -> tuple[dict[str, Any], float | None]:
    """/server_info and when it answered."""
    if part is not None and part.get("ok"):
        return part.get("data") or {}, t
    # not sampled this time, or slow to answer: the last one of the same server run still holds
    return (run_prev.server_info, run_prev.info_time) if run_prev is not None else ({}, None)


def _last_switch(switches: list[Switch], speculation: bool | None, t: float, idle: bool,
                 run_prev: HostSnapshot | None) -> Switch | None:
    """The newest switch of this server run; one seen in the gauge only is added to `switches`."""
    if (not switches and speculation is not None and run_prev is not None and not run_prev.idle
            and not idle and run_prev.speculation is not None and run_prev.speculation != speculation):
        # seen in the gauge only: the sample time is the best we know
        switches.append(Switch(t, speculation, source="gauge"))
    shown = run_prev.last_switch if run_prev is not None else None
    last = latest_switch(switches) if switches else shown
    if last is not None and shown is not None and shown.time > last.time and not last.replaces(shown):
        return shown
    return last  # the log's line of a flip the gauge showed first brings its own time, batch and threshold


def _readings(metrics: ServerMetrics, live: tuple[int | None, int | None, float | None], decode: DecodeLine | None,
              switched: bool, rate: float | None, gauge_age: float | None, info_age: float | None,
              state_info: dict[str, Any]) -> dict[str, Reading]:
    """Where each live number of a running server came from, and how old it is."""
    readings: dict[str, Reading] = {}
    for name, loads_value, gauge_value in (("running_reqs", live[0], metrics.running_reqs),
                                           ("queue_reqs", live[1], metrics.queue_reqs)):
        readings[name] = (Reading("/v1/loads", 0.0) if loads_value is not None else
                          Reading("metrics", gauge_age) if gauge_value is not None else Reading("log", gauge_age))
    readings["gen_throughput"] = (Reading("counter", 0.0) if rate is not None else
                                  Reading("metrics", gauge_age) if metrics.gen_throughput is not None
                                  else Reading("log", gauge_age))
    readings["token_usage"] = (Reading("/v1/loads", 0.0) if live[2] is not None else
                               Reading("metrics", gauge_age) if metrics.token_usage is not None
                               else Reading("log", gauge_age))
    readings["accept_length"] = (Reading("metrics", gauge_age) if metrics.accept_length is not None else
                                 Reading("log", gauge_age) if decode is not None and decode.accept_length
                                 is not None else Reading("/server_info", info_age))
    # the patch's gauge changes at every decode step that flips it, so it is as fresh as the sample
    readings["speculation"] = (Reading("metrics", 0.0) if metrics.spec_enabled is not None else
                               Reading("log", 0.0) if switched else Reading("inferred", None))
    return readings


def _read_threshold(metrics: ServerMetrics, info: dict[str, Any], state_info: dict[str, Any],
                    info_age: float | None, gauge_age: float | None, t: float,
                    run_prev: HostSnapshot | None) -> tuple[int | None, Reading]:
    """The threshold a running server reports, and where it came from. The scheduler's own read-back first:
    the patch writes its gauge only on a decode step (the gauge is as old as the last one), so after a live
    change on an idle server the gauge still shows the old value while /server_info has the new. Only what
    the server says: a hand-started or restarted server need not run the release's threshold. When nothing
    in this sample gives it, the last sample's value keeps its source, older by now."""
    for value, reading in ((_int_or_none(state_info.get(sglang.THRESHOLD_KEY)), Reading("/server_info", info_age)),
                           (metrics.spec_threshold, Reading("metrics", gauge_age)),
                           (_int_or_none(info.get(sglang.THRESHOLD_KEY)), Reading("/server_info", info_age)),
                           (_int_or_none(info.get("adaptive_threshold")), Reading("/server_info", info_age))):
        if value is not None:
            return value, reading
    if run_prev is None:
        return None, Reading("/server_info", info_age)
    kept = run_prev.readings.get("threshold")
    if run_prev.threshold is not None and kept is not None:
        return run_prev.threshold, Reading(kept.source, None if kept.age_s is None else kept.age_s + t - run_prev.time)
    return run_prev.threshold, Reading("/server_info", info_age)


def _operation(lock: dict[str, Any] | None) -> str | None:
    """"deploy by alice since ..." while the host lock is held."""
    if not lock:
        return None
    return f"{lock.get('operation') or 'operation'} by {lock.get('who') or '?'} since {lock.get('started') or '?'}"


def _counter_window(window: tuple[tuple[float, float], ...], t: float,
                    value: float | None) -> tuple[tuple[float, float], ...]:
    """The (time, counter) readings of the last RATE_WINDOW_S, this one added; a reset (restart) starts anew."""
    if value is None:
        return ()
    kept = [(when, v) for when, v in window if t - when <= RATE_WINDOW_S and v <= value and when < t]
    return (*kept, (t, value))


def _rate(window: tuple[tuple[float, float], ...]) -> float | None:
    """Tokens per second over the window, or None while it spans less than MIN_RATE_SPAN_S."""
    if len(window) < 2 or window[-1][0] - window[0][0] < MIN_RATE_SPAN_S:
        return None
    return (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])


def _read_marks(marks: Any, t: float, offset: float | None, pid: int | None, started: float | None,
                drain_pid: int | None, spec_warning: str | None) -> tuple[list[Switch], int | None, str | None]:
    """Switches, the pid seen draining, and the threshold warning, from the log lines the agent kept."""
    def this_run(when: float | None) -> bool:  # not a line of an earlier server run still in the log
        return when is None or started is None or when >= started - 2

    switches: list[Switch] = []
    for mark in marks:
        tr = parse_transition_line(mark, offset)
        warning = None if tr is not None else parse_threshold_warning(mark, offset)
        if tr is not None:
            switches.append(Switch(_first(tr.time, t), tr.enabled, tr.batch_size, tr.threshold))
        elif warning is not None and this_run(warning[0]):
            spec_warning = warning[1]
        elif _DRAIN_MARK in mark and pid is not None and this_run(split_log_prefix(mark, offset).time):
            drain_pid = pid
    return switches, drain_pid, spec_warning


def _read_holders(part: dict[str, Any] | None, gpus: tuple[GpuStat, ...]) -> tuple[GpuHolder, ...] | None:
    """The processes on the GPUs, by GPU index and memory; None when this sample carries no list."""
    if not part or not part.get("ok"):
        return None
    try:
        procs = parse_compute_apps_csv(part.get("csv", ""))
    except MetricsFormatError:
        return None
    index = {g.uuid: g.index for g in gpus if g.uuid}
    owners = part.get("owners") or {}
    out = [GpuHolder(index.get(p.gpu_uuid) if p.gpu_uuid else None, p.pid, (owners.get(str(p.pid)) or {}).get("user"), p.used_mib,
                     (owners.get(str(p.pid)) or {}).get("command") or p.process_name) for p in procs]
    return tuple(sorted(out, key=lambda h: (h.gpu if h.gpu is not None else 1 << 30, -(h.used_mib or 0), h.pid)))


def _read_gpus(part: dict[str, Any]) -> tuple[tuple[GpuStat, ...], str | None]:
    if part.get("ok"):
        try:
            return tuple(parse_gpu_csv(part.get("csv", ""))), None
        except MetricsFormatError as err:
            return (), str(err)
    return (), part.get("error") if part else None


def _live_loads(part: dict[str, Any] | None) -> tuple[int | None, int | None, float | None]:
    """(running, waiting, token usage) summed / averaged over DP ranks from /v1/loads, or Nones."""
    loads = (part or {}).get("loads") if (part or {}).get("ok") else None
    if not loads:
        return None, None, None
    try:
        running = sum(int(d.get("num_running_reqs") or 0) for d in loads)
        waiting = sum(int(d.get("num_waiting_reqs") or 0) for d in loads)
        usages = [float(d["token_usage"]) for d in loads if d.get("token_usage") is not None]
    except (TypeError, ValueError):
        return None, None, None
    return running, waiting, (sum(usages) / len(usages) if usages else None)


def _speculation(m: ServerMetrics, switches: list[Switch], configured: bool | None, strategy: str | None,
                 prev: HostSnapshot | None) -> bool | None:
    """On or off, from the most direct evidence there is: the patch's gauge, its log line, native steps."""
    if configured is False:
        return False
    if m.spec_enabled is not None:
        return m.spec_enabled
    if switches:
        return latest_switch(switches).enabled  # type: ignore[union-attr]
    if m.spec_num_steps is not None and strategy == "native":
        return m.spec_num_steps > 0
    if prev is not None and prev.speculation is not None:
        return prev.speculation
    if configured and strategy is None:  # a pristine server with speculation: always on
        return True
    return None


def disconnected(host: str, now: float, error: str, prev: HostSnapshot | None, retry_at: float | None = None,
                 simulated: bool = False) -> HostSnapshot:
    """The snapshot of a host we cannot hear: the last known values, marked stale."""
    base = prev if prev is not None else HostSnapshot(host=host, time=now, simulated=simulated)
    since = prev.disconnected_since if prev is not None and not prev.connected else now
    # the numbers are the last sample's: each is older by the time since
    readings = {name: r if r.age_s is None else replace(r, age_s=r.age_s + max(0.0, now - base.time))
                for name, r in base.readings.items()}
    return replace(base, time=now, connected=False, disconnected_since=since, error=error, retry_at=retry_at,
                   log_lines=(), log_replace=False, log_restarted=False, switches=(), readings=readings)


@dataclass(frozen=True)
class Point:
    time: float
    gen_throughput: float | None
    running_reqs: int | None
    threshold: int | None
    speculation: bool | None


class HostHistory:
    """The last `window_s` seconds of one host: chart points, switch moments and the log tail. Thread-safe."""

    def __init__(self, host: str, window_s: float = 600.0, log_lines: int = 500) -> None:
        self.host = host
        self.window_s = window_s
        self._lock = threading.Lock()
        self._points: deque[Point] = deque()
        self._switches: deque[Switch] = deque()
        self._log: deque[str] = deque(maxlen=log_lines)
        self._log_total = 0  # lines ever appended: readers ask for what came after their count
        self._log_epoch = 0  # bumped when the tail is replaced, so readers start over
        self._latest: HostSnapshot | None = None
        self._last_live: HostSnapshot | None = None

    def add(self, snap: HostSnapshot) -> None:
        with self._lock:
            self._latest = snap
            if not snap.connected:
                return
            self._last_live = snap
            self._points.append(Point(snap.time, snap.gen_throughput, snap.running_reqs, snap.threshold, snap.speculation))
            known = {(s.time, s.enabled) for s in self._switches}
            for s in snap.switches:
                if (s.time, s.enabled) not in known:  # a new stream re-reads the log's recent marks
                    newest = max(self._switches, key=lambda m: m.time, default=None)
                    if newest is not None and s.replaces(newest):
                        self._switches.remove(newest)
                    self._switches.append(s)
            if snap.switches:
                self._switches = deque(sorted(self._switches, key=lambda s: s.time))
            if snap.log_replace:
                self._log.clear()
                self._log_epoch += 1
            elif snap.log_restarted:
                self._log.append(LOG_RESTARTED)
                self._log_total += 1
            self._log.extend(snap.log_lines)
            self._log_total += len(snap.log_lines)
            horizon = snap.time - self.window_s
            while self._points and self._points[0].time < horizon:
                self._points.popleft()
            while self._switches and self._switches[0].time < horizon:
                self._switches.popleft()

    @property
    def latest(self) -> HostSnapshot | None:
        return self._latest

    @property
    def last_live(self) -> HostSnapshot | None:
        """The newest snapshot that came from the host (the base of the next one)."""
        return self._last_live

    def points(self) -> list[Point]:
        with self._lock:
            return list(self._points)

    def switches(self) -> list[Switch]:
        with self._lock:
            return list(self._switches)

    def log_tail(self, n: int | None = None) -> list[str]:
        with self._lock:
            lines = list(self._log)
        return lines if n is None else lines[-n:]

    def log_since(self, mark: tuple[int, int] | None) -> tuple[list[str], tuple[int, int], bool]:
        """Lines appended after `mark` (from an earlier call), the new mark, and whether the reader must
        start over (first call, replaced tail, or more lines than the tail keeps)."""
        with self._lock:
            now = (self._log_epoch, self._log_total)
            if mark is None or mark[0] != self._log_epoch or self._log_total - mark[1] > len(self._log):
                return list(self._log), now, True
            new = self._log_total - mark[1]
            return (list(self._log)[-new:] if new else []), now, False
