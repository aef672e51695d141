"""Which sglang releases get which strategy, and what a valid threshold is."""

from __future__ import annotations

from dynctl.base import hostspec
from dynctl.base.config import STRATEGIES
from dynctl.base.errors import PreflightError, UsageError
from dynctl.patching.recipe import Release, releases
from dynctl.base.sglang import parse_version

SUPPORTED = ("patch for sglang 0.5.6–0.5.12 and 0.5.14–0.5.23 (measured on a GPU: 0.5.8–0.5.12 and "
             "0.5.14–0.5.17; 0.5.6 and 0.5.7, which have no native route, patched unmeasured; 0.5.18–0.5.23 "
             "on only with strategy = \"patch\"), native adaptive config for sglang ≥ 0.5.14 "
             "(the default for releases without a measured patch variant)")
MAX_THRESHOLD = hostspec.MAX_THRESHOLD

_NATIVE_FROM = (0, 5, 14)


def _release(version: str) -> Release | None:
    """The table's entry for `version`: its own, else its base release's (0.5.15.post2 -> 0.5.15)."""
    table = releases()
    if version in table:
        return table[version]
    parsed = parse_version(version)
    return None if parsed is None else table.get(".".join(map(str, parsed)))


def _has_variant(version: str) -> bool:
    return _release(version) is not None


def is_measured(version: str) -> bool:
    """Whether the patch variant for `version` was measured on a GPU (False without a variant)."""
    release = _release(version)
    return release is not None and release.measured


def unmeasured_note(version: str) -> str | None:
    """What plan, deploy and status say when the patch for `version` is not marked measured on a GPU."""
    release = _release(version)
    if release is None or release.measured:
        return None
    return (f"patch not measured on a GPU for sglang {version}: it passes every CPU check, but its "
            f"disabled-step cost and correctness were not measured")


def shortfall(version: str) -> str | None:
    """The targets the GPU runs of a measured release fall short of, in words (None where it meets them)."""
    release = _release(version)
    if release is None or not release.measured or not release.misses:
        return None
    return f"short of a target: {release.misses}"


def patch_note(version: str) -> str | None:
    """What plan and status say beside a patch for `version`: that it is not measured on a GPU, or the
    targets its GPU runs fall short of (None for a measured release that meets them)."""
    if (note := unmeasured_note(version)) is not None:
        return note
    short = shortfall(version)
    return None if short is None else f"patch measured on a GPU; {short}"


def strategy_for(version: str, preference: str = "auto") -> str:
    """"patch" or "native" for a supported sglang release and the host's `strategy` preference
    ("auto" patches only where the variant was measured on a GPU);
    PreflightError (exit 3) for an unsupported release or a strategy the release cannot take."""
    parsed = parse_version(version)
    if parsed is None:
        raise PreflightError(
            f"sglang {version!r} is not a release version (dev, rc and local builds are not "
            f"supported); supported: {SUPPORTED}"
        )
    if preference not in STRATEGIES:
        raise UsageError(f"strategy {preference!r}: expected one of {', '.join(STRATEGIES)}")
    patch, native = _has_variant(version), parsed >= _NATIVE_FROM
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
            f'(variants: {", ".join(sorted({r.variant for r in releases().values()}, key=parse_version))}); '
            f'use strategy = "auto" or "native"'
        )
    if preference == "native" or not patch:
        return "native"
    if preference == "auto" and native and not is_measured(version):
        return "native"  # an unmeasured variant is taken only when asked for by name
    return "patch"


def variant_for(version: str) -> str:
    """The compat variant of the eagle_worker_v2 patch for a release that has one."""
    release = _release(version)
    if release is None:
        strategy_for(version)  # the refusal for an unsupported release, if it is one
        raise PreflightError(f"sglang {version} uses the native strategy: no file is patched")
    return release.variant


def strategy_note(version: str, strategy: str) -> str | None:
    """What `dynctl status` says beside the strategy: measured or not, and a variant that "auto" leaves aside."""
    if not _has_variant(version):
        return None
    if strategy == "patch":
        return patch_note(version) or "patch measured on a GPU"
    if strategy == "native" and not is_measured(version):
        return (f'a patch variant for sglang {version} exists but is not measured on a GPU; '
                f'strategy = "patch" takes it')
    return None


def parse_threshold(value: object, where: str = "threshold") -> int:
    """A threshold from the command line, a dialog or a config: an integer from -1 to 1,000,000."""
    if problem := hostspec.threshold_problem(value):
        raise UsageError(f"{where}: {problem}")
    return int(str(value).strip())
