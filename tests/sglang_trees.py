"""Real sglang source trees for tests: wheels from PyPI (no dependencies), cached between runs.

    sglang_wheel("0.5.9") -> Path to the cached wheel (downloaded once with `pip download`)
    install_sglang("0.5.9", tmp_path / "site") -> tmp_path / "site" / "sglang"
    install_sglang("0.5.9", tmp_path / "site", only=["sglang/srt/speculative/"])  # a few files, fast

The cache is $DYNCTL_TEST_CACHE, else <repo>/.cache/sglang (gitignored); the download is
dynctl.patching.render.fetch_wheel's.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Sequence
from pathlib import Path

from dynctl.patching.render import fetch_wheel

REPO = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    path = Path(os.environ.get("DYNCTL_TEST_CACHE") or REPO / ".cache" / "sglang")
    path.mkdir(parents=True, exist_ok=True)
    return path


def sglang_wheel(version: str) -> Path:
    """The sglang `version` wheel from PyPI, downloaded once into the cache (as `python -m
    dynctl.patching.render` fetches it)."""
    return fetch_wheel(version, cache_dir())


def install_sglang(version: str, target_dir: Path, only: Sequence[str] | None = None) -> Path:
    """Unzip the wheel into `target_dir` (as pip would lay it out, dist-info included); return the package dir.

    `only`: path prefixes inside the wheel to unpack (e.g. "sglang/srt/managers/"), for tests that need
    a few files fast; the dist-info and sglang/__init__.py, version.py, launch_server.py always come along.
    """
    target_dir = Path(target_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    keep = None if only is None else (*only, "sglang/__init__.py", "sglang/version.py", "sglang/launch_server.py",
                                      f"sglang-{version}.dist-info/")
    with zipfile.ZipFile(sglang_wheel(version)) as wheel:
        for info in wheel.infolist():
            name = info.filename
            if name.startswith("/") or ".." in name.split("/"):
                raise RuntimeError(f"unsafe path {name!r} in the sglang {version} wheel")
            if keep is not None and not name.startswith(keep):
                continue
            dest = target_dir / name
            if info.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with wheel.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
            os.chmod(dest, 0o644)
    package = target_dir / "sglang"
    if not (package / "srt").is_dir() and only is None:
        raise RuntimeError(f"the sglang {version} wheel has no sglang/srt directory")
    return package
