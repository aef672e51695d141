"""The parsers of dynctl.base.parsers against text in the exact formats sglang, prometheus_client and nvidia-smi emit."""

from __future__ import annotations

import calendar
import subprocess
import sys
import textwrap

import pytest

from dynctl.base.parsers import MetricsFormatError
from dynctl.base.parsers.nvidia_smi import parse_gpu_csv, parse_nvidia_smi_csv
from dynctl.base.parsers.prometheus import parse_prometheus, pick_samples, read_server_metrics
from dynctl.base.parsers.serverlog import parse_decode_line, parse_log_time, parse_transition_line

# sglang 0.5.9 registers its scheduler gauges in prometheus_client's multiprocess mode ("mostrecent")
# with these labels (metrics/collector.py, managers/scheduler_metrics_mixin.py:114-124) and serves
# them through MultiProcessCollector (utils/common.py add_prometheus_middleware). This script does the
# same in two "TP rank" processes so the text below is what a TP=2 server prints, byte for byte.
_EXPOSE = textwrap.dedent('''
    import os, sys, multiprocessing as mp
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

    def rank(tp, running, enabled):
        labels = dict(model_name="glm-5", engine_type="unified", tp_rank=tp, pp_rank=0, moe_ep_rank=tp)
        def gauge(name, value):
            Gauge(name, name, labelnames=labels.keys(), multiprocess_mode="mostrecent").labels(**labels).set(value)
        gauge("sglang:num_running_reqs", running)
        gauge("sglang:num_queue_reqs", 3)
        gauge("sglang:token_usage", 0.25)
        gauge("sglang:num_used_tokens", 20000)
        gauge("sglang:max_total_num_tokens", 80000)
        gauge("sglang:gen_throughput", 1234.5)
        gauge("sglang:spec_accept_length", 2.71)
        gauge("sglang:spec_enabled", enabled)
        gauge("sglang:spec_disable_threshold", 5)
        Counter("sglang:spec_disabled_steps_total", "x", labelnames=labels.keys()).labels(**labels).inc(42)
        Counter("sglang:realtime_tokens_total", "x", labelnames=list(labels) + ["mode"]).labels(
            **labels, mode="decode").inc(9000)

    if __name__ == "__main__":
        procs = [mp.Process(target=rank, args=(0, 7, 0)), mp.Process(target=rank, args=(1, 7, 0))]
        for p in procs: p.start()
        for p in procs: p.join()
        Counter("sglang:generation_tokens_total", "x", labelnames=["model_name"]).labels(model_name="glm-5").inc(5000)
        Histogram("sglang:time_to_first_token_seconds", "x", labelnames=["model_name"]).labels(
            model_name="glm-5").observe(0.2)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        sys.stdout.write(generate_latest(registry).decode())
''')


@pytest.fixture(scope="module")
def sglang_metrics_text(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("prom")
    script = d / "expose.py"
    script.write_text(_EXPOSE)
    (d / "mp").mkdir()
    out = subprocess.run([sys.executable, str(script), str(d / "mp")], capture_output=True, text=True, timeout=60,
                         check=True)
    return out.stdout


class TestPrometheus:
    def test_multiprocess_text_from_two_tp_ranks(self, sglang_metrics_text: str) -> None:
        assert 'tp_rank="1"' in sglang_metrics_text  # both ranks really are in the text
        m = read_server_metrics(sglang_metrics_text)
        assert m.running_reqs == 7  # rank 0 only: TP ranks repeat the batch, they do not add to it
        assert m.queue_reqs == 3
        assert m.token_usage == pytest.approx(0.25)
        assert m.used_tokens == 20000 and m.max_total_tokens == 80000
        assert m.gen_throughput == pytest.approx(1234.5)
        assert m.accept_length == pytest.approx(2.71)
        assert m.spec_enabled is False
        assert m.spec_threshold == 5
        assert m.spec_disabled_steps == 42
        assert m.decode_tokens == 9000
        assert m.generation_tokens == 5000

    def test_data_parallel_ranks_add_up_and_ratios_average(self) -> None:
        text = "\n".join([
            "# TYPE sglang:num_running_reqs gauge",
            'sglang:num_running_reqs{dp_rank="0",tp_rank="0"} 4.0',
            'sglang:num_running_reqs{dp_rank="0",tp_rank="1"} 4.0',
            'sglang:num_running_reqs{dp_rank="1",tp_rank="2"} 6.0',
            "# TYPE sglang:token_usage gauge",
            'sglang:token_usage{dp_rank="0",tp_rank="0"} 0.2',
            'sglang:token_usage{dp_rank="1",tp_rank="2"} 0.4',
        ]) + "\n"
        m = read_server_metrics(text)
        assert m.running_reqs == 10
        assert m.token_usage == pytest.approx(0.3)

    def test_absent_metrics_stay_none(self) -> None:
        m = read_server_metrics('# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{tp_rank="0"} 2.0\n')
        assert m.running_reqs == 2
        assert m.spec_enabled is None and m.spec_threshold is None and m.gen_throughput is None

    def test_pick_samples_filters_labels(self, sglang_metrics_text: str) -> None:
        samples = parse_prometheus(sglang_metrics_text)["sglang:realtime_tokens_total"]
        picked = pick_samples(samples, mode="decode")
        assert [s.labels["tp_rank"] for s in picked] == ["0"]
        assert pick_samples(samples, mode="prefill_compute") == []

    def test_garbage_is_a_clear_error(self) -> None:
        with pytest.raises(MetricsFormatError, match="/metrics: not Prometheus text"):
            read_server_metrics("<html>502 Bad Gateway</html>\n")
        with pytest.raises(MetricsFormatError, match="/metrics: not Prometheus text"):
            parse_prometheus('sglang:num_running_reqs{tp_rank="0"} 2.0\nsglang:x{tp_rank="0" 1\n')

    def test_kept_series_read_as_prometheus_client_reads_the_whole_text(self, sglang_metrics_text: str) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        def whole(text: str) -> dict:
            out: dict = {}
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    out.setdefault(s.name, []).append((s.name, s.labels, s.value, s.timestamp))
            return out

        def ours(text: str) -> dict:
            return {k: [(s.name, s.labels, s.value, s.timestamp) for s in v] for k, v in parse_prometheus(text).items()}

        moved = sglang_metrics_text.replace(" 7.0\n", " 9.0\n")  # the same series, other values
        assert moved != sglang_metrics_text
        for text in (sglang_metrics_text, moved, sglang_metrics_text):
            assert ours(text) == whole(text)
        odd = '# TYPE a gauge\na{l="x}y",m="q\\"z"} NaN\na{l="2"} +Inf\nb 3\n'  # "}" and '"' in values
        stamped = odd + 'c{l="1"} 4 1700000000000\n'  # a timestamp: read by prometheus_client itself
        for text in (odd, stamped):
            assert ours(text).keys() == whole(text).keys() and str(ours(text)) == str(whole(text))


class TestLogLines:
    # the line sglang 0.5.9 prints (scheduler_metrics_mixin.py:366-415), with the prefix of configure_logger
    DECODE = ("[2026-02-23 10:00:00 TP0] Decode batch, #running-req: 64, #token: 81234, token usage: 0.12, "
              "accept len: 2.71, accept rate: 0.68, cuda graph: True, gen throughput (token/s): 4321.00, #queue-req: 3")

    def test_decode_line(self) -> None:
        d = parse_decode_line(self.DECODE, utc_offset=0)
        assert d is not None
        assert (d.running_reqs, d.tokens, d.queue_reqs, d.tp_rank) == (64, 81234, 3, 0)
        assert d.token_usage == pytest.approx(0.12)
        assert d.accept_length == pytest.approx(2.71) and d.accept_rate == pytest.approx(0.68)
        assert d.cuda_graph is True
        assert d.gen_throughput == pytest.approx(4321.0)
        assert d.time == calendar.timegm((2026, 2, 23, 10, 0, 0, 0, 0, 0))

    def test_decode_line_variants(self) -> None:
        # no speculation, SGLANG_LOG_FORWARD_ITERS, SGLANG_LOG_MS, DP rank, hybrid SWA usage fields
        line = ("[2026-02-23 10:00:00.250 DP1 TP3] Decode batch [812], #running-req: 2, #full token: 10, "
                "full token usage: 0.01, #swa token: 5, swa token usage: 0.00, cuda graph: False, "
                "gen throughput (token/s): 88.50, #queue-req: 0")
        d = parse_decode_line(line, utc_offset=3600)
        assert d is not None
        assert (d.running_reqs, d.dp_rank, d.tp_rank, d.accept_length, d.cuda_graph) == (2, 1, 3, None, False)
        assert d.token_usage == pytest.approx(0.01) and d.tokens == 10
        assert d.time == calendar.timegm((2026, 2, 23, 10, 0, 0, 0, 0, 0)) - 3600 + 0.25

    def test_other_lines_are_not_decode_lines(self) -> None:
        assert parse_decode_line("[2026-02-23 10:00:00 TP0] Prefill batch, #new-seq: 1, #new-token: 9") is None
        assert parse_decode_line("random text") is None

    def test_transition_lines(self) -> None:
        off = parse_transition_line("[2026-02-23 10:00:05 TP0] Speculation disabled: batch size 7 > threshold 5", 0)
        on = parse_transition_line("[2026-02-23 10:00:09 TP0] Speculation enabled: batch size 5 <= threshold 5", 0)
        assert off is not None and on is not None
        assert (off.enabled, off.batch_size, off.threshold) == (False, 7, 5)
        assert (on.enabled, on.batch_size, on.threshold) == (True, 5, 5)
        assert on.time - off.time == 4
        assert parse_transition_line("[2026-02-23 10:00:09 TP0] Speculation config ok", 0) is None

    def test_log_time_zone(self) -> None:
        # a host 2 h east of UTC writes 12:00 for 10:00 UTC
        assert parse_log_time("2026-02-23 12:00:00", 7200) == calendar.timegm((2026, 2, 23, 10, 0, 0, 0, 0, 0))


class TestNvidiaSmi:
    # `nvidia-smi --query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total
    #  --format=csv,noheader,nounits` as printed on an H200 (driver 580.159.04), plus the placeholders
    # nvidia-smi prints for values a GPU or a container cannot give.
    GPUS = ("0, GPU-a0137e3f-a1e1-bc41-ec1d-40414a780019, NVIDIA H200, 0, 0, 143771\n"
            "1, GPU-b0137e3f-a1e1-bc41-ec1d-40414a780019, NVIDIA H200, [N/A], 71234, 143771\n"
            "2, GPU-c0137e3f-a1e1-bc41-ec1d-40414a780019, NVIDIA H200, [Not Supported], [N/A], [N/A]\n")

    def test_gpu_rows(self) -> None:
        gpus = parse_gpu_csv(self.GPUS)
        assert [g.index for g in gpus] == [0, 1, 2]
        assert gpus[0].name == "NVIDIA H200" and gpus[0].util_pct == 0 and gpus[0].mem_total_mib == 143771
        assert gpus[1].util_pct is None and gpus[1].mem_used_mib == 71234
        assert gpus[2].util_pct is None and gpus[2].mem_used_mib is None and gpus[2].mem_total_mib is None

    def test_wrong_column_count_names_the_line(self) -> None:
        with pytest.raises(MetricsFormatError, match="line 2: expected 6 columns"):
            parse_gpu_csv("0, GPU-x, H200, 1, 2, 3\n0, 1\n")

    def test_empty_output(self) -> None:
        assert parse_gpu_csv("") == [] and parse_nvidia_smi_csv("\n", ("pid",)) == []
