"""What a bench run measures: concurrency levels, lengths, per-level budget, goodput SLOs and modes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynctl.base.errors import UsageError

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # the SLO names of `vllm bench serve --goodput`
MAX_CONCURRENCY = 4096
DEFAULT_DURATION = 30.0  # seconds measured per level


@dataclass(frozen=True)
class Mode:
    """How the server speculates during one sweep: `threshold` None leaves it as deployed."""

    name: str
    threshold: int | None

    @classmethod
    def as_deployed(cls) -> Mode:
        return cls("as deployed", None)

    @classmethod
    def no_spec(cls) -> Mode:
        return cls("no-spec", 0)  # speculation only at batch <= 0: never

    @classmethod
    def always_spec(cls) -> Mode:
        return cls("always-spec", -1)  # -1 disarms the threshold: speculation at every batch size

    @classmethod
    def at(cls, threshold: int) -> Mode:
        return cls(f"threshold {threshold}", threshold)


@dataclass(frozen=True)
class BenchPlan:
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    input_len: int = 512
    output_len: int = 128
    duration: float | None = None  # neither given: DEFAULT_DURATION
    num_prompts: int | None = None
    warmup: int | None = None  # None: one request per worker, so the window opens on a full batch
    goodput: dict[str, float] = field(default_factory=dict)
    modes: tuple[Mode, ...] = (Mode.as_deployed(),)
    compare: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration is None and self.num_prompts is None:
            object.__setattr__(self, "duration", DEFAULT_DURATION)
        if (self.duration is None) == (self.num_prompts is None):
            raise UsageError("give either --duration or --num-prompts, not both")
        if self.duration is not None and not (self.duration > 0 and math.isfinite(self.duration)):
            raise UsageError(f"--duration: expected a positive number of seconds, got {self.duration}")
        for name, value in (("--num-prompts", self.num_prompts), ("--input-len", self.input_len),
                            ("--output-len", self.output_len)):
            if value is not None and value < 1:
                raise UsageError(f"{name}: expected a positive integer, got {value}")
        if self.warmup is not None and self.warmup < 0:
            raise UsageError(f"--warmup: expected 0 or more requests, got {self.warmup}")
        if not self.concurrency:
            raise UsageError("--concurrency: no level given")

    def warmup_for(self, concurrency: int) -> int:
        return concurrency if self.warmup is None else self.warmup

    @property
    def budget(self) -> str:
        return f"{self.duration:g} s" if self.duration is not None else f"{self.num_prompts} requests"


def parse_concurrency(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); a bad item is named in the error."""
    if not text.strip():
        raise UsageError("--concurrency: empty list (expected e.g. 1,2,4)")
    levels: list[int] = []
    for pos, raw in enumerate(text.split(","), 1):
        item = raw.strip()
        if not item:
            raise UsageError(f"--concurrency {text!r}: item {pos} is empty (expected e.g. 1,2,4)")
        if not item.isdigit():
            raise UsageError(f"--concurrency {text!r}: item {pos} {item!r} is not a positive integer")
        value = int(item)
        if not 1 <= value <= MAX_CONCURRENCY:
            raise UsageError(f"--concurrency {text!r}: item {pos} {item!r} must be between 1 and {MAX_CONCURRENCY}")
        if value in levels:
            raise UsageError(f"--concurrency {text!r}: item {pos} {item!r} is given twice")
        levels.append(value)
    return tuple(levels)


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """vLLM's `--goodput ttft:200 tpot:50` (milliseconds); commas work as separators too."""
    slos: dict[str, float] = {}
    for raw in items:
        for item in filter(None, (p.strip() for p in raw.replace(",", " ").split())):
            name, sep, value = item.partition(":")
            if not sep or name not in GOODPUT_METRICS:
                raise UsageError(
                    f"--goodput {item!r}: expected NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}"
                )
            try:
                ms = float(value)
            except ValueError:
                raise UsageError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
            if not (ms >= 0 and math.isfinite(ms)):
                raise UsageError(f"--goodput {item!r}: the limit must be a non-negative number of milliseconds")
            slos[name] = ms
    return slos


def plan_modes(compare: bool, thresholds: Sequence[int]) -> tuple[Mode, ...]:
    """--compare: no-spec, always-spec, then each threshold; else the thresholds alone, else as deployed."""
    for t in thresholds:
        if t < -1:
            raise UsageError(f"--threshold {t}: expected -1 (always speculate), 0 (never) or a batch size")
    extra = tuple(Mode.at(t) for t in dict.fromkeys(thresholds) if t not in (0, -1) or not compare)
    if compare:
        return (Mode.no_spec(), Mode.always_spec(), *extra)
    return extra or (Mode.as_deployed(),)
