"""Code-shape fingerprints: a hash of a function's source that ignores layout and comments.

The normalisation (strip each line, drop empty and comment-only lines, join with newlines,
sha256) is the one the registry's fingerprints were computed with from every released wheel, so
hashes computed here at runtime equal them. ``main_grad_getter`` is a closure created inside
``ParamAndGradBuffer._init_each_parameter_group_buffers``; it is found in that method's code
object, so nothing has to be built to fingerprint it.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import types
from pathlib import Path
from typing import Any

from .errors import SourceUnavailable as SourceUnavailable


def fp_code(source: str) -> str:
    """sha256 of the source with blank and comment-only lines dropped and lines stripped."""
    lines = (line.strip() for line in source.splitlines())
    kept = [line for line in lines if line and not line.startswith("#")]
    return hashlib.sha256("\n".join(kept).encode("utf-8")).hexdigest()


def source_of(obj: Any) -> str:
    """The source of a function, method or code object, unwrapping decorators and wrappers."""
    if isinstance(obj, types.CodeType):
        obj = _function_from_code(obj)
    try:
        return inspect.getsource(inspect.unwrap(obj))
    except (OSError, TypeError) as exc:
        raise SourceUnavailable(
            f"no source for {getattr(obj, '__qualname__', obj)!r}: {exc}") from exc


def nested_code(function: Any, name: str) -> types.CodeType | None:
    """The code object of the function ``name`` defined inside ``function``, if any."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    pending = [code] if code is not None else []
    while pending:
        current = pending.pop()
        for const in current.co_consts:
            if isinstance(const, types.CodeType):
                if const.co_name == name:
                    return const
                pending.append(const)
    return None


def _function_from_code(code: types.CodeType) -> types.FunctionType:
    cells = tuple(types.CellType() for _ in code.co_freevars) or None
    return types.FunctionType(code, {}, code.co_name, None, cells)


class ParsedFile:
    """A Python file parsed once, answering ``source(qualname)`` as ``inspect.getsource`` would:
    the full physical lines of the ``def`` (from its first decorator) to its last line."""

    def __init__(self, text: str) -> None:
        self._lines = text.splitlines(keepends=True)
        self._defs: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self._collect(ast.parse(text), "")

    def source(self, qualname: str) -> str:
        node = self._defs[qualname]
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        return "".join(self._lines[first - 1:node.end_lineno])

    def _collect(self, node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = prefix + child.name
                self._defs.setdefault(qualname, child)
                self._collect(child, qualname + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                self._collect(child, prefix + child.name + ".")
            else:
                self._collect(child, prefix)


def parse_file(path: Path) -> ParsedFile:
    """Parse ``path``; an unreadable file raises :class:`SourceUnavailable`."""
    try:
        return ParsedFile(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        raise SourceUnavailable(f"cannot read {path}: {exc}") from exc
