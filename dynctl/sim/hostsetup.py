"""Prepare a local demo GPU host: a directory holding a pristine sglang tree, the fake nvidia-smi, GPU state
and a workdir, plus the host entry that points dynctl at it (SPEC §8). Idempotent: a second call changes
nothing and, in particular, leaves a tree that dynctl has since patched as it is.

    root/cache/   sglang wheels from PyPI (`pip download --no-deps`, this interpreter's tags)
    root/site/    the wheel installed with `pip install --no-deps --target` (PYTHONPATH of the server)
    root/bin/     nvidia-smi (this package's nvidia_smi.py, bound to root/gpu)
    root/gpu/     gpus.json (8 × H200) and the live state the simulator publishes
    root/work/    the host's dynctl workdir
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dynctl.sim import nvidia_smi

DEMO_MODEL = "/models/demo-simulated"
DEMO_DRAFT = "/models/demo-simulated-eagle3"


class DemoSetupError(RuntimeError):
    """The demo host could not be prepared; the message names the step and what to do."""


def demo_args() -> list[str]:
    """SPEC §3's EAGLE-3 launch arguments for the simulated model. 256 running requests, as the GPU run behind
    the step-cost table had for its 256-stream level (EAGLE caps it at 48 otherwise, server_args.py:2362-2366)."""
    return ["--model-path", DEMO_MODEL, "--tp", "8",
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", DEMO_DRAFT,
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
            "--max-running-requests", "256"]


def _make_private_dirs(path: Path) -> None:
    """mkdir -p with 0700 for every directory it creates, whatever the umask: the agent refuses a workdir
    that others could write to, or under such a directory."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        p.mkdir(mode=0o700, exist_ok=True)
        os.chmod(p, 0o700)


def prepare_demo_host(root: Path, sglang_version: str = "0.5.9", port: int = 30000, *,
                      cache_dir: Path | None = None, time_scale: float = 1.0, gpu_count: int = 8,
                      reset: bool = False) -> dict[str, Any]:
    """Create (or keep) the demo host under `root`; return its host entry for the config.

    `reset=True` reinstalls the pristine wheel even when a tree is there (undoing any patch).
    """
    root = Path(root).expanduser().resolve()
    cache = Path(cache_dir).expanduser().resolve() if cache_dir else root / "cache"
    site, bindir, gpu_dir, work = root / "site", root / "bin", root / "gpu", root / "work"
    for path in (root, cache, bindir, gpu_dir, work):
        _make_private_dirs(path)
    installed = _installed_version(site)
    if reset or installed != sglang_version:
        wheel = fetch_wheel(sglang_version, cache)
        install_wheel(wheel, site)
    install_nvidia_smi(bindir / "nvidia-smi", gpu_dir)
    inventory = gpu_dir / "gpus.json"
    if not inventory.is_file():
        _write_text(inventory, json.dumps(nvidia_smi.default_inventory(gpu_count), indent=1) + "\n")
    return {
        "python": sys.executable,
        "workdir": str(work),
        "port": port,
        "env": {
            "PYTHONPATH": str(site),
            "PATH": f"{bindir}:${{PATH}}",
            "SGLANG_ENABLE_SPEC_V2": "1",
            "DYNCTL_SIM_GPU_DIR": str(gpu_dir),
        },
        "launch": ["{python}", "-m", "dynctl.sim", "--time-scale", _number(time_scale)],
        "args": demo_args(),
        "simulated": True,
    }


def fetch_wheel(version: str, cache: Path) -> Path:
    """The sglang wheel for this interpreter, from the cache or from PyPI via pip."""
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--quiet", f"sglang=={version}", "--dest", str(cache)]
    result = subprocess.run(argv, capture_output=True, text=True)
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if result.returncode != 0 or not found:
        raise DemoSetupError(
            f"could not download sglang {version} from PyPI ({' '.join(argv)} exited {result.returncode}):\n"
            f"{(result.stderr or result.stdout).strip()[-2000:]}\n"
            f"Put the wheel (sglang-{version}-*.whl) into {cache} and run the setup again.")
    return found[0]


def install_wheel(wheel: Path, site: Path) -> None:
    """`pip install --no-deps --target` into a fresh directory, then swap it in (never half-installed)."""
    staging = Path(tempfile.mkdtemp(prefix=".site-", dir=site.parent))
    argv = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check",
            "--quiet", "--target", str(staging), str(wheel)]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise DemoSetupError(f"could not install {wheel.name} into {site} ({' '.join(argv)} exited "
                             f"{result.returncode}):\n{(result.stderr or result.stdout).strip()[-2000:]}")
    old = None
    if site.exists():
        old = site.with_name(f".{site.name}-old-{os.getpid()}")
        os.replace(site, old)
    os.replace(staging, site)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def install_nvidia_smi(target: Path, gpu_dir: Path) -> None:
    source = Path(nvidia_smi.__file__).read_text(encoding="utf-8")
    marker = 'STATE_DIR = os.environ.get("DYNCTL_SIM_GPU_DIR", "")  # replaced when installed'
    if marker not in source:
        raise DemoSetupError(f"{nvidia_smi.__file__}: STATE_DIR line not found; cannot bind nvidia-smi to {gpu_dir}")
    body = source.replace(marker, f"STATE_DIR = {str(gpu_dir)!r}")
    lines = body.splitlines(keepends=True)
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    # -S: the stand-in is the standard library alone; the real tool is a C binary that starts at once
    text = f"#!{sys.executable} -S\n" + "".join(lines)
    if target.is_file() and target.read_text(encoding="utf-8") == text:
        return
    _write_text(target, text)
    target.chmod(0o755)


def _installed_version(site: Path) -> str | None:
    infos = sorted(site.glob("sglang-*.dist-info"))
    if not infos or not (site / "sglang").is_dir():
        return None
    return infos[0].name[len("sglang-"):-len(".dist-info")]


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
