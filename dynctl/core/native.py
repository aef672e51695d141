"""Native strategy (sglang ≥ 0.5.14): the threshold as an adaptive speculative config; no file touched.

sglang ≥ 0.5.14 chooses the draft step count per decode batch from `--speculative-adaptive-config`:
it pads the batch size up to the next captured CUDA-graph batch size, then takes the config slot with
the largest batch-size key at or below that. Pinning each slot to one candidate freezes the choice:
`{"1": [S], "<N+1>": [0]}` speculates with S steps up to N requests and not at all above N (steps 0
still runs the draft-extend, so the draft KV cache stays warm).
"""

from __future__ import annotations

import ast
import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dynctl.base import pysource, sglang
from dynctl.base.errors import PreflightError, UsageError
from dynctl.patching.versions import parse_threshold

DEFAULT_CONFIG_NAME = "adaptive_spec.json"
SPEC_DEFAULT_MAX_RUNNING = sglang.SPEC_DEFAULT_MAX_RUNNING


def spec_capture_batch_sizes(max_bs: int | None) -> list[int]:
    """The decode batch sizes sglang captures CUDA graphs for when speculating (0.5.14–0.5.23 rule).

    With max_bs unknown (sglang sizes it from GPU memory at start) the list is not capped.
    """
    sizes = sglang.cuda_graph_batch_sizes(max_bs if max_bs is not None else 4096, speculative=True)
    if max_bs is not None and max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(sizes)


@dataclass(frozen=True)
class LaunchArgs:
    """What the configured server args say about speculation and CUDA graphs."""

    algorithm: str | None = None
    topk: int | None = None
    steps: int | None = None
    max_running_requests: int | None = None
    cuda_graph_bs: tuple[int, ...] | None = None
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    disable_cuda_graph_padding: bool = False
    dp_attention: bool = False
    adaptive_config: str | None = None


_VALUE_FLAGS = {
    "--speculative-algorithm": "algorithm",
    "--speculative-eagle-topk": "topk",
    "--speculative-num-steps": "steps",
    "--max-running-requests": "max_running_requests",
    "--cuda-graph-max-bs": "cuda_graph_max_bs",
    "--cuda-graph-max-bs-decode": "cuda_graph_max_bs",
    "--speculative-adaptive-config": "adaptive_config",
}
_LIST_FLAGS = {"--cuda-graph-bs": "cuda_graph_bs", "--cuda-graph-bs-decode": "cuda_graph_bs"}
_BOOL_FLAGS = {
    "--disable-cuda-graph": "disable_cuda_graph",
    "--disable-cuda-graph-padding": "disable_cuda_graph_padding",
    "--enable-dp-attention": "dp_attention",
}
_INT_FIELDS = {"topk", "steps", "max_running_requests", "cuda_graph_max_bs"}


def parse_launch_args(args: Sequence[str]) -> LaunchArgs:
    """Read the speculation-related flags out of a server argv (later flags win, like argparse)."""
    found: dict[str, Any] = {}
    args = list(args)
    i = 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        if flag in _VALUE_FLAGS:
            name = _VALUE_FLAGS[flag]
            value = inline if inline else (args[i + 1] if i + 1 < len(args) else None)
            i += 1 if inline else 2
            if value is None:
                raise UsageError(f"server args: {flag} needs a value")
            if name in _INT_FIELDS:
                try:
                    value = int(value)
                except ValueError:
                    raise UsageError(f"server args: {flag} {value!r} is not an integer") from None
            found[name] = value
        elif flag in _LIST_FLAGS:
            values, i = ([inline] if inline else []), i + 1
            while not inline and i < len(args) and not args[i].startswith("--"):
                values.append(args[i])
                i += 1
            try:
                found[_LIST_FLAGS[flag]] = tuple(sorted({int(v) for v in values}))
            except ValueError:
                raise UsageError(f"server args: {flag} takes integers, got {' '.join(values)}") from None
        elif flag in _BOOL_FLAGS:
            found[_BOOL_FLAGS[flag]] = True
            i += 1
        else:
            i += 1
    return LaunchArgs(**found)


@dataclass(frozen=True)
class NativePlan:
    threshold: int
    steps: int
    effective_threshold: int | None  # after the CUDA-graph padding rule; None when never disabled
    config: dict[str, dict[str, list[int]]] | None
    argv: list[str]
    captured_bs: list[int] | None  # batch sizes sglang pads to (None: no padding)
    warnings: list[str] = field(default_factory=list)

    @property
    def config_json(self) -> str | None:
        return None if self.config is None else json.dumps(self.config, indent=1, sort_keys=True) + "\n"


def _rounded_threshold(threshold: int, captured: list[int] | None) -> int:
    """The largest threshold T <= N for which "speculate iff bs <= T" survives the padding.

    A batch of bs requests is routed by the captured size it pads to; with the nospec slot at key
    T+1, bs speculates iff pad(bs) <= T. That equals bs <= T exactly when T is captured or lies
    above the largest captured size (such batches are not padded).
    """
    if not captured or threshold >= captured[-1] or threshold in captured:
        return threshold
    i = bisect.bisect_right(captured, threshold)
    return captured[i - 1] if i > 0 else 0


def plan_native(threshold: int, steps: int | None = None, *, args: Sequence[str] = (),
                config_path: str = DEFAULT_CONFIG_NAME) -> NativePlan:
    """The adaptive config and launch flags that disable speculation above `threshold` requests."""
    threshold = parse_threshold(threshold)
    launch = parse_launch_args(args)
    if steps is not None and launch.steps is not None and steps != launch.steps:
        raise UsageError(f"steps {steps} disagrees with --speculative-num-steps {launch.steps} in the server args")
    steps = launch.steps if steps is None else steps
    if steps is None or isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"speculative steps must be an integer >= 1 (--speculative-num-steps), got {steps!r}")
    if launch.algorithm is not None and launch.algorithm.upper() not in ("EAGLE", "EAGLE3"):
        raise PreflightError(f"--speculative-algorithm {launch.algorithm}: sglang's adaptive speculation "
                             f"supports EAGLE and EAGLE3 only")
    if launch.topk is not None and launch.topk != 1:
        raise PreflightError(f"--speculative-eagle-topk {launch.topk}: sglang's adaptive speculation needs topk 1")
    if launch.dp_attention:
        raise PreflightError("--enable-dp-attention: sglang's adaptive speculation does not support DP attention "
                             "(batch sizes differ between DP ranks)")
    if launch.adaptive_config is not None:
        raise UsageError(f"the server args already pass --speculative-adaptive-config {launch.adaptive_config}; "
                         f"dynctl generates that file itself")
    warnings: list[str] = []
    if threshold == -1:  # never disable: the configured speculation as it is
        return NativePlan(threshold, steps, None, None, [], None, warnings)
    # Without explicit values sglang picks its own (topk 4 for Llama), which adaptive refuses.
    argv_spec = [] if launch.topk is not None else ["--speculative-eagle-topk", "1"]
    if launch.steps is None:
        argv_spec += ["--speculative-num-steps", str(steps), "--speculative-num-draft-tokens", str(steps + 1)]

    if launch.disable_cuda_graph or launch.disable_cuda_graph_padding:
        captured = None
    elif launch.cuda_graph_bs:
        captured = sorted(launch.cuda_graph_bs)
    else:
        captured = spec_capture_batch_sizes(launch.cuda_graph_max_bs)
    effective = _rounded_threshold(threshold, captured)
    if effective != threshold:
        above = captured[bisect.bisect_right(captured, threshold)] if captured else threshold
        warnings.append(
            f"threshold {threshold} is not a CUDA-graph batch size: sglang pads a batch of {threshold} "
            f"requests to {above} before choosing the config slot, so speculation is disabled above "
            f"{effective} instead (use {effective} or {above} to say so exactly)"
        )
    # sglang requires --speculative-num-steps among the candidates; with threshold 0 no batch size
    # routes to the speculating slot, so it sits at key 0 (batch sizes start at 1).
    config: dict[str, dict[str, list[int]]] = {"1" if effective >= 1 else "0": {"candidate_steps": [steps]}}
    config[str(effective + 1)] = {"candidate_steps": [0]}

    argv = ["--speculative-adaptive", "--speculative-adaptive-config", config_path, *argv_spec]
    running = launch.max_running_requests
    if running is None:
        if effective >= SPEC_DEFAULT_MAX_RUNNING:
            running = -(-2 * (effective + 1) // 8) * 8
            warnings.append(f"sglang caps speculative servers at {SPEC_DEFAULT_MAX_RUNNING} running requests, "
                            f"so the threshold would never fire: adding --max-running-requests {running}")
            argv += ["--max-running-requests", str(running)]
    elif running <= effective:
        warnings.append(f"--max-running-requests {running} is not above the threshold {effective}: "
                        f"speculation is never disabled")
    return NativePlan(threshold, steps, effective, config, argv, captured, warnings)


# --------------------------------------------------------------------------- checking with sglang's own code


class _DropSglangImports(ast.NodeTransformer):
    """Function-level `from sglang... import x` becomes `pass`; x then comes from the stubs."""

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        return ast.Pass() if (node.module or "").startswith("sglang") else node


def exec_release_source(source: str, *, keep: Sequence[str] | None = None, drop: Sequence[str] = (),
                        stubs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Execute pure-Python parts of an sglang source file without sglang (or torch) installed.

    Imports of sglang itself and TYPE_CHECKING blocks are left out; `keep` limits the file to the
    named top-level functions and classes (None: everything except `drop`); `stubs` stand in for the
    sglang names the kept code uses. What runs is the release's own code, as shipped.
    """
    tree = pysource.parse(source)
    body = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        name = getattr(node, "name", None)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            if name in drop or (keep is not None and name not in keep):
                continue
        elif keep is not None and not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        body.append(node)
    tree.body = body
    tree = ast.fix_missing_locations(_DropSglangImports().visit(tree))
    namespace: dict[str, Any] = {"__name__": "sglang_release_source", "log_info_on_rank0": lambda logger, msg: None}
    namespace.update(stubs or {})
    exec(compile(tree, "<sglang release source>", "exec"), namespace)  # noqa: S102 - sglang's own source
    return namespace


def _declare_resolution(server_args: Any, _where: str, **values: Any) -> None:
    for key, value in values.items():
        setattr(server_args, key, value)


def verify_with_release(plan: NativePlan, adaptive_source: str, hook_source: str | None = None,
                        max_batch: int | None = None) -> None:
    """Check `plan` with a ≥ 0.5.14 release's own code; PreflightError names the first disagreement.

    adaptive_source: that release's srt/speculative/adaptive_spec_params.py (config loading and the
    batch-size routing); hook_source: its srt/arg_groups/speculative_hook.py, whose
    _init_adaptive_speculative_params checks the launch args against the config at server start.
    """
    import os
    import tempfile
    import types

    if plan.config_json is None:
        return
    sglang = exec_release_source(adaptive_source, drop=("adaptive_unsupported_reason",))
    fd, path = tempfile.mkstemp(suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(plan.config_json)
        try:
            if hook_source is not None:
                hook = exec_release_source(hook_source, keep=("_init_adaptive_speculative_params",), stubs={
                    "resolve_candidate_steps_from_config": sglang["resolve_candidate_steps_from_config"],
                    "resolving_view": lambda server_args: server_args,
                    "declare_resolution": _declare_resolution,
                })
                server_args = types.SimpleNamespace(speculative_adaptive_config=path, speculative_eagle_topk=1,
                                                    speculative_num_steps=plan.steps,
                                                    speculative_num_draft_tokens=plan.steps + 1)
                hook["_init_adaptive_speculative_params"](server_args)
            params = sglang["AdaptiveSpeculativeParams"](initial_steps=plan.steps, cfg_path=path)
        except (ValueError, KeyError, TypeError, AssertionError) as err:
            raise PreflightError(f"sglang rejects the adaptive config: {err}") from None
    finally:
        os.unlink(path)
    params.set_cuda_graph_bs(plan.captured_bs)
    assert plan.effective_threshold is not None
    top = max_batch or max(2 * plan.effective_threshold + 2, (plan.captured_bs or [1])[-1] + 2)
    for bs in range(1, top + 1):
        want = plan.steps if bs <= plan.effective_threshold else 0
        got = params.get_steps_for_batch(bs)
        if got != want:
            raise PreflightError(f"with this config sglang runs {got} draft steps at batch size {bs}, "
                                 f"the plan says {want}")
