"""sglang's command line and ServerArgs, rebuilt from the tree's `srt/server_args.py` by reading its AST.

sglang builds its parser with `ServerArgs.add_cli_args(parser)` (explicit `parser.add_argument` calls up to
0.5.13; `A[type, Arg(...)]` field annotations from 0.5.14, `arg_groups/arg_utils.py`), and
`prepare_server_args` parses `sys.argv[1:]` with `argparse.ArgumentParser()` — prog is the basename of
`launch_server.py` under `python -m sglang.launch_server`. Replaying those calls gives the same accepted
flags, the same usage text and the same exit 2 on an unknown flag, and a patched tree's extra flag is
accepted exactly when the patch declared both the dataclass field and the argument.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynctl.base import sglang

PROG = "launch_server.py"


class _Unresolved(Exception):
    pass


_MISSING = object()


@dataclass
class ServerArgsSpec:
    """What server_args.py declares: dataclass fields with their defaults, and CLI arguments in order."""

    fields: dict[str, Any]
    arguments: list[tuple[tuple[str, ...], dict[str, Any]]] = field(default_factory=list)
    # `args.tp_size = args.tensor_parallel_size` lines of from_cli_args, as (target, source).
    renames: list[tuple[str, str]] = field(default_factory=list)

    def declares(self, flag: str) -> bool:
        return any(flag in names for names, _ in self.arguments)

    def has_field(self, name: str) -> bool:
        return name in self.fields


def read_server_args(path: Path) -> ServerArgsSpec:
    module = ast.parse(path.read_text(encoding="utf-8"), str(path))
    evaluator = _Evaluator(module)
    cls = next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs"), None)
    if cls is None:
        raise ValueError(f"{path}: no ServerArgs class (this sglang layout is not supported by the simulator)")
    spec = ServerArgsSpec(fields={})
    derived: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        default = evaluator.field_default(stmt.value)
        spec.fields[stmt.target.id] = None if default is _MISSING else default
        argument = _annotated_argument(stmt.target.id, stmt.annotation, default, evaluator)
        if argument is not None:
            derived.append(argument)
    evaluator.field_defaults = spec.fields
    spec.renames = _from_cli_renames(cls)
    add_cli = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args"), None)
    if add_cli is None:
        spec.arguments = derived
        return spec
    events: list[tuple[int, int, list]] = []
    for node in ast.walk(add_cli):
        if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Attribute, ast.Name)):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        if name == "add_argument":
            events.append((node.lineno, node.col_offset, [_explicit_argument(node, evaluator)]))
        elif name == "add_cli_args_from_dataclass":
            events.append((node.lineno, node.col_offset, derived))
    for _, _, arguments in sorted(events, key=lambda e: (e[0], e[1])):
        spec.arguments.extend(a for a in arguments if a is not None)
    return spec


def build_parser(spec: ServerArgsSpec) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG)
    for names, kwargs in spec.arguments:
        try:
            parser.add_argument(*names, **kwargs)
        except (argparse.ArgumentError, TypeError, ValueError):
            # The same flag under two branches of an `if` in add_cli_args: the first one stands.
            continue
    return parser


def merge_config_file(spec: ServerArgsSpec, argv: list[str]) -> list[str]:
    """argv with `--config FILE` merged in as prepare_server_args does (ConfigArgumentMerger: the file's flags
    first, so the command line wins; store_true flags only when true)."""
    store_true = {kwargs.get("dest") or names[-1].lstrip("-").replace("-", "_")
                  for names, kwargs in spec.arguments if kwargs.get("action") == "store_true"}
    return sglang.merge_config_args(argv, store_true)


def parse_server_args(spec: ServerArgsSpec, argv: list[str]) -> dict[str, Any]:
    """`ServerArgs.from_cli_args(parser.parse_args(argv))` as a dict; argparse exits 2 on bad input."""
    namespace = build_parser(spec).parse_args(argv)
    for target, source in spec.renames:
        if hasattr(namespace, source):
            setattr(namespace, target, getattr(namespace, source))
    # from_cli_args copies dataclass fields only (server_args.py:5077-5078 in 0.5.9).
    return {name: getattr(namespace, name, default) for name, default in spec.fields.items()}


def _from_cli_renames(cls: ast.ClassDef) -> list[tuple[str, str]]:
    method = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "from_cli_args"), None)
    renames = []
    for node in ast.walk(method) if method else ():
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Attribute) and isinstance(node.value, ast.Attribute)
                and isinstance(node.targets[0].value, ast.Name) and isinstance(node.value.value, ast.Name)):
            renames.append((node.targets[0].attr, node.value.attr))
    return renames


# ------------------------------------------------------------------------------------------- evaluation

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv}


class _Evaluator:
    """Evaluates the constant expressions server_args.py uses (literals, module constants, ServerArgs.x)."""

    def __init__(self, module: ast.Module):
        self.constants: dict[str, ast.expr] = {}
        for node in module.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self.constants[node.targets[0].id] = node.value
        self.field_defaults: dict[str, Any] = {}

    def value(self, node: ast.expr, depth: int = 0) -> Any:
        if depth > 20:
            raise _Unresolved
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = [self.value(e, depth + 1) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items) if isinstance(node, ast.Tuple) else set(items)
        if isinstance(node, ast.Dict):
            return {self.value(k, depth + 1): self.value(v, depth + 1) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self.value(node.operand, depth + 1)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](self.value(node.left, depth + 1), self.value(node.right, depth + 1))
        if isinstance(node, ast.Name):
            if node.id in self.constants:
                return self.value(self.constants[node.id], depth + 1)
            raise _Unresolved
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ServerArgs":
            if node.attr in self.field_defaults:
                return self.field_defaults[node.attr]
            raise _Unresolved
        if isinstance(node, ast.Subscript):
            return self.value(node.value, depth + 1)[self.value(node.slice, depth + 1)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("list", "tuple"):
            inner = self.value(node.args[0], depth + 1) if node.args else []
            return list(inner) if node.func.id == "list" else tuple(inner)
        if isinstance(node, ast.JoinedStr):
            return "".join(str(v.value) if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                           for v in node.values)
        raise _Unresolved

    def maybe(self, node: ast.expr | None, fallback: Any = None) -> Any:
        if node is None:
            return fallback
        try:
            return self.value(node)
        except (_Unresolved, TypeError, KeyError, IndexError, ZeroDivisionError):
            return fallback

    def field_default(self, node: ast.expr | None) -> Any:
        if node is None:
            return _MISSING
        if isinstance(node, ast.Call) and _call_name(node) in ("field", "dataclasses.field"):
            for kw in node.keywords:
                if kw.arg == "default":
                    return self.maybe(kw.value)
                if kw.arg == "default_factory":
                    factory = kw.value
                    if isinstance(factory, ast.Lambda):
                        return self.maybe(factory.body)
                    if isinstance(factory, ast.Name) and factory.id in ("list", "dict", "set"):
                        return {"list": [], "dict": {}, "set": []}[factory.id]
                    return None
            return _MISSING
        return self.maybe(node)


def _call_name(node: ast.Call) -> str:
    return ast.unparse(node.func)


def _nullable_str(value: str) -> str | None:
    return None if not value or value == "None" else value


_TYPES = {"int": int, "float": float, "str": str, "json.loads": json.loads, "json_list_type": json.loads,
          "nullable_str": _nullable_str}


class _DeprecatedAction(argparse.Action):
    """server_args.py DeprecatedAction: accepted, warns, stores nothing."""

    def __init__(self, option_strings, dest, nargs=0, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        # Printed before logging is configured, so only the message shows (print_deprecated_warning).
        print(f"\033[1;33mThe command line argument '{option_string}' is deprecated and will be removed "
              f"in future versions.\033[0m", file=sys.stderr)


class _ListAction(argparse.Action):
    """Stand-in for actions that collect a list (LoRAPathAction)."""

    def __init__(self, option_strings, dest, nargs="*", **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, list(values or []))


def _action(node: ast.expr, evaluator: _Evaluator) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    name = ast.unparse(node)
    if name.endswith("DeprecatedAction"):
        return _DeprecatedAction
    return _ListAction


def _explicit_argument(call: ast.Call, evaluator: _Evaluator) -> tuple[tuple[str, ...], dict] | None:
    names = tuple(evaluator.maybe(a, "") for a in call.args)
    if not names or not all(isinstance(n, str) and n for n in names):
        return None
    kwargs: dict[str, Any] = {}
    for kw in call.keywords:
        if kw.arg is None:
            continue
        if kw.arg == "action":
            kwargs["action"] = _action(kw.value, evaluator)
        elif kw.arg == "type":
            kwargs["type"] = _TYPES.get(ast.unparse(kw.value), str)
        elif kw.arg == "choices":
            choices = evaluator.maybe(kw.value)
            if isinstance(choices, (list, tuple, set)):
                kwargs["choices"] = list(choices)
        elif kw.arg == "help":
            kwargs["help"] = _help_text(evaluator.maybe(kw.value, ""))
        elif kw.arg in ("default", "const", "nargs", "dest", "required", "metavar"):
            kwargs[kw.arg] = evaluator.maybe(kw.value)
    return names, kwargs


def _help_text(text: Any) -> str:
    # argparse %-formats help; an unresolved f-string may hold a stray '%'.
    return str(text).replace("%", "%%") if "%(" not in str(text) else str(text)


def _annotated_argument(name: str, annotation: ast.expr, default: Any,
                        evaluator: _Evaluator) -> tuple[tuple[str, ...], dict] | None:
    """One `A[T, "help"]` / `A[T, Arg(...)]` field as add_cli_args_from_dataclass would add it (0.5.14+)."""
    if not (isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in ("A", "Annotated")):
        return None
    parts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    if len(parts) < 2:
        return None
    type_node, meta_node = parts[0], parts[1]
    meta: dict[str, Any] = {}
    if isinstance(meta_node, ast.Constant) and isinstance(meta_node.value, str):
        meta["help"] = meta_node.value
    elif isinstance(meta_node, ast.Call) and ast.unparse(meta_node.func) == "Arg":
        for kw in meta_node.keywords:
            if kw.arg == "action":
                meta["action"] = _action(kw.value, evaluator)
            elif kw.arg == "type_parser":
                meta["type_parser"] = _TYPES.get(ast.unparse(kw.value), str)
            elif kw.arg:
                meta[kw.arg] = evaluator.maybe(kw.value)
    else:
        return None
    if meta.get("no_cli"):
        return None
    cli_name = meta.get("cli_name") or "--" + name.replace("_", "-")
    names = (cli_name, *(meta.get("aliases") or []))
    kwargs: dict[str, Any] = {"help": _help_text(meta.get("help", ""))}
    if cli_name.lstrip("-").replace("-", "_") != name:
        kwargs["dest"] = name
    if default is not _MISSING:
        kwargs["default"] = default
    if meta.get("const") is not None:
        kwargs["const"] = meta["const"]
    if "action" in meta:
        kwargs["action"] = meta["action"]
        kwargs.update(meta.get("action_kwargs") or {})
        return names, kwargs
    inner, _ = _unwrap_optional(type_node)
    choices = meta.get("choices")
    if isinstance(inner, ast.Subscript) and ast.unparse(inner.value) in ("Literal", "typing.Literal"):
        values = evaluator.maybe(inner.slice)
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        kwargs["choices"] = choices or values
        kwargs["type"] = meta.get("type_parser") or _scalar_type(type(values[0]).__name__ if values else "str")
        return names, kwargs
    if (isinstance(inner, ast.Subscript) and ast.unparse(inner.value) in ("List", "list")
            and "type_parser" not in meta):
        kwargs["type"] = _scalar_type(ast.unparse(inner.slice))
        kwargs["nargs"] = meta.get("nargs") or "+"
        if choices:
            kwargs["choices"] = choices
        return names, kwargs
    if ast.unparse(inner) == "bool":
        kwargs["action"] = "store_true"
        kwargs.pop("const", None)
        return names, kwargs
    kwargs["type"] = meta.get("type_parser") or _scalar_type(ast.unparse(inner))
    if choices:
        kwargs["choices"] = choices
    if meta.get("nargs"):
        kwargs["nargs"] = meta["nargs"]
    required = meta.get("required")
    if required is True or (required is None and default is _MISSING):
        kwargs["required"] = True
    return names, kwargs


def _unwrap_optional(node: ast.expr) -> tuple[ast.expr, bool]:
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Optional", "typing.Optional"):
        return node.slice, True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        if ast.unparse(node.right) == "None":
            return node.left, True
    return node, False


def _scalar_type(name: str):
    return {"int": int, "float": float}.get(name, str)
