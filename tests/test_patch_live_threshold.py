"""sglang 0.5.17's live config: /set_internal_state's override reaches the worker through the spec bag.

Runs the release's own runtime_context and arg_utils (stdlib only, five files of the wheel) in a child
interpreter: the patched field is published as the scheduler publishes its ServerArgs, changed as
set_internal_state changes it, and read back as the worker's adapter and /server_info read it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from sglang_trees import sglang_wheel

from dynctl.patching.recipe import fragment_text, recipes, table
from dynctl.patching.versions import variant_for

VERSION = "0.5.17"
# What runtime_context imports when it loads (its other imports are lazy).
FILES = ("srt/runtime_context.py", "srt/arg_groups/arg_utils.py", "srt/environ.py",
         "srt/debug_utils/__init__.py", "srt/debug_utils/cuda_coredump.py")

CHILD = textwrap.dedent('''
    import dataclasses, json, sys, typing
    from sglang.srt import runtime_context as rc
    from sglang.srt.arg_groups import arg_utils as au

    given = json.loads(sys.stdin.read())
    namespace = {"A": au.A, "NS": au.NS, "Optional": typing.Optional, "__name__": "server_args"}
    exec("class Args:\\n" + given["fields"], namespace)
    args = dataclasses.dataclass(namespace["Args"])(speculative_num_draft_tokens=4,
                                                    speculative_disable_batch_threshold=5)
    ctx = rc.publish(args, role="test")
    out = {}
    try:
        ctx.override(source="update_server_args", speculative_disable_batch_threshold=3)
    except ValueError as err:
        out["override_error"] = str(err)
    for name, source in given["readers"].items():
        scope = {"get_spec": rc.get_spec}
        exec(source, scope)
        worker = type("Worker", (), {"server_args": args, "read": scope["_spec_disable_threshold"]})()
        try:
            out[name] = worker.read()
        except AttributeError as err:
            out[name] = f"AttributeError: {err}"
    out["server_info"] = ctx.resolved_server_args_dict()["speculative_disable_batch_threshold"]
    out["server_args"] = args.speculative_disable_batch_threshold
    print(json.dumps(out))
''')


def _tree(tmp_path: Path) -> Path:
    with zipfile.ZipFile(sglang_wheel(VERSION)) as wheel:
        for rel in FILES:
            dest = tmp_path / "sglang" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(wheel.read(f"sglang/{rel}"))
    for pkg in ("sglang", "sglang/srt", "sglang/srt/arg_groups"):
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


def _reader(variant: str) -> str:
    """The adapter's _spec_disable_threshold of `variant`, as a module-level function."""
    adapter = next(ins for r in recipes(variant) for ins in r.insertions if ins.fragment.startswith("eagle_worker_v2.adapt-"))
    cls = ast.parse("class Adapter:\n" + adapter.text).body[0]
    return ast.unparse(next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_spec_disable_threshold"))


def _run(tmp_path: Path, fields: str) -> dict:
    readers = {"adapter_0_5_17": _reader("0.5.17"), "adapter_0_5_14": _reader("0.5.14")}
    proc = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps({"fields": fields, "readers": readers}),
                          cwd=_tree(tmp_path), env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_live_change_reaches_the_worker_and_server_info(tmp_path: Path) -> None:
    neighbour = table()["anchors"]["num_draft_tokens_annotated_field_in_spec_namespace"]
    out = _run(tmp_path, neighbour + fragment_text("server_args.field-0.5.17"))
    assert "override_error" not in out
    assert out["adapter_0_5_17"] == 3  # the value set_internal_state put in force
    assert out["server_info"] == 3  # what get_internal_state reports (/server_info's internal_states)
    # server_args keeps the startup value: a worker reading it (the 0.5.14 adapter) would never see the change
    assert out["server_args"] == 5 and out["adapter_0_5_14"] == 5


def test_a_field_without_the_namespace_marker_makes_the_override_fail(tmp_path: Path) -> None:
    neighbour = table()["anchors"]["num_draft_tokens_annotated_field_in_spec_namespace"]
    out = _run(tmp_path, neighbour + fragment_text("server_args.field-0.5.14"))
    assert "unknown config field 'speculative_disable_batch_threshold'" in out["override_error"]
    assert out["adapter_0_5_17"] == "AttributeError: config namespace 'spec' has no leaf/subgroup " \
                                    "'speculative_disable_batch_threshold'"


@pytest.mark.parametrize("version", ["0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"])
def test_the_scheduler_applies_and_reports_through_the_context(version: str) -> None:
    """What the two tests above stand in for: set_internal_state and get_internal_state of the releases
    whose adapter reads the spec bag (from 0.5.19 the context's import chain reaches torch, so this
    reading of the release's code is what runs here; 0.5.22 moved both into the handler module)."""
    assert _reader(variant_for(version)) == _reader("0.5.17")
    handler_module = "sglang/srt/managers/scheduler_components/internal_state.py"
    with zipfile.ZipFile(sglang_wheel(version)) as wheel:
        moved = handler_module in wheel.namelist()
        scheduler = ast.parse(wheel.read(handler_module if moved else "sglang/srt/managers/scheduler.py").decode())
    name = "SchedulerInternalStateController" if moved else "Scheduler"
    cls = next(n for n in ast.walk(scheduler) if isinstance(n, ast.ClassDef) and n.name == name)
    methods = {n.name: ast.unparse(n) for n in cls.body if isinstance(n, ast.FunctionDef)}
    applied = "**overrides" if moved else "**remaining"
    assert f"get_context().override(source='update_server_args', {applied})" in methods["set_internal_state"]
    if moved:
        assert "state = get_context().resolved_server_args_dict()" in methods["get_internal_state"]
        assert "setattr(" not in methods["set_internal_state"]
        return
    assert "setattr(" not in methods["set_internal_state"]  # server_args is no longer written
    assert "ret = get_context().resolved_server_args_dict()" in methods["get_internal_state"]
