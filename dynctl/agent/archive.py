"""Files dynctl ships to hosts: the agent (as one archive) and the patch payload.

In a source checkout they live at the repository root (`remote/`, `patches/`); in a wheel they are
packaged as `dynctl/_remote` and `dynctl/_patches`.
"""

from __future__ import annotations

import ast
import hashlib
import io
import zipfile
from functools import cache
from pathlib import Path

_PKG = Path(__file__).resolve().parents[1]  # the dynctl package


def _shipped_dir(checkout_name: str, wheel_name: str, marker: str) -> Path:
    # the wheel's copy first: next to an installed dynctl, "../remote" may be some other package
    for candidate in (_PKG / wheel_name, _PKG.parent / checkout_name):
        if (candidate / marker).is_file():
            return candidate
    raise FileNotFoundError(f"dynctl is installed without its {checkout_name}/ directory")


def remote_dir() -> Path:
    """The folder that holds the agent package `dynctl_agent/` (put it on sys.path to import it)."""
    return _shipped_dir("remote", "_remote", "dynctl_agent/__main__.py")


@cache
def host_program(*names: str) -> str:
    """The programs of remote/bootstrap/ named (checks, words, boot, upload) as one, stripped for the wire:
    their comments and docstrings are for readers, and the host compiles what it is sent on every call."""
    tree = ast.Module(body=[], type_ignores=[])
    for name in names:
        tree.body += ast.parse((remote_dir() / "bootstrap" / f"{name}.py").read_text(encoding="utf-8")).body
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            body[:1] = [] if len(body) > 1 else [ast.Pass()]
    return ast.unparse(tree) + "\n"


def patches_dir() -> Path:
    return _shipped_dir("patches", "_patches", "spec_batch_threshold.py")


# The agent imports dynctl.base.sglang and dynctl.base.hostspec as the client does; the archive carries them.
CLIENT_MODULES = ("base/sglang.py", "base/hostspec.py")
_CLIENT_PART = b'"""The part of the dynctl client that the host agent imports: base.sglang, base.hostspec."""\n'


def agent_files(agent_dir: Path | None = None, sglang_file: Path | None = None) -> dict[str, bytes]:
    """What the agent archive holds, by path inside it: the package's modules (no bytecode) and CLIENT_MODULES."""
    agent_dir = agent_dir or remote_dir() / "dynctl_agent"
    files = {f"dynctl_agent/{p.name}": p.read_bytes() for p in agent_dir.glob("*.py")}
    files["dynctl/__init__.py"] = files["dynctl/base/__init__.py"] = _CLIENT_PART
    for name in CLIENT_MODULES:
        files[f"dynctl/{name}"] = (_PKG / name).read_bytes()
    if sglang_file is not None:
        files["dynctl/base/sglang.py"] = sglang_file.read_bytes()
    return files


def build_archive(files: dict[str, bytes]) -> bytes:
    """One zip of `files`: the same contents give the same bytes whatever the checkout, file order or mtimes
    (sorted names, a fixed date and mode, stored uncompressed so no zlib version changes a byte)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name, data in sorted(files.items()):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.create_system = 3
            info.external_attr = 0o100644 << 16
            zf.writestr(info, data)
    return buf.getvalue()


@cache
def agent_archive() -> bytes:
    return build_archive(agent_files())


def agent_digest() -> str:
    return hashlib.sha256(agent_archive()).hexdigest()[:16]
