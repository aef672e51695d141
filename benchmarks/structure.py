"""The shape of the product code, in numbers anyone can re-run: files per folder, the largest file and function,
import cycles, the import-linter contracts, and repeated blocks of six or more lines (the `duplicates` tool,
where it is installed).

    .venv/bin/python benchmarks/structure.py [TREE]     # TREE: a checkout (default: this one), e.g. of an older
                                                        # commit: git worktree add /tmp/before <rev>
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

PRODUCT = ("dynctl", "remote")


def python_files(tree: Path) -> list[Path]:
    return sorted(p for top in PRODUCT for p in (tree / top).rglob("*.py") if "__pycache__" not in p.parts)


def largest_function(files: list[Path], tree: Path) -> tuple[int, str]:
    best = (0, "")
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                best = max(best, (size, f"{path.relative_to(tree)}:{node.name}"))
    return best


def cycles(tree: Path, package: str, where: str) -> list[list[str]]:
    """Strongly connected groups of modules (module- and function-level imports alike)."""
    probe = (
        "import grimp, json, sys\n"
        f"sys.path[:0] = [{where!r}]\n"
        f"g = grimp.build_graph({package!r}, cache_dir=None)\n"
        "index, low, stack, on, out, n = {}, {}, [], set(), [], [0]\n"
        "sys.setrecursionlimit(10000)\n"
        "def visit(v):\n"
        "    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)\n"
        "    for w in g.find_modules_directly_imported_by(v):\n"
        "        if w not in index:\n"
        "            visit(w); low[v] = min(low[v], low[w])\n"
        "        elif w in on:\n"
        "            low[v] = min(low[v], index[w])\n"
        "    if low[v] == index[v]:\n"
        "        group = []\n"
        "        while True:\n"
        "            w = stack.pop(); on.discard(w); group.append(w)\n"
        "            if w == v: break\n"
        "        if len(group) > 1: out.append(sorted(group))\n"
        "for m in sorted(g.modules):\n"
        "    if m not in index: visit(m)\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tree, capture_output=True, text=True, check=True)
    import json

    return json.loads(proc.stdout)


def contracts(tree: Path) -> str:
    if "[tool.importlinter]" not in (tree / "pyproject.toml").read_text(encoding="utf-8"):
        return "none written"
    proc = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                                                 "sys.argv = ['lint-imports', '--no-cache']; lint_imports_command()"],
                          cwd=tree, capture_output=True, text=True, env={"PYTHONPATH": str(tree), "PATH": ""})
    found = re.search(r"Contracts: (\d+) kept, (\d+) broken", proc.stdout)
    return f"{found[1]} kept, {found[2]} broken" if found else "could not run: " + proc.stderr[-200:]


def duplicates(tree: Path) -> str:
    tool = shutil.which("duplicates")
    if tool is None:
        return "(the duplicates tool is not installed here)"
    counts = []
    for top in PRODUCT:
        out = subprocess.run([tool, "--repo", str(tree / top), "--seconds", "120"], capture_output=True,
                             text=True).stdout
        first = out.splitlines()[0] if out else "?"
        counts.append(f"{top}/: {first}")
    return "; ".join(counts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    tree = Path(ap.parse_args().tree).resolve()
    files = python_files(tree)
    per_folder = Counter(str(p.parent.relative_to(tree)) for p in files)
    sizes = sorted(((len(p.read_text(encoding="utf-8").splitlines()), str(p.relative_to(tree))) for p in files),
                   reverse=True)
    print(f"product code: {len(files)} Python files, {sum(s for s, _ in sizes)} lines")
    print("files per folder: " + ", ".join(f"{folder}/ {n}" for folder, n in sorted(per_folder.items())))
    print(f"largest file: {sizes[0][1]} ({sizes[0][0]} lines); files over 400 lines: "
          f"{sum(1 for s, _ in sizes if s > 400)}")
    size, name = largest_function(files, tree)
    print(f"largest function: {name} ({size} lines)")
    found = cycles(tree, "dynctl", str(tree)) + cycles(tree, "dynctl_agent", str(tree / "remote"))
    print(f"import cycles: {len(found)}" + (f" {found}" if found else ""))
    print(f"import-linter contracts: {contracts(tree)}")
    print(f"repeated blocks of 6+ lines: {duplicates(tree)}")


if __name__ == "__main__":
    main()
