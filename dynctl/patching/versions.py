"""Which sglang releases get which strategy, and what a valid threshold is."""

from __future__ import annotations

from dynctl import hostspec
from dynctl.config import STRATEGIES
from dynctl.errors import PreflightError, UsageError
from dynctl.sglang import parse_version

SUPPORTED = ("patch for sglang 0.5.6–0.5.12 and 0.5.14, native adaptive config for sglang ≥ 0.5.14 "
             "(the default for releases without a patch variant)")
MAX_THRESHOLD = hostspec.MAX_THRESHOLD

# Releases whose eagle_worker_v2 needs its own small compat methods (see patches/README.md).
_VARIANTS = {6: "0.5.6", 7: "0.5.7", 8: "0.5.8", 9: "0.5.8", 10: "0.5.8", 11: "0.5.8", 12: "0.5.12",
             14: "0.5.14"}
_NATIVE_FROM = (0, 5, 14)


def _has_variant(parsed: tuple[int, ...]) -> bool:
    return parsed[:2] == (0, 5) and parsed[2] in _VARIANTS


def strategy_for(version: str, preference: str = "auto") -> str:
    """"patch" or "native" for a supported sglang release and the host's `strategy` preference;
    PreflightError (exit 3) for an unsupported release or a strategy the release cannot take."""
    parsed = parse_version(version)
    if parsed is None:
        raise PreflightError(
            f"sglang {version!r} is not a release version (dev, rc and local builds are not "
            f"supported); supported: {SUPPORTED}"
        )
    if preference not in STRATEGIES:
        raise UsageError(f"strategy {preference!r}: expected one of {', '.join(STRATEGIES)}")
    patch, native = _has_variant(parsed), parsed >= _NATIVE_FROM
    if not patch and not native:
        if parsed[:2] == (0, 5) and parsed[2] == 13:
            raise PreflightError(
                f"sglang {version} is not supported: its speculative worker was rewritten around "
                f"ScheduleBatch and its adaptive mode cannot disable speculation (no steps=0); "
                f"upgrade to 0.5.14 or later; supported: {SUPPORTED}"
            )
        raise PreflightError(
            f"sglang {version} is too old: before 0.5.6 the spec v2 worker used a different KV "
            f"allocation model; supported: {SUPPORTED}"
        )
    if preference == "native" and not native:
        raise PreflightError(
            f'strategy = "native" cannot serve sglang {version}: the native strategy needs adaptive '
            f'speculation with steps 0, from sglang 0.5.14; use strategy = "auto" or "patch" for this release'
        )
    if preference == "patch" and not patch:
        raise PreflightError(
            f'strategy = "patch" cannot serve sglang {version}: dynctl has no patch variant for it '
            f'(variants: {", ".join(sorted(set(_VARIANTS.values()), key=parse_version))}); '
            f'use strategy = "auto" or "native"'
        )
    if preference == "native" or not patch:
        return "native"
    return "patch"


def variant_for(version: str) -> str:
    """The compat variant of the eagle_worker_v2 patch for a release that has one."""
    parsed = parse_version(version)
    if parsed is None or not _has_variant(parsed):
        strategy_for(version)  # the refusal for an unsupported release, if it is one
        raise PreflightError(f"sglang {version} uses the native strategy: no file is patched")
    return _VARIANTS[parsed[2]]


def parse_threshold(value: object, where: str = "threshold") -> int:
    """A threshold from the command line, a dialog or a config: an integer from -1 to 1,000,000."""
    if problem := hostspec.threshold_problem(value):
        raise UsageError(f"{where}: {problem}")
    return int(str(value).strip())
