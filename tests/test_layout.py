"""The file list shows the design: every module of the package, validation/ and benchmarks/ is
named in docs/DEVELOPMENT.md's architecture, and none grows past what one idea needs (500 lines
a module, 80 a function), so that a new idea gets its own module instead of a branch in an old
one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

TREES = ("mfsdp_hotfix", "validation", "benchmarks")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def python_files() -> list[Path]:
    return sorted(path for tree in TREES for path in (REPO / tree).rglob("*.py"))


def architecture() -> str:
    text = (REPO / "docs" / "DEVELOPMENT.md").read_text()
    return text[text.index("## Architecture"):text.index("## Tests")]


def test_every_module_is_named_in_the_architecture() -> None:
    named = set(re.findall(r"[A-Za-z0-9_]+", architecture()))
    unnamed = []
    for path in python_files():
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        if path.name == "__init__.py" and path.parent.name == "mfsdp_hotfix":
            stem = "__init__"
        if stem not in named:
            unnamed.append(str(path.relative_to(REPO)))
    assert not unnamed, f"name these in docs/DEVELOPMENT.md's Architecture: {unnamed}"


def oversized(path: Path, root: Path = REPO) -> list[str]:
    """What in ``path`` is over the limits: the module, and each function (def to last line)."""
    source = path.read_text()
    name = path.relative_to(root)
    found = []
    if len(source.splitlines()) > MAX_MODULE_LINES:
        found.append(f"{name}: {len(source.splitlines())} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_or_function_past_one_idea() -> None:
    found = [problem for path in python_files() for problem in oversized(path)]
    assert not found, "split these by idea:\n" + "\n".join(found)


def test_the_size_check_sees_a_long_function_and_module(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n")
    assert oversized(tmp_path / "long.py", tmp_path) == [
        f"long.py:1 long: {MAX_FUNCTION_LINES + 1} lines"]
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized(tmp_path / "big.py", tmp_path) == [f"big.py: {MAX_MODULE_LINES + 1} lines"]
