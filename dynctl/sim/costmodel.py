"""How long one forward step takes on the simulated GPU box, and how many tokens it yields.

Calibrated to the seed measurements of SPEC §1 (GLM-5 on 8 GPUs, `--speculative-num-steps 3
--speculative-eagle-topk 1 --speculative-num-draft-tokens 4`):

    concurrency 250, no speculation      ≈ 773 tok/s
    concurrency 250, EAGLE-3 always on   ≈ 354 tok/s
    EAGLE-3 ahead at concurrency 1 only  (≈ +20 % at 1, ≈ -3 % at 2, ≈ -23 % at 4)

Model, in simulated seconds (every figure is divided by --time-scale on the wall clock):

    plain decode, batch b        T = fixed + b * per_request
    EAGLE verify + S draft steps T = fixed + b * D * per_request + S * (draft_fixed + b * draft_per_request)
    step the policy runs plain   T = plain decode + one draft-extend pass (draft_fixed + b * share * draft_per_request)
    prefill of n new tokens      T = fixed + n * prefill_per_token

Per request a plain step yields 1 token; a speculative step yields 1 + the accepted drafts, each of the S
drafts accepted with probability `accept_rate` until the first rejection (mean accept length 2.53 at 0.7
and S=3). Context length does not slow a step; stop strings and EOS never end a request early. The
overhead of a policy-disabled step (the patch's eager decode + draft extend, notes §0.2) was never measured
on a GPU; it is a guess that keeps it about 5 % behind a server without speculation at batch 250.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SEED_CONCURRENCY = 250
SEED_NOSPEC_TOK_S = 773.0
SEED_EAGLE3_TOK_S = 354.0
SEED_STEPS = 3

# The three kinds of decode step the scheduler can run.
PLAIN = "plain"  # no speculative algorithm configured
SPECULATE = "speculate"  # draft + verify
SKIP = "skip"  # speculation configured, but this step runs a plain decode (threshold / adaptive steps 0)


@dataclass(frozen=True)
class Hardware:
    fixed: float = 6.31e-3
    per_request: float = 1.268e-3
    draft_fixed: float = 0.863e-3
    draft_per_request: float = 0.676e-3
    skip_draft_share: float = 0.1
    prefill_per_token: float = 2.0e-5


def decode_step_seconds(hw: Hardware, batch: int, kind: str, steps: int = SEED_STEPS,
                        draft_tokens: int | None = None) -> float:
    if batch <= 0:
        return 0.0
    plain = hw.fixed + batch * hw.per_request
    if kind == PLAIN:
        return plain
    if kind == SKIP:
        return plain + hw.draft_fixed + batch * hw.skip_draft_share * hw.draft_per_request
    verified = draft_tokens if draft_tokens is not None else steps + 1
    return (hw.fixed + batch * verified * hw.per_request
            + steps * (hw.draft_fixed + batch * hw.draft_per_request))


def prefill_step_seconds(hw: Hardware, new_tokens: int) -> float:
    return hw.fixed + new_tokens * hw.prefill_per_token


def expected_accept_length(accept_rate: float, steps: int) -> float:
    """Mean tokens per request per speculative step, the bonus token included (sglang's `accept len`)."""
    return 1.0 + sum(accept_rate ** i for i in range(1, steps + 1))


def draw_accepted_drafts(rng: random.Random, accept_rate: float, steps: int) -> int:
    accepted = 0
    while accepted < steps and rng.random() < accept_rate:
        accepted += 1
    return accepted


def steady_throughput(hw: Hardware, batch: int, kind: str, steps: int = SEED_STEPS,
                      accept_rate: float = 0.7) -> float:
    """Expected decode tokens per simulated second with `batch` requests always running."""
    per_step = batch * (expected_accept_length(accept_rate, steps) if kind == SPECULATE else 1.0)
    return per_step / decode_step_seconds(hw, batch, kind, steps)
