"""Every agent request's parameters are checked once, in verbs.main, against the verb's own signature."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynctl.agent import archive
from dynctl.base import hostspec
from dynctl_agent import verbs


def ask(tmp_path, verb, params):
    request = {"protocol": 1, "verb": verb, "params": params, "host": {"workdir": str(tmp_path / "work")}}
    # the agent as its archive lays it out: its package beside this checkout's dynctl (hostspec, sglang)
    path = os.pathsep.join([str(archive.remote_dir()), str(Path(hostspec.__file__).parent.parent)])
    proc = subprocess.run([sys.executable, "-m", "dynctl_agent"], input=json.dumps(request), capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": path}, timeout=60)
    return proc.returncode, json.loads(proc.stdout.splitlines()[-1])


def test_a_misspelt_parameter_is_refused_by_name(tmp_path):
    rc, answer = ask(tmp_path, "server_logs", {"line": 5})
    assert rc == 1 and answer["ok"] is False and answer["kind"] == "usage"
    assert answer["error"].startswith("unsupported parameters for server_logs: line (it takes: lines)")
    assert ask(tmp_path, "server_logs", {"lines": 5})[1]["ok"] is True


def test_a_missing_parameter_is_named(tmp_path):
    rc, answer = ask(tmp_path, "op_detach", {})
    assert answer["kind"] == "usage" and "missing parameters for op_detach: op_id" in answer["error"]


def test_a_streaming_verb_is_checked_before_it_streams(tmp_path):
    rc, answer = ask(tmp_path, "watch", {"intervall": 1})
    assert answer["kind"] == "usage" and answer.get("done") is True
    assert "unsupported parameters for watch: intervall" in answer["error"]


def test_an_operation_with_an_unknown_parameter_claims_nothing(tmp_path):
    rc, answer = ask(tmp_path, "op_start", {"kind": "rollback", "params": {"baseline_argv": [], "sok": 5}})
    assert answer["kind"] == "usage" and "unsupported parameters for rollback: sok" in answer["error"]
    assert answer["changed"] is False
    assert not (tmp_path / "work" / "ops").exists()


@pytest.mark.parametrize("verb", sorted(verbs.VERBS))
def test_no_verb_swallows_parameters(verb):
    import inspect

    fn = verbs.load(verbs.VERBS[verb])
    assert not [p for p in inspect.signature(fn).parameters.values() if p.kind is p.VAR_KEYWORD]


@pytest.mark.parametrize("kind", sorted(verbs.OPS))
def test_no_operation_swallows_parameters(kind):
    import inspect

    fn = verbs.load(verbs.OPS[kind])
    assert not [p for p in inspect.signature(fn).parameters.values() if p.kind is p.VAR_KEYWORD]
