"""Turn speculative decoding off for decode batches larger than a threshold.

`--speculative-disable-batch-threshold N`: a decode step whose batch holds more than N
requests runs a plain target decode instead of draft + verify; at or below N speculation
runs as usual. -1 (or unset) never disables. The value can be changed at runtime through
`/set_internal_state`.

This module holds the policy and its bookkeeping only. It imports nothing outside the
standard library (prometheus_client is imported when metrics are created), so it can be
unit-tested, and loaded by file path, without torch.
"""

from __future__ import annotations

import logging
import os
from operator import attrgetter
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

logger = logging.getLogger(__name__)

ARG_NAME = "speculative_disable_batch_threshold"
NEVER = -1

# What the draft model does on a step without speculation (SGLANG_SPEC_THRESHOLD_DRAFT):
# "extend" runs its draft-extend on the one new token, so its KV cache and hidden state
# stay in step and speculation resumes warm; "skip" runs nothing, so speculation resumes
# cold (the draft's KV for the tokens decoded meanwhile is stale, which lowers its
# acceptance for the requests that lived through the disabled steps; output is unchanged);
# "auto" (the default) extends when the draft is small next to the target. Releases without a
# one-token draft-extend path (sglang 0.5.14 on) skip the draft on those steps in every mode, and
# skip its prefill of the requests that arrive while speculation is disabled unless the mode is
# "extend" (those requests then resume cold too).
DRAFT_MODE_ENV = "SGLANG_SPEC_THRESHOLD_DRAFT"
DRAFT_EXTEND = "extend"
DRAFT_SKIP = "skip"
DRAFT_AUTO = "auto"
DRAFT_MODES = (DRAFT_AUTO, DRAFT_EXTEND, DRAFT_SKIP)
# Keeping the draft warm reads its weights once per disabled step. Measured on an H200 with a
# 5.9 B target and a draft of 6.6 % of its weights, that cost 8-14 % of a plain decode step;
# at 3 % or less it stays within the few percent a disabled step may cost.
WARM_DRAFT_MAX_SHARE = 0.03


def draft_mode(environ: Optional[Dict[str, str]] = None) -> str:
    """The draft mode from the environment; an unknown value falls back to "auto" with a warning."""
    environ = os.environ if environ is None else environ
    value = environ.get(DRAFT_MODE_ENV, DRAFT_AUTO).strip().lower()
    if value not in DRAFT_MODES:
        logger.warning(
            f"{DRAFT_MODE_ENV}={value!r} is not one of {', '.join(DRAFT_MODES)}; using {DRAFT_AUTO}"
        )
        return DRAFT_AUTO
    return value


def weights_read_per_step(model: Any) -> int:
    """Parameters a decode step reads in full: all but the embedding tables (only rows are gathered)."""
    return sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)


def resolve_draft_mode(mode: str, draft_weights: int, target_weights: int) -> str:
    """"extend" or "skip": "auto" keeps the draft warm when it is at most WARM_DRAFT_MAX_SHARE of the target."""
    if mode != DRAFT_AUTO:
        return mode
    if target_weights > 0 and draft_weights <= WARM_DRAFT_MAX_SHARE * target_weights:
        return DRAFT_EXTEND
    return DRAFT_SKIP


def validate_threshold(value: Any) -> Optional[int]:
    """Return `value` as a threshold (None or an int >= -1); raise ValueError otherwise."""
    if value is None:
        return None
    # bool is an int subclass; `True` is a mistake, not a batch size.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{ARG_NAME} must be an integer >= -1 (or null), got {value!r} "
            f"of type {type(value).__name__}"
        )
    if value < NEVER:
        raise ValueError(
            f"{ARG_NAME} must be >= -1 (-1 never disables speculation), got {value}"
        )
    return int(value)


class Decision(NamedTuple):
    speculate: bool
    # The log line for a state change, None when the state stays as it was.
    transition: Optional[str]


class SpecDisablePolicy:
    """Decides per decode step whether to speculate, from the batch size alone.

    The batch size is identical on every TP rank, so every rank takes the same branch
    (a rank that disagreed would run different collectives and hang the group).
    """

    def __init__(self, threshold: Optional[int]):
        self._threshold = validate_threshold(threshold)
        self.enabled = True
        self.disabled_steps = 0

    @property
    def threshold(self) -> Optional[int]:
        return self._threshold

    @threshold.setter
    def threshold(self, value: Optional[int]) -> None:
        self._threshold = validate_threshold(value)

    @property
    def armed(self) -> bool:
        return self._threshold is not None and self._threshold >= 0

    def decide(self, batch_size: int) -> Decision:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"batch size must be an integer >= 0, got {batch_size!r}")
        threshold = self._threshold
        speculate = not self.armed or batch_size <= threshold
        transition = None
        if speculate != self.enabled:
            if not speculate:
                transition = (
                    f"Speculation disabled: batch size {batch_size} > threshold {threshold}"
                )
            elif self.armed:
                transition = (
                    f"Speculation enabled: batch size {batch_size} <= threshold {threshold}"
                )
            else:
                transition = (
                    f"Speculation enabled: batch size {batch_size}, threshold off"
                )
            self.enabled = speculate
        if not speculate:
            self.disabled_steps += 1
        return Decision(speculate, transition)


def known_seq_lens(draft_input: Any, batch: Any) -> Any:
    """The batch's sequence lengths on the host after a plain-decode step, or None.

    A plain step accepts exactly one token per request, so its new lengths are the host copy
    the scheduler already holds plus one, and the scheduler need not copy them back from the
    device. That holds while the rows are the step's rows, or a subset of them (finished or
    retracted requests filtered out): a batch merged with new requests since (its future
    indices lose their interval) reads the lengths back as usual.
    """
    if not getattr(draft_input, "_spec_disable_plain", False):
        return None
    future = getattr(draft_input, "future_indices", None)
    if future is None or future.interval is None or batch.seq_lens_cpu is None:
        return None
    if len(batch.seq_lens_cpu) != len(batch.reqs):
        return None
    return batch.seq_lens_cpu + 1


# Where a request keeps its KV lengths unless a release moved them (a dotted name then, e.g.
# "kv.kv_committed_len"): the default of every function below that reads them.
ALLOCATED_LEN = "kv_allocated_len"
COMMITTED_LEN = "kv_committed_len"


# The speculative worker of this process decides each decode step when the scheduler prepares
# its batch (set_plain_step_decider, once its threshold is armed): a plain-decode step then
# allocates no KV slots while its requests hold enough of those reserved on earlier steps.
_plain_step_decider: Optional[Callable[[Any], bool]] = None


def set_plain_step_decider(decide: Optional[Callable[[Any], bool]]) -> None:
    """The worker's per-step decision, called with the ScheduleBatch being prepared: True for
    a plain-decode step. The worker reuses it for that step (the decision is taken once)."""
    global _plain_step_decider
    _plain_step_decider = decide


def plain_step_holds_slots(
    batch: Any,
    reserve: int,
    allocated: str = ALLOCATED_LEN,
    committed: str = COMMITTED_LEN,
) -> bool:
    """Whether the decode step being prepared is a plain-decode step that needs no new KV slot.

    A speculative step reserves `reserve` slots per request past its committed length
    (sglang's get_alloc_reserve_per_decode: twice the slots one verify writes); a plain step
    writes one, at the request's sequence length. The host's committed length may lag that
    length by the tokens the last verify accepted, reserve // 2 at most, so a request holds
    the slot a plain step writes when reserve // 2 + 1 slots past its committed length are
    allocated. `allocated` and `committed` name the request's two lengths (dotted where a
    release keeps them in a sub-object). When any request holds fewer, the release's own
    allocation tops every request up as on a speculative step.
    """
    decide = _plain_step_decider
    if decide is None or not decide(batch):
        return False
    need = reserve // 2 + 1
    allocated_len, committed_len = attrgetter(allocated), attrgetter(committed)
    return all(allocated_len(r) >= committed_len(r) + need for r in batch.reqs)


def spec_decode_tokens_needed(
    requests: Any,
    reserve: int,
    allocated: str = ALLOCATED_LEN,
    committed: str = COMMITTED_LEN,
) -> int:
    """The KV slots the next speculative decode step allocates with one-token pages: each
    request's shortfall against `reserve` slots past its committed length, summed.

    The value of sglang's _new_tokens_required_next_decode_spec_v2 at page size 1, without its
    two page roundings per request: the scheduler runs it before every decode step, plain or
    speculative (on an H200 host at batch 256, 190 us of the release's loop against 83 us here,
    sampled by py-spy in the same call). `allocated` and `committed` name the request's lengths
    as in plain_step_holds_slots.
    """
    allocated_len, committed_len = attrgetter(allocated), attrgetter(committed)
    total = 0
    for r in requests:
        short = committed_len(r) + reserve - allocated_len(r)
        if short > 0:
            total += short
    return total


def plain_step_tokens(
    result: Any,
    requests: Any,
    worker: Any,
    committed: str = COMMITTED_LEN,
    pre_claimed: bool = False,
    zero: Tuple[str, ...] = (),
) -> List[List[int]]:
    """The scheduler's speculative result for a plain-decode step, settled without its
    per-request slicing: one token per request, no draft accepted.

    The same bookkeeping as the release's loop over a verify of stride 1 and accept length
    1: each live request counts a verify with no correct draft (its histogram's bucket 0)
    and commits its one token; a finished or retracted one commits nothing. `pre_claimed`:
    the release's prepare_for_decode already counted the token's slot as committed (0.5.14),
    so a live request keeps its length and a finished one gives the slot back. `committed`
    names the request's committed length (dotted where a release keeps it in a
    sub-object); `zero` names result fields the release sums over the step's per-request
    extras (none on a plain step). Batches with grammar requests keep the release's loop,
    which advances the grammar.
    """
    tokens = result.next_token_ids.tolist()
    n = len(requests)
    no_drafts = [0] * n
    result.num_correct_drafts = 0
    result.num_correct_drafts_per_req_cpu = no_drafts
    for name in zero:
        setattr(result, name, 0)
    worker.on_verify_complete_cpu(no_drafts, batch_size=n)
    holder, _, length = committed.rpartition(".")
    lens_of = attrgetter(holder) if holder else (lambda req: req)
    # what a finished and a live request add to their committed length
    finished_adds, live_adds = (-1, 0) if pre_claimed else (0, 1)
    for req in requests:
        if req.is_retracted:
            continue
        if req.finished():
            adds = finished_adds
        else:
            adds = live_adds
            req.spec_verify_ct += 1
            histogram = req.spec_correct_drafts_histogram
            if histogram:
                histogram[0] += 1
            else:
                histogram.append(1)
        if adds:
            lens = lens_of(req)
            setattr(lens, length, getattr(lens, length) + adds)
    return [[token] for token in tokens]


def unsupported_reason(server_args: Any) -> Optional[str]:
    """Why the threshold cannot take effect under these server args, or None.

    Read with getattr so that one function serves every sglang release that carries
    the flag (fields come and go between releases).
    """

    def arg(name: str, default: Any = None) -> Any:
        return getattr(server_args, name, default)

    algorithm = arg("speculative_algorithm")
    if algorithm is None:
        return "speculative decoding is off"
    if str(algorithm).upper() not in ("EAGLE", "EAGLE3"):
        return f"speculative_algorithm={algorithm} (only EAGLE and EAGLE3 are supported)"
    if arg("disable_overlap_schedule", False):
        return (
            "spec v2 is not in use (the overlap scheduler is disabled); "
            "only the spec v2 worker implements the threshold (SGLANG_ENABLE_SPEC_V2=1)"
        )
    topk = arg("speculative_eagle_topk")
    if topk is not None and topk != 1:
        return f"speculative_eagle_topk={topk} (only topk=1 is supported)"
    if arg("enable_dp_attention", False):
        return (
            "DP attention is enabled (batch sizes differ between DP ranks, "
            "so the ranks would not take the same branch)"
        )
    if arg("enable_multi_layer_eagle", False):
        return "enable_multi_layer_eagle=True (MultiLayerEagleWorkerV2 has no plain-decode path)"
    if arg("enable_two_batch_overlap", False):
        return "enable_two_batch_overlap=True is not supported"
    if arg("enable_pdmux", False):
        return "enable_pdmux=True is not supported"
    if arg("speculative_adaptive", False):
        return "speculative_adaptive=True already chooses the step count per batch"
    return None


def check_threshold_args(server_args: Any) -> None:
    """Validate the threshold at startup; log one line when it cannot take effect."""
    threshold = validate_threshold(getattr(server_args, ARG_NAME, None))
    if threshold is None or threshold < 0:
        return
    reason = unsupported_reason(server_args)
    if reason is not None:
        logger.warning(
            f"{ARG_NAME}={threshold} is not armed: {reason}. Speculation is never disabled."
        )
        return
    max_running = getattr(server_args, "max_running_requests", None)
    if max_running is not None and threshold >= max_running:
        logger.warning(
            f"{ARG_NAME}={threshold} never fires: max_running_requests={max_running} "
            f"caps the batch size at or below the threshold."
        )


class SpecDisableMetrics:
    """`sglang:spec_enabled`, `sglang:spec_disable_threshold` and
    `sglang:spec_disabled_steps_total`, with the labels of the scheduler's collector."""

    def __init__(self, labels: Dict[str, Any], registry: Any = None):
        # Imported here: sglang sets PROMETHEUS_MULTIPROC_DIR before any metric exists.
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = registry if registry is not None else REGISTRY
        self.labels = dict(labels)
        names = list(self.labels)
        self.spec_enabled = Gauge(
            name="sglang:spec_enabled",
            documentation="1 while decode steps speculate, 0 while the batch-size threshold disables speculation.",
            labelnames=names,
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.spec_disable_threshold = Gauge(
            name="sglang:spec_disable_threshold",
            documentation="speculative_disable_batch_threshold in force (-1: never disable).",
            labelnames=names,
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.spec_disabled_steps_total = Counter(
            name="sglang:spec_disabled_steps_total",
            documentation="Decode steps run without speculation because of the batch-size threshold.",
            labelnames=names,
            registry=registry,
        )
        self._enabled = self.spec_enabled.labels(**self.labels)
        self._threshold = self.spec_disable_threshold.labels(**self.labels)
        self._disabled = self.spec_disabled_steps_total.labels(**self.labels)
        self._last = None

    def observe(self, policy: SpecDisablePolicy, decision: Decision) -> None:
        """Record one decode step's decision (gauges are written only when they change)."""
        threshold = NEVER if policy.threshold is None else policy.threshold
        state = (decision.speculate, threshold)
        if state != self._last:
            self._enabled.set(1 if decision.speculate else 0)
            self._threshold.set(threshold)
            self._last = state
        if not decision.speculate:
            self._disabled.inc(1)
