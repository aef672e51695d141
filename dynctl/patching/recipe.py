"""What the patch inserts into each sglang file, and where (anchors), per variant: patches/variants.toml.

Every change is an insertion of a fragment from `patches/fragments/` next to an anchor that
must occur exactly once, at the start of a line. Insertions only (nothing is deleted), so a
patched file can be un-patched by removing the fragments again, which is how an applied
patch is recognised and checked for hand edits.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from dynctl.agent import archive
from dynctl.base import pysource, sglang

PACKAGE_PREFIX = "srt/"
SERVER_ARGS = "srt/server_args.py"
SCHEDULER = "srt/managers/scheduler.py"
EAGLE_WORKER = "srt/speculative/eagle_worker_v2.py"
NEW_MODULE = "srt/speculative/spec_batch_threshold.py"

# Names only the patch brings into these files: their presence outside our fragments means a
# file was patched and then edited.
FEATURE_TOKENS = (
    sglang.THRESHOLD_KEY, "spec_batch_threshold", "_skip_speculation",
    "_forward_batch_generation_no_spec", "_spec_disable_",
)


@dataclass(frozen=True)
class Insertion:
    what: str  # said in refusals: "the speculative_num_draft_tokens field"
    fragment: str  # a file of patches/fragments/, or a joined fragment of patches/variants.toml
    anchor: str = ""  # exact text, starting at a line start, that must occur exactly once
    before: bool = False  # insert before the anchor instead of after it
    at_end: bool = False  # append at the end of the file (anchor unused)
    dedent: int = 0  # spaces taken off each line of the fragment (the same code one block further out)

    @property
    def text(self) -> str:
        text = fragment_text(self.fragment)
        if not self.dedent:
            return text
        cut = " " * self.dedent
        return "".join(line.removeprefix(cut) for line in text.splitlines(keepends=True))


@dataclass(frozen=True)
class FileRecipe:
    path: str  # relative to the sglang package directory
    insertions: tuple[Insertion, ...]
    # Structural checks on the original text: each returns a problem description or None.
    checks: tuple[Callable[[str], str | None], ...] = field(default=())


@cache
def fragment_text(name: str) -> str:
    """A file of patches/fragments/, or a fragment that patches/variants.toml joins from several."""
    parts = table()["fragments"].get(name)
    if parts is not None:
        return "".join(fragment_text(part) for part in parts)
    return (archive.patches_dir() / "fragments" / name).read_text(encoding="utf-8")


@cache
def new_module_text() -> str:
    return (archive.patches_dir() / "spec_batch_threshold.py").read_text(encoding="utf-8")


def _eagle_class_is_last(text: str) -> str | None:
    """The methods are appended at the end of the file, so EAGLEWorkerV2 must end it."""
    try:
        tree = pysource.parse(text)
    except SyntaxError as err:
        return f"does not parse (line {err.lineno}: {err.msg})"
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.ClassDef) or last.name != "EAGLEWorkerV2":
        return "class EAGLEWorkerV2 is not the last definition in the file"
    if not text.endswith("\n"):
        return "the file does not end with a newline"
    return None


# The structural checks that patches/variants.toml can name for a file.
CHECKS: dict[str, Callable[[str], str | None]] = {"eagle_class_is_last": _eagle_class_is_last}


@dataclass(frozen=True)
class Release:
    variant: str
    measured: bool  # the variant was measured on a GPU for this release (benchmarks/gpu/results/)
    misses: str | None = None  # of a measured release: the targets its GPU runs fall short of


@cache
def table() -> dict[str, Any]:
    """patches/variants.toml, parsed."""
    with open(archive.patches_dir() / "variants.toml", "rb") as fh:
        return tomllib.load(fh)


def releases() -> dict[str, Release]:
    """Each release dynctl has a patch variant for, as written in the table."""
    return {name: Release(entry["variant"], bool(entry.get("measured", False)), entry.get("misses"))
            for name, entry in table()["releases"].items()}


def _insertion(entry: dict[str, Any], where: str) -> Insertion:
    anchors = table()["anchors"]
    name = entry.get("after") or entry.get("before")
    dedent = entry.get("dedent", 0)
    if entry.get("at_end"):
        return Insertion(entry["what"], entry["fragment"], at_end=True, dedent=dedent)
    if name not in anchors:
        raise KeyError(f"patches/variants.toml: {where}: unknown anchor {name!r}")
    return Insertion(entry["what"], entry["fragment"], anchors[name], before="before" in entry, dedent=dedent)


@cache
def recipes(variant: str) -> tuple[FileRecipe, ...]:
    """The files a variant changes and what it inserts into each, from patches/variants.toml."""
    variants = table()["variants"]
    files: dict[str, dict[str, Any]] = {}
    chain, name = [], variant
    while name is not None:  # a variant's own files replace its base's
        chain.append(variants[name])
        name = variants[name].get("base")
    for spec in reversed(chain):
        files.update({path: entry for path, entry in spec.items() if path != "base"})
    return tuple(
        FileRecipe(path, tuple(_insertion(e, f"variant {variant}, {path}") for e in entry["insert"]),
                   checks=tuple(CHECKS[c] for c in entry.get("checks", ())))
        for path, entry in files.items() if entry["insert"]  # an empty list: a base's file this release lacks
    )


def target_files(variant: str | None = None) -> list[str]:
    """Files the patch touches, relative to the sglang package directory: those of `variant`, or of
    any variant (what a host is asked for before its release is known), dynctl's own module last."""
    names = [variant] if variant is not None else list(table()["variants"])
    paths = dict.fromkeys(recipe.path for name in names for recipe in recipes(name))
    return [*paths, NEW_MODULE]
