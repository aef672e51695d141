"""The installed sglang source tree: found, versioned and checked without importing sglang.

The simulator must fail where sglang would: a SyntaxError in a file sglang imports at start kills it with
Python's own traceback, and a patched file that imports a module which is not there fails with
ModuleNotFoundError. Importing the real modules needs torch and a GPU, so each file is compiled (no .pyc is
written) and its module-level `sglang.*` imports are resolved against the tree instead.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from dynctl.base import sglang

POLICY_MODULE = "sglang.srt.speculative.spec_batch_threshold"
POLICY_FILE = "srt/speculative/spec_batch_threshold.py"


class TreeMissing(RuntimeError):
    """No sglang package on this interpreter's path."""


class TreeBroken(RuntimeError):
    """A file sglang imports at start does not compile or imports a missing module.

    `report` is the traceback text Python would print for it.
    """

    def __init__(self, report: str, path: Path):
        super().__init__(report)
        self.report = report
        self.path = path


@dataclass(frozen=True)
class SglangTree:
    package_dir: Path  # .../site-packages/sglang
    version: str

    def file(self, relative: str) -> Path:
        return self.package_dir / relative

    def module_file(self, module: str) -> Path | None:
        """The file that `import module` would load from this tree, or None."""
        base = self.package_dir.parent.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        if base.is_dir():
            return base  # a namespace package (PEP 420), e.g. srt/mem_cache in 0.5.14
        if base.parent.is_dir() and any(base.parent.glob(base.name + ".*.so")):
            return base.parent
        return None

    @property
    def has_policy_module(self) -> bool:
        return self.file(POLICY_FILE).is_file()


def locate_sglang() -> SglangTree:
    found = sglang.find_installed()
    if found is None:
        raise TreeMissing("No module named 'sglang'")
    package_dir = Path(found["package_dir"]).resolve()
    return SglangTree(package_dir=package_dir, version=read_version(package_dir))


def read_version(package_dir: Path) -> str:
    """The version sglang's dist-info (else its source) declares, as the host agent reads it."""
    return sglang.installed_version(str(package_dir)) or "unknown"


version_tuple = sglang.version_tuple


# ---------------------------------------------------------------------------------------- import checks

@dataclass(frozen=True)
class Frame:
    """One traceback frame: where the import that reaches the broken file happens."""

    path: Path
    function: str
    needle: str  # text of the line, searched for inside `function` ("<module>": the whole file)


def check_file(tree: SglangTree, relative: str, frames: list[Frame], runpy: bool = True) -> None:
    """Raise TreeBroken with Python's traceback if `relative` would fail to import.

    `runpy`: the import happens under `python -m` in the main process (its two frozen frames lead).
    """
    path = tree.file(relative)
    source = path.read_bytes()
    try:
        code_tree = compile(source, str(path), "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        compile(code_tree, str(path), "exec", dont_inherit=True)
    except SyntaxError as err:
        raise TreeBroken(_format(frames, err, runpy), path) from None
    missing = _first_missing_import(tree, code_tree)
    if missing is not None:
        lineno, module = missing
        err = ModuleNotFoundError(f"No module named '{module}'")
        frame = Frame(path, "<module>", "")
        raise TreeBroken(_format(frames + [frame], err, runpy, last_line=(path, lineno)), path)


def _first_missing_import(tree: SglangTree, module_ast: ast.Module) -> tuple[int, str] | None:
    """The first import of a `sglang.*` module that this tree lacks.

    Module-level imports run at import time. An import of the patch's policy module counts wherever it
    sits: the patched code reaches it while the server starts.
    """
    candidates: list[tuple[int, str]] = []
    for node in module_ast.body:
        for sub in ast.walk(node) if isinstance(node, (ast.Try, ast.If)) else (node,):
            candidates.extend(_imported_modules(sub))
    for node in ast.walk(module_ast):
        candidates.extend(m for m in _imported_modules(node) if m[1] == POLICY_MODULE)
    for lineno, module in sorted(set(candidates)):
        if tree.module_file(module) is None:
            return lineno, module
    return None


def _imported_modules(node: ast.AST) -> list[tuple[int, str]]:
    if isinstance(node, ast.Import):
        return [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "sglang"]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module.split(".")[0] != "sglang":
            return []
        found = [(node.lineno, node.module)]
        # `from sglang.srt.speculative import spec_batch_threshold` names a submodule.
        found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                  if f"{node.module}.{a.name}" == POLICY_MODULE]
        return found
    return []


def _format(frames: list[Frame], err: BaseException, runpy: bool,
            last_line: tuple[Path, int] | None = None) -> str:
    lines = ["Traceback (most recent call last):\n"]
    if runpy:
        # The frames of `python -m` itself, as CPython 3.11 prints them.
        lines += ['  File "<frozen runpy>", line 198, in _run_module_as_main\n',
                  '  File "<frozen runpy>", line 88, in _run_code\n']
    for frame in frames:
        if last_line is not None and frame.path == last_line[0] and not frame.needle:
            lineno, text = last_line[1], _line(frame.path, last_line[1])
        else:
            found = find_line(frame.path, frame.function, frame.needle)
            if found is None:
                continue
            lineno, text = found
        lines.append(f'  File "{frame.path}", line {lineno}, in {frame.function}\n')
        lines.append(f"    {text.strip()}\n")
    if isinstance(err, SyntaxError):
        lines.extend(format_syntax_error(err))
    else:
        lines.extend(traceback.format_exception_only(type(err), err))
    return "".join(lines)


def format_syntax_error(err: SyntaxError) -> list[str]:
    """A SyntaxError as the interpreter prints it (pythonrun.c print_error_text, CPython 3.11): the
    traceback module draws no carets when the error spans two lines, the interpreter does."""
    lines = [f'  File "{err.filename}", line {err.lineno}\n']
    if err.text is not None:
        raw = err.text.rstrip("\r\n")
        stripped = raw.lstrip(" \t\f")
        shift = len(raw) - len(stripped)
        lines.append(f"    {stripped}\n")
        if err.offset:
            start = max(1, err.offset - shift)
            if err.end_lineno == err.lineno and err.end_offset:
                end = err.end_offset - shift
            else:
                end = len(stripped) + 1
            lines.append("    " + " " * (start - 1) + "^" * max(1, end - start) + "\n")
    lines.append(f"{type(err).__name__}: {err.msg}\n")
    return lines


def _line(path: Path, lineno: int) -> str:
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return text[lineno - 1] if 0 < lineno <= len(text) else ""


def find_line(path: Path, function: str, needle: str) -> tuple[int, str] | None:
    """(line number, text) of the first line containing `needle` inside `function` of `path`."""
    try:
        source = path.read_text(encoding="utf-8", errors="replace")
        module = ast.parse(source)
    except (OSError, SyntaxError):
        return None
    lines = source.splitlines()
    start, end = 1, len(lines)
    if function != "<module>":
        for node in ast.walk(module):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
                start, end = node.lineno, node.end_lineno or node.lineno
                break
        else:
            return None
    for lineno in range(start, end + 1):
        text = lines[lineno - 1]
        # A call is wanted, not the definition of the function it calls.
        if needle in text and not text.lstrip().startswith(("def ", "async def ")):
            return lineno, text
    return None


# What `python -m sglang.launch_server` imports, and through which lines, before it serves (0.5.9 layout).
def main_process_checks(tree: SglangTree) -> list[tuple[str, list[Frame]]]:
    """Files the main process imports: server_args before parsing, scheduler via the HTTP server."""
    launch = tree.file("launch_server.py")
    http = tree.file("srt/entrypoints/http_server.py")
    engine = tree.file("srt/entrypoints/engine.py")
    via_launch = [Frame(launch, "<module>", "from sglang.srt.server_args import")]
    via_http = [
        Frame(launch, "<module>", "run_server(server_args)"),
        Frame(launch, "run_server", "from sglang.srt.entrypoints.http_server import"),
        Frame(http, "<module>", "from sglang.srt.entrypoints.engine import"),
        Frame(engine, "<module>", "from sglang.srt.managers.scheduler import"),
    ]
    return [("srt/server_args.py", via_launch), ("srt/managers/scheduler.py", via_http)]


def scheduler_process_checks(tree: SglangTree, spec_v2: bool) -> list[tuple[str, list[Frame]]]:
    """Files a scheduler process imports while it builds the speculative worker (spec_info.create_worker)."""
    scheduler = tree.file("srt/managers/scheduler.py")
    spec_info = tree.file("srt/speculative/spec_info.py")
    frames = [
        Frame(scheduler, "run_scheduler_process", "scheduler = Scheduler("),
        Frame(scheduler, "__init__", "self.maybe_init_draft_worker()"),
        Frame(scheduler, "maybe_init_draft_worker", "create_worker("),
    ]
    if spec_v2:
        worker = [("srt/speculative/eagle_worker_v2.py",
                   frames + [Frame(spec_info, "create_worker", "eagle_worker_v2 import EAGLEWorkerV2")])]
    else:
        worker = [("srt/speculative/eagle_worker.py",
                   frames + [Frame(spec_info, "create_worker", "eagle_worker import EAGLEWorker")])]
    if tree.has_policy_module:
        importer = tree.file("srt/speculative/eagle_worker_v2.py" if spec_v2 else "srt/speculative/eagle_worker.py")
        worker.append((POLICY_FILE, worker[0][1] + [Frame(importer, "<module>", "spec_batch_threshold")]))
    return worker


# ---------------------------------------------------------------------------------------- other reads

def allowed_internal_state_keys(tree: SglangTree) -> set[str]:
    """The `args_allow_update` set of Scheduler.set_internal_state, read from the tree (scheduler.py)."""
    path = tree.file("srt/managers/scheduler.py")
    candidates = [path]
    # 0.5.22+ moved set_internal_state out of scheduler.py.
    candidates += sorted(tree.file("srt/managers").rglob("internal_state.py"))
    for candidate in candidates:
        try:
            module = ast.parse(candidate.read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        for node in ast.walk(module):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "args_allow_update" for t in node.targets
            ):
                return {c.value for c in ast.walk(node.value)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return set()


def load_policy_module(tree: SglangTree) -> ModuleType:
    """Load the patch's policy module by file path (it is stdlib-only by contract)."""
    path = tree.file(POLICY_FILE)
    loader = importlib.machinery.SourceFileLoader(POLICY_MODULE, str(path))
    spec = importlib.util.spec_from_loader(POLICY_MODULE, loader)
    module = importlib.util.module_from_spec(spec)
    # Registered under its sglang name so its logger reads like the real one's.
    sys.modules[POLICY_MODULE] = module
    loader.exec_module(module)
    return module
