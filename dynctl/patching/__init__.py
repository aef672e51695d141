"""The speculation patch: version → strategy, and the pure patch planner (see patches/README.md)."""

from dynctl.patching.engine import TARGET_FILES, FileChange, PatchRefused, Plan, plan_patch, sha256_text
from dynctl.patching.versions import MAX_THRESHOLD, SUPPORTED, parse_threshold, parse_version, strategy_for, variant_for

__all__ = [
    "MAX_THRESHOLD",
    "SUPPORTED",
    "TARGET_FILES",
    "FileChange",
    "PatchRefused",
    "Plan",
    "parse_threshold",
    "parse_version",
    "plan_patch",
    "sha256_text",
    "strategy_for",
    "variant_for",
]
