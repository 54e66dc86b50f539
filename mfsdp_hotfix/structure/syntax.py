"""Reading one function's syntax tree: the small matchers the recognisers are made of."""

from __future__ import annotations

import ast
import textwrap


def only_function(source: str) -> ast.FunctionDef | None:
    """The function ``source`` defines, when it is the one thing it defines and it parses."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    function = tree.body[0] if len(tree.body) == 1 else None
    return function if isinstance(function, ast.FunctionDef) else None


def name_ids(nodes: list[ast.expr]) -> list[str | None]:
    """:func:`name_id` of each node."""
    return [node.id if isinstance(node, ast.Name) else None for node in nodes]


def name_id(node: ast.expr) -> str | None:
    """The name a bare ``Name`` node spells, else None."""
    return node.id if isinstance(node, ast.Name) else None


def attribute_of(node: ast.expr) -> str | None:
    """The attribute an ``Attribute`` node looks up (``x`` in ``<...>.x``), else None."""
    return node.attr if isinstance(node, ast.Attribute) else None


def looked_up(node: ast.AST) -> str | None:
    """An attribute's name, or a string constant: what a node may call or look up."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def names_in(node: ast.AST) -> set[str]:
    """Every attribute name and string constant in ``node`` (:func:`looked_up`; a string
    constant counts for ``getattr(w, "name", ...)``)."""
    return {name for inner in ast.walk(node) if (name := looked_up(inner)) is not None}
