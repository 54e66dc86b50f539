"""Code shapes recognised by structure rather than by text.

A fingerprint names one exact text; a fork or a backport that makes the same change in its own
words (ROCm/Megatron-LM PR #146 ports NVIDIA #5222's getter guard through
``self.grad_reduce_pipeline`` instead of ``p._megatron_fsdp_model.grad_reduce_pipeline``) has a
new text but the property the fixes care about. Each test here reads one function's source and
answers one yes/no question about its syntax tree; the registry names the test per shape.
"""

from __future__ import annotations

import ast
import textwrap


def drains_before_fetching(source: str) -> bool:
    """Whether the function's body calls ``<anything>._enforce_double_buffer_limit(...)`` as a
    statement of its own, unconditionally, before any statement that calls ``fetch_bucket``
    (and a ``fetch_bucket`` call follows): the getter makes room in the pool before it takes a
    bucket, whatever attribute path reaches the pipeline."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return False
    function = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(function, ast.FunctionDef):
        return False
    drained = False
    for statement in function.body:
        if "fetch_bucket" in _called_attributes(statement):
            return drained
        if (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
                and _attribute(statement.value.func) == "_enforce_double_buffer_limit"):
            drained = True
    return False


def releases_stale_units_lazily(source: str) -> bool:
    """Whether ``MegatronFSDP._register_fsdp_hooks`` defines a ``release_module_parameters``
    that takes a ``lazy`` argument: the design (megatron-fsdp 0.3.0 / megatron-core 0.16.0 on)
    in which a unit left in ``PRE_BACKWARD`` gives its parameter slot back before the next
    all-gather, so ``missed-post-backward`` is not needed."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return False
    return any(isinstance(node, ast.FunctionDef) and node.name == "release_module_parameters"
               and "lazy" in {arg.arg for arg in node.args.args + node.args.kwonlyargs}
               for node in ast.walk(tree))


def _called_attributes(node: ast.AST) -> set[str]:
    return {name for call in ast.walk(node) if isinstance(call, ast.Call)
            if (name := _attribute(call.func)) is not None}


def _attribute(node: ast.expr) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else None
