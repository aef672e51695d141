"""Parsers for what an SGLang host tells us: Prometheus text, the scheduler's log lines, nvidia-smi CSV.

UI-free and I/O-free: `dynctl status`, the TUI feed and bench all read the same values the same way.
"""

from __future__ import annotations

import calendar
import csv
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from dynctl import sglang


class MetricsFormatError(ValueError):
    """Text that is not what the named source emits; the message says where."""


# --------------------------------------------------------------------------- Prometheus

# Label names that tell scheduler replicas apart. sglang 0.5.9 emits scheduler metrics only from
# attn_tp_rank 0 (scheduler_metrics_mixin.py:100-102) unless enable_metrics_for_all_schedulers is
# set, in which case every TP rank repeats the same batch: keep the lowest rank of each, never sum them.
_RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")


# A server's /metrics repeats the same series every sample, only the values move; reading a series' name and
# labels is most of prometheus_client's cost, so each "name{labels}" is read once and kept.
_SERIES: dict[str, tuple[str, dict[str, str]]] = {}
_SERIES_CAP = 8192


def _series(key: str) -> tuple[str, dict[str, str]] | None:
    found = _SERIES.get(key)
    if found is None:
        try:
            samples = [s for f in text_string_to_metric_families(key + " 0\n") for s in f.samples]
        except ValueError:
            return None
        if len(samples) != 1:
            return None
        if len(_SERIES) >= _SERIES_CAP:
            _SERIES.clear()
        found = _SERIES[key] = (samples[0].name, samples[0].labels)
    return found


def _sample_value(text: str) -> float | None:
    """A sample's value as prometheus_client reads it (an int where it is one); None when it is not a number."""
    if "_" in text:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


def parse_prometheus(text: str) -> dict[str, list[Sample]]:
    """Samples by sample name (`sglang:num_running_reqs`, `sglang:realtime_tokens_total`, ...)."""
    out: dict[str, list[Sample]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        close = line.rfind("}")
        key, rest = (line[:close + 1], line[close + 1:].split()) if close >= 0 else (line.split()[0], line.split()[1:])
        series = _series(key) if len(rest) == 1 else None  # a timestamp, or text this reading does not know
        value = _sample_value(rest[0]) if series is not None else None
        if series is None or value is None:
            return _parse_whole(text)
        out.setdefault(series[0], []).append(Sample(series[0], dict(series[1]), value))
    return out


def _parse_whole(text: str) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append(sample)
    except ValueError as err:
        raise MetricsFormatError(f"/metrics: not Prometheus text format ({err})") from None
    return out


def _rank(sample: Sample, label: str) -> int:
    try:
        return int(sample.labels.get(label, 0))
    except ValueError:
        return 0


def pick_samples(samples: Iterable[Sample], **match: str) -> list[Sample]:
    """Samples whose labels match `match`, one per data-parallel rank: the lowest TP/PP/EP rank of each."""
    chosen = [s for s in samples if all(s.labels.get(k) == v for k, v in match.items())]
    for label in _RANK_LABELS:
        by_dp: dict[str | None, int] = {}
        for s in chosen:
            dp = s.labels.get("dp_rank")
            by_dp[dp] = min(by_dp.get(dp, _rank(s, label)), _rank(s, label))
        chosen = [s for s in chosen if _rank(s, label) == by_dp[s.labels.get("dp_rank")]]
    return chosen


def combine(samples: Sequence[Sample], how: str) -> float | None:
    """Across DP ranks: `sum` for counts (requests, tokens, tok/s), `mean` for ratios, `max` for flags."""
    if not samples:
        return None
    values = [s.value for s in samples]
    if how == "sum":
        return float(sum(values))
    if how == "mean":
        return float(sum(values) / len(values))
    if how == "max":
        return float(max(values))
    raise ValueError(f"unknown combine mode {how!r}")


@dataclass(frozen=True)
class ServerMetrics:
    """The values dynctl shows, read from one /metrics scrape; None where the server did not say."""

    running_reqs: int | None = None
    queue_reqs: int | None = None
    used_tokens: int | None = None
    token_usage: float | None = None  # KV cache, 0..1
    max_total_tokens: int | None = None
    gen_throughput: float | None = None  # tok/s over the last decode log interval
    accept_length: float | None = None
    accept_rate: float | None = None
    spec_enabled: bool | None = None  # the patch's gauge (SPEC §4)
    spec_threshold: int | None = None  # the patch's gauge
    spec_disabled_steps: float | None = None  # the patch's counter
    spec_num_steps: float | None = None  # native adaptive speculation (sglang >= 0.5.14): 0 = off
    generation_tokens: float | None = None  # counter
    decode_tokens: float | None = None  # counter realtime_tokens_total{mode="decode"}


# (field, sample name, combine, label match); counters are named with their `_total` sample.
_FIELDS: tuple[tuple[str, str, str, dict[str, str]], ...] = (
    ("running_reqs", "sglang:num_running_reqs", "sum", {}),
    ("queue_reqs", "sglang:num_queue_reqs", "sum", {}),
    ("used_tokens", "sglang:num_used_tokens", "sum", {}),
    ("token_usage", "sglang:token_usage", "mean", {}),
    ("max_total_tokens", "sglang:max_total_num_tokens", "sum", {}),
    ("gen_throughput", "sglang:gen_throughput", "sum", {}),
    ("accept_length", "sglang:spec_accept_length", "mean", {}),
    ("accept_rate", "sglang:spec_accept_rate", "mean", {}),
    ("spec_enabled", "sglang:spec_enabled", "max", {}),
    ("spec_threshold", "sglang:spec_disable_threshold", "max", {}),
    ("spec_disabled_steps", "sglang:spec_disabled_steps_total", "sum", {}),
    ("spec_num_steps", "sglang:spec_num_steps", "mean", {}),
    ("generation_tokens", "sglang:generation_tokens_total", "sum", {}),
    ("decode_tokens", "sglang:realtime_tokens_total", "sum", {"mode": "decode"}),
)
_INT_FIELDS = {"running_reqs", "queue_reqs", "used_tokens", "max_total_tokens", "spec_threshold"}


def read_server_metrics(text: str) -> ServerMetrics:
    """ServerMetrics from the Prometheus text of sglang's /metrics."""
    by_name = parse_prometheus(text)
    values: dict[str, Any] = {}
    for field, name, how, match in _FIELDS:
        value = combine(pick_samples(by_name.get(name, ()), **match), how)
        if value is None or value != value:  # NaN: prometheus_client's "no value yet"
            continue
        if field in _INT_FIELDS:
            values[field] = int(round(value))
        elif field == "spec_enabled":
            values[field] = value >= 0.5
        else:
            values[field] = value
    return ServerMetrics(**values)


# --------------------------------------------------------------------------- sglang log lines

# The prefixes sglang's loggers have put on a line since 0.4, each read the same way (time, ranks, message):
# - `[%(asctime)s{.msecs}{ DPi}{ TPj}{ PPk}] `, datefmt "%Y-%m-%d %H:%M:%S" (sglang 0.5.9 utils/common.py:1216-1232
#   configure_logger; rank parts from managers/scheduler.py:3081-3096); sglang's own parser (0.5.14
#   debug_utils/log_parser.py `_PATTERN_DECODE`) reads the same prefix;
# - the same with a time of day only (`[%H:%M:%S TP0] `, older releases and a `--log-config` of that kind);
# - the logging-module form, `2026-03-18 11:22:05.874 INFO 120984 [ TP0 scheduler_metrics_mixin.py:415] `;
# - a Ray actor's `(Worker pid=N, ip=A) ` in front of any of them.
_RAY = r"(?:\(\w+ pid=\d+(?:,\s*ip=[\d.]+)?\)\s*)?"
_RANKS = r"(?P<ranks>(?:\s*[A-Z_]+\d+)*)"
_PREFIX = re.compile(
    "^" + _RAY + r"(?:"
    r"\[(?P<time>(?:\d{4}-\d{2}-\d{2} )?\d{2}:\d{2}:\d{2})(?:[.,](?P<ms>\d{3}))?" + _RANKS + r"\]\s?"
    r"|(?P<ltime>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?:[.,](?P<lms>\d{3}))?\s+[A-Z]+\s+(?:\d+\s+)?"
    r"\[(?P<lranks>(?:\s*[A-Z_]+\d+)*)\s*[\w.]+:\d+\]\s?"
    r")"
)
_RANK = re.compile(r"([A-Z_]+?)(\d+)")

# "Decode batch[ [iter]], #running-req: 64, #token: 81234, token usage: 0.12, accept len: 2.71, ..."
# built in sglang 0.5.9 managers/scheduler_metrics_mixin.py:304-415 (log_decode_stats); the
# fields in the middle vary (hybrid SWA/mamba, PD decode), so read it as `key: value` pairs.
# The period form "Decode batch. #running-req: ..." of older releases reads like the comma form.
_DECODE = re.compile(r"Decode batch(?: \[(?P<iter>\d+)\])?[.,] (?P<body>.*)$")
_PAIR = re.compile(r"(?:^|, )(?P<key>[^:,]+): (?P<value>[^,]*)")

# The threshold patch's transition line (SPEC §4; patches/spec_batch_threshold.py `decide`):
# "Speculation disabled: batch size 7 > threshold 5" / "Speculation enabled: batch size 5 <= threshold 5"
# / "Speculation enabled: batch size 9, threshold off" (after a live change to -1).
_TRANSITION = re.compile(
    r"Speculation (?P<state>enabled|disabled): batch size (?P<batch>\d+)"
    r"(?: (?P<op>>|<=) threshold (?P<threshold>-?\d+)|, threshold off)"
)
# Its startup warnings when the threshold cannot act (check_threshold_args).
_NOT_ARMED = re.compile(sglang.THRESHOLD_KEY + r"=(?P<threshold>-?\d+) (?P<what>is not armed|never fires): (?P<reason>.*)")


@dataclass(frozen=True)
class LogPrefix:
    time: float | None  # epoch seconds, None when the line carries no sglang prefix
    ranks: dict[str, int]
    message: str


def parse_log_time(stamp: str, utc_offset: float | None = None) -> float:
    """Epoch seconds of an sglang log stamp `YYYY-mm-dd HH:MM:SS[.mmm]`, written in a zone `utc_offset` s east of UTC.

    Without an offset the stamp is read in this machine's zone. The host agent reports its offset,
    since a remote host's zone need not be ours.
    """
    whole, _, frac = stamp.partition(".")
    parts = time.strptime(whole, "%Y-%m-%d %H:%M:%S")
    if utc_offset is None:
        base = time.mktime(parts)
    else:
        base = calendar.timegm(parts) - utc_offset
    return base + (int(frac) / 1000.0 if frac else 0.0)


def split_log_prefix(line: str, utc_offset: float | None = None, now: float | None = None) -> LogPrefix:
    """The time, ranks and message of an sglang log line; a line without a prefix sglang writes is all message.

    A time of day alone is dated to the last such moment at or before `now` (default: this moment).
    """
    m = _PREFIX.match(line)
    if not m:
        return LogPrefix(None, {}, line.rstrip("\n"))
    stamp, ms = (m.group("time"), m.group("ms")) if m.group("time") else (m.group("ltime"), m.group("lms"))
    ranks_text = m.group("ranks") if m.group("time") else m.group("lranks")
    ranks = {name: int(num) for name, num in _RANK.findall(ranks_text or "")}
    if len(stamp) == 8:  # HH:MM:SS
        stamp = _date_of(stamp, utc_offset, time.time() if now is None else now) + " " + stamp
    when = parse_log_time(stamp + (f".{ms}" if ms else ""), utc_offset)
    return LogPrefix(when, ranks, line[m.end():].rstrip("\n"))


def _date_of(clock: str, utc_offset: float | None, now: float) -> str:
    """The date of the latest `clock` (HH:MM:SS) at or before `now`, in the log's zone."""
    shift = (lambda t: time.gmtime(t + utc_offset)) if utc_offset is not None else time.localtime
    today = time.strftime("%Y-%m-%d", shift(now))
    if parse_log_time(f"{today} {clock}", utc_offset) <= now + 1:
        return today
    return time.strftime("%Y-%m-%d", shift(now - 86400))


@dataclass(frozen=True)
class DecodeLine:
    time: float | None
    tp_rank: int | None
    dp_rank: int | None
    pp_rank: int | None
    running_reqs: int | None
    tokens: int | None
    token_usage: float | None
    accept_length: float | None
    accept_rate: float | None
    cuda_graph: bool | None
    gen_throughput: float | None
    queue_reqs: int | None
    fields: dict[str, str]


def _num(value: str | None, kind: type) -> Any:
    if value is None:
        return None
    try:
        return kind(value.strip())
    except ValueError:
        return None


def parse_decode_line(line: str, utc_offset: float | None = None) -> DecodeLine | None:
    """The scheduler's periodic "Decode batch" line, or None for any other line."""
    prefix = split_log_prefix(line, utc_offset)
    m = _DECODE.search(prefix.message)
    if not m:
        return None
    fields = {p.group("key").strip(): p.group("value").strip() for p in _PAIR.finditer(m.group("body"))}
    graph = next((v for k, v in fields.items() if k.endswith(" graph")), None)
    # hybrid SWA/mamba models report "full token usage" instead of "token usage"
    usage = fields.get("token usage", fields.get("full token usage"))
    return DecodeLine(
        time=prefix.time,
        tp_rank=prefix.ranks.get("TP"),
        dp_rank=prefix.ranks.get("DP"),
        pp_rank=prefix.ranks.get("PP"),
        running_reqs=_num(fields.get("#running-req"), int),
        tokens=_num(fields.get("#token", fields.get("#full token")), int),
        token_usage=_num(usage, float),
        accept_length=_num(fields.get("accept len"), float),
        accept_rate=_num(fields.get("accept rate"), float),
        cuda_graph=None if graph is None else graph == "True",
        gen_throughput=_num(fields.get("gen throughput (token/s)"), float),
        queue_reqs=_num(fields.get("#queue-req"), int),
        fields=fields,
    )


@dataclass(frozen=True)
class Transition:
    time: float | None
    enabled: bool
    batch_size: int
    threshold: int | None  # None: "threshold off"


def parse_transition_line(line: str, utc_offset: float | None = None) -> Transition | None:
    """The patch's "Speculation enabled/disabled: batch size B <op> threshold N" line, or None."""
    prefix = split_log_prefix(line, utc_offset)
    m = _TRANSITION.search(prefix.message)
    if not m:
        return None
    threshold = m.group("threshold")
    return Transition(prefix.time, m.group("state") == "enabled", int(m.group("batch")),
                      None if threshold is None else int(threshold))


def parse_threshold_warning(line: str, utc_offset: float | None = None) -> tuple[float | None, str] | None:
    """(time, "threshold 5 is not armed: <reason>") from the patch's startup warning, or None."""
    prefix = split_log_prefix(line, utc_offset)
    m = _NOT_ARMED.search(prefix.message)
    if not m:
        return None
    reason = m.group("reason").split(". Speculation is never disabled")[0].rstrip(".")
    return prefix.time, f"threshold {m.group('threshold')} {m.group('what')}: {reason}"


# --------------------------------------------------------------------------- nvidia-smi

GPU_QUERY = sglang.GPU_QUERY
APPS_QUERY = sglang.APPS_QUERY


# What nvidia-smi prints in place of a value it cannot give (driver-dependent spellings).
_NOT_A_VALUE = {"[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]", "[insufficient permissions]",
                "[gpu is lost]", "[gpu requires reset]", ""}


@dataclass(frozen=True)
class GpuStat:
    index: int
    uuid: str | None
    name: str | None
    util_pct: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None


def _value(raw: str) -> str | None:
    raw = raw.strip()
    return None if raw.lower() in _NOT_A_VALUE else raw


@dataclass(frozen=True)
class GpuProcess:
    gpu_uuid: str | None
    pid: int
    process_name: str | None
    used_mib: float | None


def parse_nvidia_smi_csv(text: str, fields: Sequence[str]) -> list[dict[str, str | None]]:
    """Rows of `--format=csv,noheader,nounits` output as dicts; unavailable values are None.

    Process names may contain commas, which nvidia-smi does not quote: the surplus columns are
    folded back into `process_name`.
    """
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cols = next(csv.reader([line], skipinitialspace=True))
        if len(cols) > len(fields) and "process_name" in fields:
            at = list(fields).index("process_name")
            extra = len(cols) - len(fields)
            cols = cols[:at] + [", ".join(cols[at:at + extra + 1])] + cols[at + extra + 1:]
        if len(cols) != len(fields):
            raise MetricsFormatError(
                f"nvidia-smi line {lineno}: expected {len(fields)} columns ({','.join(fields)}), got {len(cols)}: {line!r}"
            )
        rows.append({f: _value(c) for f, c in zip(fields, cols)})
    return rows


def parse_gpu_csv(text: str) -> list[GpuStat]:
    """`nvidia-smi --query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total` rows."""
    gpus = []
    for row in parse_nvidia_smi_csv(text, GPU_QUERY):
        index = _num(row["index"], int)
        if index is None:
            raise MetricsFormatError(f"nvidia-smi: GPU row without an index: {row}")
        gpus.append(GpuStat(index, row["uuid"], row["name"], _num(row["utilization.gpu"], float),
                            _num(row["memory.used"], float), _num(row["memory.total"], float)))
    return sorted(gpus, key=lambda g: g.index)


def parse_compute_apps_csv(text: str) -> list[GpuProcess]:
    """`nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory` rows (pid may be a host pid in a
    container): the processes holding each GPU, as the live view lists them."""
    procs = []
    for row in parse_nvidia_smi_csv(text, APPS_QUERY):
        pid = _num(row["pid"], int)
        if pid is None:
            continue
        procs.append(GpuProcess(row["gpu_uuid"], pid, row["process_name"], _num(row["used_memory"], float)))
    return procs
