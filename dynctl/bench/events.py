"""Bench's sub-family of `dynctl.base.events`: levels and modes. The CLI renders them with rich, the TUI in its panel.

A bench run reports these and the shared `dynctl.base.events.Warning` and `Finished`; a mode switched by
redeploy adds the deploy's own events to the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynctl.bench.plan import Mode


@dataclass(frozen=True)
class BenchStarted:
    host: str
    where: str  # the server's address as the load generator sees it
    model: str | None
    levels: tuple[int, ...]
    modes: tuple[Mode, ...]
    budget: str  # per level: "30 s" or "200 requests"


@dataclass(frozen=True)
class ModeStarted:
    mode: Mode
    threshold_in_force: int | None  # read back from the server; None when the mode leaves it alone


@dataclass(frozen=True)
class LevelStarted:
    mode: Mode
    concurrency: int
    index: int  # 1-based over the whole run (all modes)
    total: int


@dataclass(frozen=True)
class LevelProgress:
    mode: Mode
    concurrency: int
    phase: str  # "warmup" or "measure"
    elapsed: float
    window_elapsed: float | None
    completed: int
    failed: int
    running: float | None  # the server's own batch size, last sample


@dataclass(frozen=True)
class LevelDone:
    mode: Mode
    level: dict[str, Any]  # the vLLM-shaped result (see dynctl.bench.stats)


@dataclass(frozen=True)
class ThresholdRestored:
    threshold: int


BenchEvent = BenchStarted | ModeStarted | LevelStarted | LevelProgress | LevelDone | ThresholdRestored
