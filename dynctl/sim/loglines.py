"""sglang's log lines, byte for byte: the logger format and the scheduler's batch lines.

Format: utils/common.py configure_logger (1216-1232): `[%(asctime)s{ms}{prefix}] %(message)s`, datefmt
`%Y-%m-%d %H:%M:%S`, where prefix is " TP{rank}" only when tp_size > 1 (scheduler.py:3080-3096) and ms is
".%(msecs)03d" when SGLANG_LOG_MS is set. uvicorn's lines use `[%(asctime)s] %(levelprefix)s %(message)s`
(utils/common.py:2507-2517). Everything goes to stderr except uvicorn's access log (stdout).
"""

from __future__ import annotations

import logging
import os
import sys

DATEFMT = "%Y-%m-%d %H:%M:%S"
SCHEDULER_LOGGER = "sglang.srt.managers.scheduler"
POLICY_LOGGER = "sglang.srt.speculative.spec_batch_threshold"
ADAPTIVE_LOGGER = "sglang.srt.speculative.adaptive_spec_params"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _format(prefix: str) -> str:
    ms = ".%(msecs)03d" if _env_flag("SGLANG_LOG_MS") else ""
    return f"[%(asctime)s{ms}{prefix}] %(message)s"


class _FlushingHandler(logging.StreamHandler):
    """Lines reach the log file as they happen, even when several processes share it."""

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        self.flush()


def configure_logger(prefix: str = "", level: str = "info") -> None:
    """The process-wide format, as configure_logger sets it with logging.basicConfig(force=True)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = _FlushingHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_format(prefix), datefmt=DATEFMT))
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


def scheduler_prefix(tp_rank: int, tp_size: int, dp_rank: int | None = None) -> str:
    prefix = f" DP{dp_rank}" if dp_rank is not None else ""
    if tp_size > 1:
        prefix += f" TP{tp_rank}"
    return prefix


def scheduler_logger(prefix: str) -> logging.Logger:
    """A logger that prints as the TP-0 scheduler process would (the batching runs in the main process).

    The patch's policy module and the adaptive controller live in the scheduler in real sglang, so their
    loggers print with the same prefix.
    """
    handler = _FlushingHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_format(prefix), datefmt=DATEFMT))
    for name in (SCHEDULER_LOGGER, POLICY_LOGGER, ADAPTIVE_LOGGER):
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        log.propagate = False
        log.setLevel(logging.INFO)
    return logging.getLogger(SCHEDULER_LOGGER)


class _UvicornFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # uvicorn's levelprefix: "INFO:" padded to 9 columns (uvicorn/logging.py ColourizedFormatter).
        record.levelprefix = (record.levelname + ":").ljust(9)
        return super().format(record)


def uvicorn_loggers() -> tuple[logging.Logger, logging.Logger]:
    """(error logger on stderr, access logger on stdout), formatted as sglang configures uvicorn."""
    loggers = []
    for name, stream in (("uvicorn.error", sys.stderr), ("uvicorn.access", sys.stdout)):
        handler = _FlushingHandler(stream)
        handler.setFormatter(_UvicornFormatter("[%(asctime)s] %(levelprefix)s %(message)s", datefmt=DATEFMT))
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        log.propagate = False
        log.setLevel(logging.INFO)
        loggers.append(log)
    return loggers[0], loggers[1]


def decode_batch_line(*, running: int, used_tokens: int, token_usage: float, accept: tuple[float, float] | None,
                      cuda_graph: bool, gen_throughput: float, queued: int, forward_ct: int | None = None) -> str:
    """scheduler_metrics_mixin.py log_decode_stats (0.5.9 lines 304-415)."""
    iter_msg = f" [{forward_ct}]" if forward_ct is not None and _env_flag("SGLANG_LOG_FORWARD_ITERS") else ""
    msg = f"Decode batch{iter_msg}, #running-req: {running}, #token: {used_tokens}, token usage: {token_usage:.2f}, "
    if accept is not None:
        msg += f"accept len: {accept[0]:.2f}, accept rate: {accept[1]:.2f}, "
    msg += (f"cuda graph: {cuda_graph}, gen throughput (token/s): {gen_throughput:.2f}, "
            f"#queue-req: {queued}")
    return msg


def prefill_batch_line(*, new_seqs: int, new_tokens: int, cached_tokens: int, token_usage: float, running: int,
                       queued: int, input_throughput: float, cuda_graph: bool, forward_ct: int | None = None) -> str:
    """scheduler_metrics_mixin.py log_prefill_stats (0.5.9 lines 159-240)."""
    iter_msg = f" [{forward_ct}]" if forward_ct is not None and _env_flag("SGLANG_LOG_FORWARD_ITERS") else ""
    return (f"Prefill batch{iter_msg}, #new-seq: {new_seqs}, #new-token: {new_tokens}, "
            f"#cached-token: {cached_tokens}, token usage: {token_usage:.2f}, #running-req: {running}, "
            f"#queue-req: {queued}, input throughput (token/s): {input_throughput:.2f}, cuda graph: {cuda_graph}")
