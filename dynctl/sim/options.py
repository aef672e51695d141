"""The simulator's own knobs (speed, start-up length, fault switches), from `--sim-*` flags or DYNCTL_SIM_* env.

They are taken out of argv before sglang's parser sees the rest, so a launch line stays an sglang launch
line with a few extra flags in front. A flag wins over its environment variable.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path

ENV_PREFIX = "DYNCTL_SIM_"


class OptionError(ValueError):
    """A simulator option with a value it cannot use; the message names the flag or variable."""


@dataclass(frozen=True)
class SimOptions:
    # How much faster than the measured GPU (costmodel.py's table) the simulated one runs. Divides every
    # simulated duration: decode/prefill step times, model loading, warm-up, the SIGTERM watchdog period
    # and the /health wait. Reported throughput is wall-clock, so it is time_scale times the table's figure.
    time_scale: float = 1.0
    # Simulated seconds the schedulers spend "loading weights" and capturing graphs before the port opens.
    load_seconds: float = 4.0
    # Acceptance probability of each draft token; None: the one that gives the table's accept length.
    accept_rate: float | None = None
    seed: int = 0
    # Where the fake nvidia-smi reads GPU state; None: GPU memory is not published.
    gpu_dir: Path | None = None
    # --- fault switches (wall-clock seconds, not scaled) ---
    crash_after: float | None = None  # scheduler TP0 dies this long after start
    hang_on_start: bool = False  # schedulers never finish loading; the port never opens
    ignore_sigterm: bool = False  # SIGTERM is ignored (stop must escalate to SIGKILL)
    orphan_child: bool = False  # a setsid()ed grandchild keeps the listening socket after the server dies
    orphan_lifetime: float = 600.0  # so a forgotten orphan still goes away by itself
    slow_health: float = 0.0  # extra seconds /health and /health_generate take
    # extra seconds /server_info takes (sglang asks the scheduler, which answers between two steps: a long
    # step, a large prefill say, holds the answer)
    slow_server_info: float = 0.0


_FLAGS = {
    "time_scale": ("--time-scale", float),
    "load_seconds": ("--sim-load-seconds", float),
    "accept_rate": ("--sim-accept-rate", float),
    "seed": ("--sim-seed", int),
    "gpu_dir": ("--sim-gpu-dir", Path),
    "crash_after": ("--sim-crash-after", float),
    "hang_on_start": ("--sim-hang-on-start", bool),
    "ignore_sigterm": ("--sim-ignore-sigterm", bool),
    "orphan_child": ("--sim-orphan-child", bool),
    "orphan_lifetime": ("--sim-orphan-lifetime", float),
    "slow_health": ("--sim-slow-health", float),
    "slow_server_info": ("--sim-slow-server-info", float),
}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def split_sim_options(argv: list[str], environ: dict[str, str] | None = None) -> tuple[SimOptions, list[str]]:
    """Take the simulator's flags out of argv; return them with the sglang arguments left over."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name, (flag, kind) in _FLAGS.items():
        if kind is bool:
            parser.add_argument(flag, dest=name, action="store_true", default=None)
        else:
            parser.add_argument(flag, dest=name, type=str, default=None)
    known, rest = parser.parse_known_args(argv)
    values = {}
    for f in fields(SimOptions):
        flag, kind = _FLAGS[f.name]
        raw = getattr(known, f.name)
        where = flag
        if raw is None and env_name(f.name) in environ:
            raw, where = environ[env_name(f.name)], env_name(f.name)
        if raw is None:
            continue
        values[f.name] = _convert(raw, kind, where)
    options = SimOptions(**values)
    _check(options)
    return options, rest


def _convert(raw: object, kind: type, where: str) -> object:
    if kind is bool:
        if raw is True:
            return True
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("", "0", "false", "no", "off"):
            return False
        raise OptionError(f"{where}: expected 1/0 or true/false, got {raw!r}")
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise OptionError(f"{where}: expected {kind.__name__}, got {raw!r}") from None


def _check(o: SimOptions) -> None:
    if not o.time_scale > 0:
        raise OptionError(f"--time-scale must be > 0, got {o.time_scale}")
    if o.load_seconds < 0:
        raise OptionError(f"--sim-load-seconds must be >= 0, got {o.load_seconds}")
    if o.accept_rate is not None and not 0.0 <= o.accept_rate <= 1.0:
        raise OptionError(f"--sim-accept-rate must be in [0, 1], got {o.accept_rate}")
    for name in ("crash_after", "orphan_lifetime", "slow_health"):
        value = getattr(o, name)
        if value is not None and value < 0:
            raise OptionError(f"{_FLAGS[name][0]} must be >= 0, got {value}")


def scaled(options: SimOptions, simulated_seconds: float) -> float:
    """Wall-clock seconds for a simulated duration."""
    return simulated_seconds / options.time_scale
