"""sglang's "Decode batch" line in every form it has been logged in since 0.4, read from lines quoted in public
SGLang issues (each row names its source), and lines that are not decode lines kept whole.
"""

from __future__ import annotations

import calendar

import pytest

from dynctl.base.parsers.serverlog import parse_decode_line, split_log_prefix

UTC = 0.0


def utc(stamp: str) -> float:
    whole, _, frac = stamp.partition(".")
    return calendar.timegm(tuple(map(int, whole.replace("-", " ").replace(":", " ").split())) + (0, 0, 0)) + (
        int(frac) / 1000 if frac else 0.0)


# (source, line, time, (tp, dp, pp), running, tokens, usage, accept_len, gen_throughput, queue)
TABLE = [
    ("https://github.com/sgl-project/sglang/issues/938",  # 2024: the period form, no prefix at all
     "Decode batch. #running-req: 1010, #token: 55006, token usage: 0.93, gen throughput (token/s): 1397.13, "
     "#queue-req: 12279",
     None, (None, None, None), 1010, 55006, 0.93, None, 1397.13, 12279),
    ("https://github.com/sgl-project/sglang/issues/3909",  # 2025: period form behind date-time and TP0
     "[2025-02-27 04:46:39 TP0] Decode batch. #running-req: 8, #token: 62531, token usage: 0.12, "
     "gen throughput (token/s): 186.64, #queue-req: 0",
     "2025-02-27 04:46:39", (0, None, None), 8, 62531, 0.12, None, 186.64, 0),
    ("https://github.com/sgl-project/sglang/pull/22331",  # comma form with TP0 and the cuda graph field
     "[2026-04-08 14:05:21 TP0] Decode batch, #running-req: 5, #token: 20800, token usage: 0.29, cuda graph: True, "
     "gen throughput (token/s): 144.95, #queue-req: 0",
     "2026-04-08 14:05:21", (0, None, None), 5, 20800, 0.29, None, 144.95, 0),
    ("https://github.com/sgl-project/sglang/pull/22166",  # comma form, date-time without ranks (TP 1)
     "[2026-04-05 20:02:51] Decode batch, #running-req: 32, #token: 11179, token usage: 0.08, cuda graph: True, "
     "gen throughput (token/s): 1635.11, #queue-req: 0",
     "2026-04-05 20:02:51", (None, None, None), 32, 11179, 0.08, None, 1635.11, 0),
    ("https://github.com/sgl-project/sglang/pull/21723",  # the logging-module form; a hybrid model's #full token
     "2026-03-18 11:22:05.874 INFO 120984 [ TP0 scheduler_metrics_mixin.py:415] Decode batch, #running-req: 2, "
     "#full token: 5046, full token usage: 0.01, mamba num: 2, mamba usage: 0.08, accept len: 2.64, "
     "accept rate: 0.66, cuda graph: True, gen throughput (token/s): 242.08, #queue-req: 0",
     "2026-03-18 11:22:05.874", (0, None, None), 2, 5046, 0.01, 2.64, 242.08, 0),
]


@pytest.mark.parametrize("source,line,stamp,ranks,running,tokens,usage,accept,gen,queue", TABLE,
                         ids=[row[0].rsplit("/", 2)[-2] + "-" + row[0].rsplit("/", 1)[-1] for row in TABLE])
def test_real_decode_lines_of_every_release_parse(source, line, stamp, ranks, running, tokens, usage, accept, gen,
                                                  queue):
    d = parse_decode_line(line, UTC)
    assert d is not None, source
    assert d.time == (None if stamp is None else pytest.approx(utc(stamp)))
    assert (d.tp_rank, d.dp_rank, d.pp_rank) == ranks
    assert (d.running_reqs, d.tokens, d.token_usage, d.accept_length, d.gen_throughput, d.queue_reqs) == (
        running, tokens, usage, accept, gen, queue)


def test_time_of_day_only_and_every_rank():
    now = utc("2026-03-01 12:00:00")
    d = parse_decode_line("[11:59:58 DP1 TP3 PP2] Decode batch [812], #running-req: 4, #token: 10, "
                          "token usage: 0.01, gen throughput (token/s): 9.50, #queue-req: 1", UTC)
    assert (d.tp_rank, d.dp_rank, d.pp_rank, d.running_reqs, d.queue_reqs) == (3, 1, 2, 4, 1)
    # a time of day is dated to its last occurrence: just before midnight seen just after it is yesterday
    assert split_log_prefix("[11:59:58 TP0] x", UTC, now=now).time == utc("2026-03-01 11:59:58")
    assert split_log_prefix("[23:59:59 TP0] x", UTC, now=utc("2026-03-02 00:00:01")).time == utc("2026-03-01 23:59:59")


@pytest.mark.parametrize("line", [
    "[2025-08-11 21:13:51] INFO:     10.0.0.2:55254 - \"POST /v1/chat/completions HTTP/1.1\" 200 OK",  # sglang #9099
    "[2026-04-05 20:02:51] Prefill batch, #new-seq: 1, #new-token: 158, #cached-token: 0, token usage: 0.08, "
    "#running-req: 31, #queue-req: 0, cuda graph: True, input throughput (token/s): 559.53",  # sglang #22166
    "Decode batch size is 8 on this box",  # prose that merely starts like one
    "something no release of sglang writes",
])
def test_other_lines_are_not_decode_lines_and_keep_their_text(line):
    assert parse_decode_line(line, UTC) is None
    prefix = split_log_prefix(line, UTC)
    assert prefix.message and prefix.message in line  # kept whole, never dropped
