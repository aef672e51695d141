"""Write the patch of every supported release as a plain unified diff: patches/rendered/sglang-<release>.diff.

    python -m dynctl.patching.render            # all releases in patches/variants.toml
    python -m dynctl.patching.render 0.5.16     # one release
    python -m dynctl.patching.render --check    # exit 1 when a checked-in diff differs

Each diff is against the release's wheel from PyPI (downloaded once into $DYNCTL_TEST_CACHE, else
.cache/sglang, as the tests do), so `patch -p1` applies it in the directory that holds `sglang/`.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dynctl.agent import archive
from dynctl.patching.engine import plan_patch
from dynctl.patching.recipe import NEW_MODULE, recipes, releases
from dynctl.patching.versions import strategy_for


def rendered_dir() -> Path:
    return archive.patches_dir() / "rendered"


def rendered_path(version: str) -> Path:
    return rendered_dir() / f"sglang-{version}.diff"


def render(version: str, wheel: Path) -> str:
    """The diff dynctl's patch makes to the pristine files of sglang `version` (its wheel at `wheel`)."""
    release = releases()[version]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        originals: dict[str, str | None] = {
            recipe.path: zf.read(f"sglang/{recipe.path}").decode("utf-8")
            for recipe in recipes(release.variant) if f"sglang/{recipe.path}" in names
        }
    originals[NEW_MODULE] = None
    plan = plan_patch(version, originals)
    if release.measured:
        measured = "yes"
    elif strategy_for(version) == "patch":
        measured = "no (strategy = \"auto\" still takes it: this release has no native route)"
    else:
        measured = "no (taken only with strategy = \"patch\")"
    header = (f"# dynctl's --speculative-disable-batch-threshold patch for sglang {version} (variant "
              f"{release.variant}); measured on a GPU: {measured}.\n"
              f"# Generated from patches/variants.toml and patches/fragments/ by "
              f"`python -m dynctl.patching.render`; do not edit. Apply with `patch -p1` next to sglang/.\n")
    return header + plan.diff()


def wheel_cache() -> Path:
    path = Path(os.environ.get("DYNCTL_TEST_CACHE") or archive.patches_dir().parent / ".cache" / "sglang")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cached(version: str, where: Path) -> Path | None:
    found = sorted(where.glob(f"sglang-{version}-*.whl"))
    return found[0] if found else None


def fetch_wheel(version: str, where: Path | None = None) -> Path:
    """The sglang `version` wheel (no dependencies), downloaded from PyPI unless already in `where`.

    Wheels of 0.5.11 and later are CPython 3.11 manylinux builds; their Python sources are what dynctl
    needs, so the download asks for that platform explicitly and works from any interpreter.
    """
    where = where or wheel_cache()
    if (hit := _cached(version, where)) is not None:
        return hit
    with open(where / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel runs download each wheel once
        if (hit := _cached(version, where)) is not None:
            return hit
        return _download(version, where)


def _download(version: str, where: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.11", "--implementation", "cp",
               "--platform", "manylinux_2_34_x86_64", "--platform", "any",
               "--disable-pip-version-check", "--quiet", "--dest", tmp, f"sglang=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        wheels = list(Path(tmp).glob(f"sglang-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download sglang=={version} failed: {proc.stderr.strip()[-800:]}")
        os.replace(wheels[0], where / wheels[0].name)
        return where / wheels[0].name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynctl.patching.render", description=__doc__.split("\n")[0])
    parser.add_argument("versions", nargs="*", help="releases to render (default: every release in the table)")
    parser.add_argument("--check", action="store_true", help="compare with the checked-in diffs, write nothing")
    args = parser.parse_args(argv)
    known = releases()
    unknown = [v for v in args.versions if v not in known]
    if unknown:
        parser.error(f"no patch variant for sglang {', '.join(unknown)} in patches/variants.toml "
                     f"(releases: {', '.join(known)})")
    stale = []
    for version in args.versions or list(known):
        text = render(version, fetch_wheel(version))
        path = rendered_path(version)
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    if stale:
        print("out of date (run `python -m dynctl.patching.render`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
