"""From sglang 0.5.15, model overrides declare settings (DP attention, multi-layer EAGLE) that reach the
ServerArgs fields only at the end of __post_init__: the startup check reads them through the release's
own resolved_view, and the worker, which arms after __post_init__, reads the fields."""

from __future__ import annotations

import ast
import logging
import typing
import zipfile

import pytest
from sglang_trees import sglang_wheel
from test_patch_policy import sbt, server_args

# Releases whose variant's startup check reads through resolved_view.
DECLARING = ["0.5.15", "0.5.16", "0.5.17", "0.5.18"]


def _release_view(version: str):
    """resolved_view of the release: its ResolvedView class and overlay helper, run as the wheel has them
    (the rest of overrides.py imports torch-side modules, which these two do not use)."""
    with zipfile.ZipFile(sglang_wheel(version)) as wheel:
        tree = ast.parse(wheel.read("sglang/srt/arg_groups/overrides.py").decode())
    wanted = {"ResolvedView", "_declaration_overlay", "resolved_view"}
    body = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in wanted]
    assert {n.name for n in body} == wanted
    namespace = {"__name__": "overrides", **vars(typing)}
    exec(compile(ast.Module(body=body, type_ignores=[]), "overrides.py", "exec"), namespace)
    return namespace["resolved_view"]


@pytest.mark.parametrize("version", DECLARING)
@pytest.mark.parametrize(("declared", "reason"), [
    ({"enable_dp_attention": True}, "DP attention is enabled"),
    ({"enable_multi_layer_eagle": True}, "enable_multi_layer_eagle=True"),
    ({"speculative_eagle_topk": 4}, "speculative_eagle_topk=4"),
])
def test_the_startup_check_sees_what_resolution_declared(version: str, declared: dict, reason: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    resolved_view = _release_view(version)
    args = server_args(_resolved_overrides=[("a model override", declared)])
    with caplog.at_level(logging.WARNING, logger=sbt.logger.name):
        sbt.check_threshold_args(args)  # the raw fields: what a plain read would have seen
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger=sbt.logger.name):
        sbt.check_threshold_args(resolved_view(args))
    assert len(caplog.records) == 1 and reason in caplog.records[0].getMessage()
    assert "is not armed" in caplog.records[0].getMessage()
