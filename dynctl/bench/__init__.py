"""`dynctl bench`, UI-free: closed-loop concurrency sweep, mode comparison, threshold recommendation, charts.

The load generator runs on the host as the agent's `bench_level` verb; this package plans the run,
switches modes, turns raw timings into vLLM-named statistics and writes JSON and charts.
"""

from dynctl.bench.events import (
    BenchEvent,
    BenchStarted,
    LevelDone,
    LevelProgress,
    LevelStarted,
    ModeStarted,
    ThresholdRestored,
)
from dynctl.bench.plan import BenchPlan, Mode, parse_concurrency, parse_goodput, plan_modes
from dynctl.bench.runner import BenchInterrupted, BenchResult, ModeRun, run_bench

__all__ = [
    "BenchEvent", "BenchInterrupted", "BenchPlan", "BenchResult", "BenchStarted", "LevelDone",
    "LevelProgress", "LevelStarted", "Mode", "ModeRun", "ModeStarted", "ThresholdRestored", "parse_concurrency",
    "parse_goodput", "plan_modes", "run_bench",
]
