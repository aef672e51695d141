"""Python source read into a syntax tree, safely from several threads at once."""

from __future__ import annotations

import ast
import threading

# CPython 3.11 keeps the AST constructor's recursion depth per interpreter, not per thread: two threads
# parsing at once (a fleet's hosts planned in parallel) can fail with "SystemError: AST constructor
# recursion depth mismatch". One parse at a time; a parse takes milliseconds.
_lock = threading.Lock()


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    with _lock:
        return ast.parse(source, filename)
