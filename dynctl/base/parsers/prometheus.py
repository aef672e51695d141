"""Prometheus text as a server's /metrics serves it, read into the numbers dynctl shows (`ServerMetrics`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from dynctl.base.parsers import MetricsFormatError

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
