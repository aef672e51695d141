"""`dynctl status`'s threshold row: where its value came from, in words that stay true (a threshold gauge
is written at a decode step, so after a live change on an idle server it still shows the old value)."""

from __future__ import annotations

import pytest

from dynctl.cli import hosts

PATCH = {"status": "applied", "detail": "", "current_release": "0001"}


def threshold_row(capsys, threshold, source: str, age_s) -> str:
    server = {"state": "ready", "threshold": threshold, "release": "0001", "release_threshold": threshold,
              "sources": {"threshold": {"source": source, "age_s": age_s, "stale": False}}}
    capsys.readouterr()
    hosts.render_server(PATCH, server)
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("threshold"))


@pytest.mark.parametrize(("threshold", "source", "age_s", "said", "not_said"), [
    (3, "/server_info", 0.0, "(from /server_info)", "gauge"),
    (5, "metrics", None, "from the gauge, written at the last decode step: a live change since is not in it",
     "/server_info"),
    (None, "/server_info", 0.4, "none reported by /server_info", "did not answer"),
    (None, "/server_info", None, "unknown: /server_info did not answer", "none reported"),
])
def test_the_threshold_row_says_where_the_value_came_from(capsys, threshold, source, age_s, said, not_said):
    row = threshold_row(capsys, threshold, source, age_s)
    assert said in row and not_said not in row, row


@pytest.mark.parametrize(("switch", "said"), [
    ({"time": 1.0, "enabled": False, "batch_size": 9, "threshold": 5, "source": "log"}, "last switch at batch 9"),
    ({"time": 1.0, "enabled": False, "batch_size": None, "threshold": None, "source": "gauge"},
     "last switch seen in the metrics gauge; its log line not read yet"),
])
def test_the_speculation_row_names_the_batch_only_when_the_log_gave_it(capsys, switch, said):
    capsys.readouterr()
    hosts.render_server(PATCH, {"state": "ready", "speculation": False, "last_switch": switch})
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("speculation"))
    assert said in row and "None" not in row, row
