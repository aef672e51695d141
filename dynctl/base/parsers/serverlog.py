"""The lines an SGLang server logs: their prefix (time, ranks), the scheduler's decode line, the threshold's
transitions and warnings."""

from __future__ import annotations

import calendar
import re
import time
from dataclasses import dataclass

from dynctl.base import sglang
from dynctl.base.parsers import number

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
        running_reqs=number(fields.get("#running-req"), int),
        tokens=number(fields.get("#token", fields.get("#full token")), int),
        token_usage=number(usage, float),
        accept_length=number(fields.get("accept len"), float),
        accept_rate=number(fields.get("accept rate"), float),
        cuda_graph=None if graph is None else graph == "True",
        gen_throughput=number(fields.get("gen throughput (token/s)"), float),
        queue_reqs=number(fields.get("#queue-req"), int),
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
