"""The patch engine: a pure function from (sglang version, original texts) to a Plan or a refusal."""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from dynctl.base import sglang
from dynctl.base.errors import PreflightError
from dynctl.patching.recipe import (
    FEATURE_TOKENS,
    NEW_MODULE,
    FileRecipe,
    Insertion,
    new_module_text,
    recipes,
    target_files,
)
from dynctl.patching.versions import patch_note, strategy_for, variant_for


class PatchRefused(PreflightError):
    """Nothing can be planned: a file or anchor does not match. Nothing was written."""

    def __init__(self, message: str, file: str | None = None, anchor: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.anchor = anchor


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class FileChange:
    path: str  # relative to the sglang package directory
    before: str | None  # None: the file is created
    after: str

    @property
    def sha256_before(self) -> str | None:
        return None if self.before is None else sha256_text(self.before)

    @property
    def sha256_after(self) -> str:
        return sha256_text(self.after)

    def diff(self) -> str:
        before = [] if self.before is None else self.before.splitlines(keepends=True)
        return "".join(difflib.unified_diff(
            before, self.after.splitlines(keepends=True),
            fromfile="/dev/null" if self.before is None else f"a/sglang/{self.path}",
            tofile=f"b/sglang/{self.path}",
        ))


@dataclass(frozen=True)
class Plan:
    version: str
    variant: str
    status: str  # "ready": changes to apply; "applied": already applied, intact
    changes: tuple[FileChange, ...]
    strategy: str = "patch"
    leftover: str | None = None  # dynctl's own module found in an otherwise pristine tree (replaced, backed up)

    @property
    def message(self) -> str:
        note = patch_note(self.version)
        note = f"; {note}" if note else ""
        if self.status == "applied":
            return f"already applied, intact (sglang {self.version}){note}"
        found = (f"; {self.leftover} is dynctl's module left by a reinstall: it is backed up into the release "
                 f"and replaced" if self.leftover else "")
        return f"{len(self.changes)} files to change (sglang {self.version}, variant {self.variant}){found}{note}"

    def diff(self) -> str:
        return "".join(change.diff() for change in self.changes)

    def files_for_agent(self) -> list[dict[str, str | None]]:
        """What `patch_apply` takes: path, both sha256s and the new text of each file."""
        return [
            {"path": c.path, "sha256_before": c.sha256_before, "sha256_after": c.sha256_after, "text": c.after}
            for c in self.changes
        ]


def TARGET_FILES(version: str) -> list[str]:
    """Relative paths (under the sglang package dir) the strategy for `version` touches."""
    return target_files(variant_for(version)) if strategy_for(version) == "patch" else []


# --------------------------------------------------------------------------- text surgery


def _line_starts(text: str, needle: str) -> list[int]:
    """Offsets where `needle` occurs starting at the beginning of a line."""
    found, start = [], 0
    while (i := text.find(needle, start)) != -1:
        if i == 0 or text[i - 1] == "\n":
            found.append(i)
        start = i + 1
    return found


def _insert(text: str, ins: Insertion, path: str) -> str:
    if ins.at_end:
        return text + ins.text
    hits = _line_starts(text, ins.anchor)
    if len(hits) != 1:
        first = ins.anchor.splitlines()[0].strip()
        how = "not found" if not hits else f"found {len(hits)} times, expected once"
        raise PatchRefused(f"{path}: anchor for {ins.what} {how}: {first!r}", file=path, anchor=ins.anchor)
    at = hits[0] if ins.before else hits[0] + len(ins.anchor)
    return text[:at] + ins.text + text[at:]


def _remove(text: str, ins: Insertion) -> str | None:
    """`text` without this insertion, or None when the insertion is not there exactly once."""
    if ins.at_end:
        return text[: -len(ins.text)] if text.endswith(ins.text) else None
    joined = ins.text + ins.anchor if ins.before else ins.anchor + ins.text
    hits = _line_starts(text, joined)
    if len(hits) != 1:
        return None
    at = hits[0]
    return text[:at] + ins.anchor + text[at + len(joined):]


def _apply_recipe(text: str, recipe: FileRecipe) -> str:
    for check in recipe.checks:
        problem = check(text)
        if problem:
            raise PatchRefused(f"{recipe.path}: {problem}", file=recipe.path)
    for ins in recipe.insertions:
        text = _insert(text, ins, recipe.path)
    return text


def _unapply_recipe(text: str, recipe: FileRecipe) -> tuple[str, int]:
    """(text with every present insertion removed, how many were present)."""
    present = 0
    for ins in reversed(recipe.insertions):  # appended fragments come off last-first
        stripped = _remove(text, ins)
        if stripped is not None:
            text, present = stripped, present + 1
    return text, present


def _has_feature(text: str) -> bool:
    return any(token in text for token in FEATURE_TOKENS)


# --------------------------------------------------------------------------- planning


def _classify(recipe: FileRecipe, text: str) -> str:
    """'pristine' or 'applied'; PatchRefused when the file was patched and then edited."""
    stripped, present = _unapply_recipe(text, recipe)
    if present == 0:
        if _has_feature(text):
            raise PatchRefused(f"patched but modified: {recipe.path} (the inserted code was edited)",
                               file=recipe.path)
        return "pristine"
    if present < len(recipe.insertions) or _has_feature(stripped):
        raise PatchRefused(f"patched but modified: {recipe.path} (only part of the inserted code is intact)",
                           file=recipe.path)
    return "applied"


def plan_patch(
    version: str,
    originals: Mapping[str, str | None],
    *,
    record: Mapping[str, str] | None = None,
    expected: Mapping[str, str] | None = None,
) -> Plan:
    """Plan the patch for sglang `version` from the current texts of its target files.

    `originals` maps each path of TARGET_FILES(version) to its text (None or missing: absent).
    `record` maps paths to the sha256 the installed wheel's RECORD lists: a pristine file that
    differs was edited by hand and is refused. `expected` maps paths to the sha256 they had
    right after the release in force was applied: a patched file that differs was edited.
    Raises PatchRefused (a PreflightError) naming the file and anchor; writes nothing.
    """
    variant = variant_for(version)
    states: dict[str, str] = {}
    new_texts: dict[str, str] = {}
    for recipe in recipes(variant):
        text = originals.get(recipe.path)
        if text is None:
            raise PatchRefused(f"{recipe.path}: file not found in the sglang package", file=recipe.path)
        state = _classify(recipe, text)
        if state == "pristine":
            wanted = (record or {}).get(recipe.path)
            if wanted and wanted != sha256_text(text):
                raise PatchRefused(
                    f"{recipe.path}: edited by hand (its sha256 differs from the installed wheel's "
                    f"RECORD); reinstall sglang {version} or restore the file first",
                    file=recipe.path,
                )
            new_texts[recipe.path] = _apply_recipe(text, recipe)
        states[recipe.path] = state

    module = originals.get(NEW_MODULE)
    leftover = None
    files_pristine = bool(states) and set(states.values()) == {"pristine"}
    if module is None:
        states[NEW_MODULE] = "pristine"
        new_texts[NEW_MODULE] = new_module_text()
    elif files_pristine and is_own_module(module):
        # `pip install --force-reinstall` restores the files the patch edited but keeps the one it added
        states[NEW_MODULE] = "pristine"
        new_texts[NEW_MODULE] = new_module_text()
        leftover = NEW_MODULE
    elif files_pristine:
        raise PatchRefused(f"{NEW_MODULE} is in the sglang package, but the release does not ship it and it is not "
                           f"the module dynctl adds: move it away (it is not dynctl's to replace) and plan again",
                           file=NEW_MODULE)
    elif module == new_module_text():
        states[NEW_MODULE] = "applied"
    else:
        raise PatchRefused(f"patched but modified: {NEW_MODULE} (differs from the module dynctl ships)",
                           file=NEW_MODULE)

    if set(states.values()) == {"applied"}:
        for path, sha in (expected or {}).items():
            text = originals.get(path)
            if text is not None and sha and sha256_text(text) != sha:
                raise PatchRefused(f"patched but modified: {path} (sha256 differs from the release in force)",
                                   file=path)
        return Plan(version, variant, "applied", ())
    if "applied" in states.values():
        done = sorted(p for p, s in states.items() if s == "applied")
        todo = sorted(p for p, s in states.items() if s != "applied")
        raise PatchRefused(
            f"partly applied: {', '.join(done)} patched, {', '.join(todo)} not; "
            f"revert the release in force or reinstall sglang {version}",
            file=todo[0],
        )
    changes = tuple(
        FileChange(path, originals.get(path), new_texts[path]) for path in target_files(variant)
    )
    return Plan(version, variant, "ready", changes, leftover=leftover)


def is_own_module(text: str) -> bool:
    """The module the patch adds, as this dynctl ships it or as an earlier one did (its docstring's header)."""
    if text == new_module_text():
        return True
    header = new_module_text().split("\n", 1)[0]
    return text.split("\n", 1)[0] == header and sglang.THRESHOLD_FLAG in text
