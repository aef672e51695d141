"""The Prometheus metrics sglang 0.5.9 serves at /metrics with --enable-metrics, under the same names,
types, help texts, label names and buckets (metrics/collector.py: SchedulerMetricsCollector and
TokenizerMetricsCollector; labels from scheduler_metrics_mixin.py:114-124 and tokenizer_manager.py:433-441).

sglang exposes a multiprocess registry (utils/common.py:1571-1581): no `_created` series, no process or
python collectors, and gauges without a `mostrecent` multiprocess mode carry a `pid` label.
"""

from __future__ import annotations

import os

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# sglang's multiprocess exposition has no `_created` samples.
prometheus_client.disable_created_metrics()

_TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
_E2E_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400]
_ITL_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000]
_QUEUE_BUCKETS = [0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400,
                  500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000]

# name -> help text, for the scheduler gauges the simulator keeps current (collector.py:306-400, 501-505,
# 710-714, 771-776).
_SCHEDULER_GAUGES = {
    "num_running_reqs": "The number of running requests.",
    "num_used_tokens": "The number of used tokens.",
    "token_usage": "The token usage.",
    "decode_sum_seq_lens": "The sum of all sequence lengths in decode.",
    "gen_throughput": "The generation throughput (token/s).",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "num_grammar_queue_reqs": "The number of requests in the grammar waiting queue.",
    "num_running_reqs_offline_batch": "The number of running low-priority offline batch requests(label is 'batch').",
    "cache_hit_rate": "The prefix cache hit rate.",
    "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
    "spec_accept_length": "The average acceptance length of speculative decoding.",
    "spec_accept_rate": "The average acceptance rate of speculative decoding (`accepted tokens / total draft tokens` in batch).",
    "utilization": "The utilization.",
    "is_cuda_graph": "Whether the batch is using CUDA graph.",
    "new_token_ratio": "The new token ratio.",
}


class ServerMetrics:
    def __init__(self, served_model_name: str, registry: CollectorRegistry | None = None):
        # sglang's multiprocess exposition has no `_created` series (a process-wide switch: the server's).
        prometheus_client.disable_created_metrics()
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.scheduler_labels = {"model_name": served_model_name, "engine_type": "unified", "tp_rank": "0",
                                 "pp_rank": "0", "moe_ep_rank": "0"}
        names = list(self.scheduler_labels)
        self.gauges = {
            key: Gauge(f"sglang:{key}", doc, names, registry=r, multiprocess_mode="mostrecent")
            .labels(**self.scheduler_labels)
            for key, doc in _SCHEDULER_GAUGES.items()
        }
        # No multiprocess_mode in collector.py:402-427, so the exposition adds the process id.
        pid_labels = {**self.scheduler_labels, "pid": str(os.getpid())}
        self.num_retracted_reqs = Gauge("sglang:num_retracted_reqs", "The number of retracted requests.",
                                        names + ["pid"], registry=r).labels(**pid_labels)
        self.num_paused_reqs = Gauge("sglang:num_paused_reqs", "The number of paused requests by async weight sync.",
                                     names + ["pid"], registry=r).labels(**pid_labels)
        self.num_retracted_requests_total = Counter(
            "sglang:num_retracted_requests_total", "Total number of retracted requests.", names, registry=r,
        ).labels(**self.scheduler_labels)
        self.cuda_graph_passes_total = Counter(
            "sglang:cuda_graph_passes_total", "Total number of forward passes categorized by CUDA graph.",
            names + ["mode"], registry=r)
        self.realtime_tokens_total = Counter(
            "sglang:realtime_tokens_total",
            "Total number of tokens processed (updated on each log interval). mode: prefill_compute, prefill_cache, decode.",
            names + ["mode"], registry=r)
        self.queue_time = Histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", names,
                                    registry=r, buckets=_QUEUE_BUCKETS).labels(**self.scheduler_labels)

        self.tokenizer_labels = {"model_name": served_model_name}
        tnames = list(self.tokenizer_labels)
        t = self.tokenizer_labels
        self.prompt_tokens_total = Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                                           tnames, registry=r).labels(**t)
        self.generation_tokens_total = Counter("sglang:generation_tokens_total",
                                               "Number of generation tokens processed.", tnames, registry=r).labels(**t)
        self.num_requests_total = Counter("sglang:num_requests_total", "Number of requests processed.", tnames,
                                          registry=r).labels(**t)
        self.num_aborted_requests_total = Counter("sglang:num_aborted_requests_total", "Number of requests aborted.",
                                                  tnames, registry=r).labels(**t)
        self.time_to_first_token = Histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", tnames,
            registry=r, buckets=_TTFT_BUCKETS).labels(**t)
        self.inter_token_latency = Histogram(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", tnames,
            registry=r, buckets=_ITL_BUCKETS).labels(**t)
        self.e2e_request_latency = Histogram(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", tnames,
            registry=r, buckets=_E2E_BUCKETS).labels(**t)
        self.num_retracted_reqs.set(0)
        self.num_paused_reqs.set(0)

    def set_gauge(self, key: str, value: float) -> None:
        self.gauges[key].set(value)

    def count_decode_step(self, cuda_graph: bool, tokens: int) -> None:
        # collector.py:926-929 and 938-952.
        mode = "decode_cuda_graph" if cuda_graph else "decode_none"
        self.cuda_graph_passes_total.labels(**self.scheduler_labels, mode=mode).inc()
        if tokens:
            self.realtime_tokens_total.labels(**self.scheduler_labels, mode="decode").inc(tokens)

    def count_prefill(self, compute_tokens: int, cache_tokens: int) -> None:
        if compute_tokens:
            self.realtime_tokens_total.labels(**self.scheduler_labels, mode="prefill_compute").inc(compute_tokens)
        if cache_tokens:
            self.realtime_tokens_total.labels(**self.scheduler_labels, mode="prefill_cache").inc(cache_tokens)

    def observe_inter_token_latency(self, interval: float, num_new_tokens: int) -> None:
        # TokenizerMetricsCollector.observe_inter_token_latency: one observation per new token.
        if num_new_tokens <= 0:
            return
        per_token = interval / num_new_tokens
        for _ in range(num_new_tokens):
            self.inter_token_latency.observe(per_token)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
