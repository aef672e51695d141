"""Per decode step: speculate or not, with how many draft steps, and on a CUDA graph or eagerly.

Three regimes, as the real server has them:
  * no `--speculative-algorithm`: every step is a plain decode;
  * EAGLE/EAGLE3 on an unpatched tree: every step speculates;
  * the patch (`speculative/spec_batch_threshold.py`, loaded from the tree by file path): its
    SpecDisablePolicy decides from the batch size; a disabled step is a plain decode on the patch's
    plain-decode CUDA graphs, which it captures when the flag is given at startup (a server started
    without it and given a threshold later decodes eagerly: `decode_none`);
  * native adaptive (sglang ≥ 0.5.14, `--speculative-adaptive`): the batch size is padded up to the next
    captured CUDA-graph batch size and routed to the largest config key ≤ it; steps 0 runs a trivial
    verify on its own D=1 graph (0.5.14 `speculative/adaptive_spec_params.py`, ported below).
"""

from __future__ import annotations

import ast
import bisect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from dynctl.base import sglang
from dynctl.sim.costmodel import PLAIN, SKIP, SPECULATE

THRESHOLD_ARG = sglang.THRESHOLD_KEY


@dataclass(frozen=True)
class StepPlan:
    kind: str
    steps: int = 0
    draft_tokens: int = 1
    cuda_graph: bool = True
    transition: str | None = None


def captured_batch_sizes(args: dict[str, Any]) -> list[int]:
    """ServerArgs._generate_cuda_graph_batch_sizes (server_args.py:1079-1107), capped like
    cuda_graph_runner.get_batch_sizes_to_capture by the request pool (max running requests)."""
    max_bs = args.get("cuda_graph_max_bs") or 160
    if args.get("disable_cuda_graph"):
        return []
    if args.get("cuda_graph_bs"):
        sizes = list(args["cuda_graph_bs"])
    elif args.get("disable_cuda_graph_padding"):
        sizes = list(range(1, max_bs + 1))
    else:
        sizes = sglang.cuda_graph_batch_sizes(max_bs, speculative=args.get("speculative_algorithm") is not None)
    sizes = [bs for bs in sizes if bs <= max_bs]
    pool = args.get("max_running_requests")
    if pool:
        if sizes and max(sizes) > pool:
            sizes.append(pool)
        sizes = [bs for bs in sizes if bs <= pool]
    return sorted(set(sizes))


class Speculation:
    """Plain decode on every step (no speculative algorithm) — also the base of the others."""

    def __init__(self, args: dict[str, Any]):
        self.args = args
        self.capture = captured_batch_sizes(args)

    def on_graph(self, batch: int) -> bool:
        return bool(self.capture) and batch <= self.capture[-1]

    def decide(self, batch: int) -> StepPlan:
        return StepPlan(PLAIN, cuda_graph=self.on_graph(batch))

    def after_verify(self, batch: int, accepted: list[int]) -> str | None:
        """Feed one verify's accepted-draft counts back; returns a log line when something changed."""
        return None

    def observe_metrics(self, plan: StepPlan) -> None:
        pass

    def set_threshold(self, value: Any) -> None:
        raise KeyError(THRESHOLD_ARG)


class AlwaysSpeculate(Speculation):
    def decide(self, batch: int) -> StepPlan:
        steps = self.args.get("speculative_num_steps") or 3
        draft = self.args.get("speculative_num_draft_tokens") or steps + 1
        return StepPlan(SPECULATE, steps, draft, self.on_graph(batch))


class ThresholdSpeculation(AlwaysSpeculate):
    """The patch's policy. Refuses to arm (and says why, via the module) where the patch would."""

    def __init__(self, args: dict[str, Any], module: ModuleType, labels: dict[str, str], registry: Any):
        super().__init__(args)
        self.module = module
        self.policy = module.SpecDisablePolicy(args.get(THRESHOLD_ARG))
        self.unsupported = module.unsupported_reason(ArgsView(args))
        self.metrics = module.SpecDisableMetrics(labels, registry=registry) if registry is not None else None
        self._last_decision = None

    def decide(self, batch: int) -> StepPlan:
        base = super().decide(batch)
        if self.unsupported is not None:
            return base
        decision = self.policy.decide(batch)
        self._last_decision = decision
        if decision.speculate:
            return StepPlan(SPECULATE, base.steps, base.draft_tokens, base.cuda_graph, decision.transition)
        graphs = base.cuda_graph and self.args.get(THRESHOLD_ARG) is not None
        return StepPlan(SKIP, 0, base.draft_tokens, graphs, decision.transition)

    def observe_metrics(self, plan: StepPlan) -> None:
        if self.metrics is not None and self._last_decision is not None:
            self.metrics.observe(self.policy, self._last_decision)

    def set_threshold(self, value: Any) -> None:
        self.policy.threshold = value  # validates; raises ValueError like the patch's scheduler hook

    @property
    def threshold(self) -> Any:
        return self.policy.threshold


class AdaptiveSpeculation(AlwaysSpeculate):
    """0.5.14 AdaptiveSpeculativeParams + AdaptiveStepSlot (speculative/adaptive_spec_params.py)."""

    def __init__(self, args: dict[str, Any], default_config: dict[str, dict]):
        super().__init__(args)
        path = args.get("speculative_adaptive_config")
        if path is not None:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        else:
            config = default_config
        entries = {}
        for key, entry in config.items():
            if not key.isdigit():
                continue
            steps = entry.get("candidate_steps")
            if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s >= 0 for s in steps):
                raise ValueError(f"BS {key}: candidate_steps must be a list of non-negative ints, got {steps!r}")
            entries[int(key)] = entry
        if not entries:
            raise ValueError(
                "speculative_adaptive_config must contain at least one integer-string BS key, e.g. "
                f'{{"1": {{"candidate_steps": [1,3,7]}}}}. Got keys: {list(config.keys())}')
        initial = args.get("speculative_num_steps") or 3
        self.slots = {bs: _Slot(initial, {**config, **entry}) for bs, entry in sorted(entries.items())}
        self.keys = sorted(self.slots)
        first = self.slots[self.keys[0]]
        self.startup_line = (f"AdaptiveSpeculativeParams initialized: steps={first.current_steps}, "
                             f"candidate_steps={first.candidates}")

    def route(self, batch: int) -> "_Slot":
        padded = batch
        if self.capture:
            i = bisect.bisect_left(self.capture, batch)
            padded = self.capture[i] if i < len(self.capture) else batch
        i = bisect.bisect_right(self.keys, padded) - 1
        return self.slots[self.keys[max(0, i)]]

    def decide(self, batch: int) -> StepPlan:
        steps = self.route(batch).current_steps
        graph = self.on_graph(batch)
        if steps == 0:
            return StepPlan(SKIP, 0, 1, graph)
        return StepPlan(SPECULATE, steps, steps + 1, graph)

    def after_verify(self, batch: int, accepted: list[int]) -> str | None:
        return self.route(batch).update(accepted)


class _Slot:
    def __init__(self, initial_steps: int, cfg: dict):
        self.candidates = sorted(set(cfg["candidate_steps"]))
        self.alpha = cfg.get("ema_alpha", 0.2)
        self.interval = cfg.get("update_interval", 5)
        self.warmup = cfg.get("warmup_batches", 10)
        self.down = cfg.get("down_hysteresis", -0.25)
        self.up = cfg.get("up_hysteresis", 0.0)
        self.current_steps = (initial_steps if initial_steps in self.candidates
                              else self.candidates[len(self.candidates) // 2])
        self.ema = float(self.current_steps - 1)
        self.count = 0

    def update(self, accepted: list[int]) -> str | None:
        if not accepted:
            return None
        if self.current_steps > 0:
            self.ema = (1 - self.alpha) * self.ema + self.alpha * sum(accepted) / len(accepted)
        self.count += 1
        if self.count <= self.warmup or (self.count - self.warmup) % self.interval:
            return None
        old = self.current_steps
        idx = self.candidates.index(old)
        if old == 0:
            idx = min(idx + 1, len(self.candidates) - 1)
            if self.candidates[idx] > 0 and self.ema < 0:
                self.ema = float(self.candidates[idx] - 1)
        else:
            start = idx
            while idx > 0:
                prev = self.candidates[idx - 1]
                if self.ema <= (0.5 if prev == 0 else prev - 0.5) + self.down:
                    idx -= 1
                else:
                    break
            if idx == start:
                while idx < len(self.candidates) - 1 and self.ema > self.candidates[idx] - 0.5 + self.up:
                    idx += 1
        target = self.candidates[idx]
        if target == old:
            return None
        self.current_steps = target
        return f"Adaptive spec params updated: steps {old} -> {target} (ema_accept_len={self.ema:.2f})"


class ArgsView:
    """Attribute view of the server args dict, for code written against ServerArgs."""

    def __init__(self, args: dict[str, Any]):
        self.__dict__.update(args)


def build_speculation(args: dict[str, Any], policy_module: ModuleType | None, adaptive_defaults: dict | None,
                      labels: dict[str, str], registry: Any, log: logging.Logger) -> Speculation:
    if args.get("speculative_algorithm") not in ("EAGLE", "EAGLE3"):
        return Speculation(args)
    if args.get("speculative_adaptive") and adaptive_defaults is not None:
        speculation = AdaptiveSpeculation(args, adaptive_defaults)
        log.info(speculation.startup_line)
        return speculation
    if policy_module is not None and THRESHOLD_ARG in args:
        return ThresholdSpeculation(args, policy_module, labels, registry)
    return AlwaysSpeculate(args)


def read_adaptive_defaults(path: Path) -> dict | None:
    """DEFAULT_ADAPTIVE_CONFIG of a tree's speculative/adaptive_spec_params.py (0.5.14+), read from its AST."""
    try:
        module = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    for node in module.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "DEFAULT_ADAPTIVE_CONFIG" and node.value is not None:
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None
