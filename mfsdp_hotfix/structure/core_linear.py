"""megatron-core's fused linear backward recognised by structure: whether its Megatron-FSDP
branch overwrites ``main_grad`` or follows the parameter's ``overwrite_main_grad``."""

from __future__ import annotations

import ast

from .syntax import name_id, names_in, only_function


def fsdp_wgrad_overwrites(source: str) -> bool:
    """``LinearWithGradAccumulationAndAsyncCommunication.backward`` (megatron-core's fused
    linear): whether it has a Megatron-FSDP branch (:func:`_fsdp_wgrad_branch`) and nothing in
    that branch reads ``overwrite_main_grad``, so the wgrad written into the weight's
    ``main_grad`` there overwrites it whatever the parameter says (every release, NVIDIA main
    as of d98e8a64dd)."""
    branch = _fsdp_wgrad_branch(source)
    return branch is not None and "overwrite_main_grad" not in names_in(branch)


def fsdp_wgrad_follows_overwrite_main_grad(source: str) -> bool:
    """As :func:`fsdp_wgrad_overwrites`, but the branch reads ``overwrite_main_grad`` (an
    attribute, or ``getattr(weight, "overwrite_main_grad", ...)``): the change proposed
    upstream, which overwrites only where the parameter says so. Which way each value leads is
    not checked here: the fix is not applied to such a tree, and its own test (upstream/)
    shows the way."""
    branch = _fsdp_wgrad_branch(source)
    return branch is not None and "overwrite_main_grad" in names_in(branch)


def _fsdp_wgrad_branch(source: str) -> ast.If | None:
    """The ``if hasattr(<w>, "__fsdp_param__"):`` of a function that reads
    ``<ctx>.gradient_accumulation_fusion``, whose body assigns ``<w>.main_grad =
    <w>.get_main_grad()``: the fused wgrad of a Megatron-FSDP weight, written into the bucket
    its lazy getter hands out (what ``core-linear-accumulate`` rests on). None if there is not
    exactly one."""
    function = only_function(source)
    if function is None or "gradient_accumulation_fusion" not in {
            node.attr for node in ast.walk(function) if isinstance(node, ast.Attribute)}:
        return None
    branches = [node for node in ast.walk(function) if isinstance(node, ast.If)
                and _tests_fsdp_param(node.test) is not None
                and any(_takes_main_grad(statement, _tests_fsdp_param(node.test))
                        for statement in node.body)]
    return branches[0] if len(branches) == 1 else None


def _tests_fsdp_param(test: ast.expr) -> str | None:
    """``w`` for the test ``hasattr(w, "__fsdp_param__")``, else None."""
    if (isinstance(test, ast.Call) and name_id(test.func) == "hasattr" and len(test.args) == 2
            and isinstance(test.args[1], ast.Constant) and test.args[1].value == "__fsdp_param__"):
        return name_id(test.args[0])
    return None


def _takes_main_grad(statement: ast.stmt, weight: str | None) -> bool:
    """``<weight>.main_grad = <weight>.get_main_grad()``."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
        return False
    target, value = statement.targets[0], statement.value
    return (isinstance(target, ast.Attribute) and target.attr == "main_grad"
            and name_id(target.value) == weight and isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute) and value.func.attr == "get_main_grad"
            and name_id(value.func.value) == weight and not value.args)


# The tests the registry's shapes name (``Shape.structure``).
RECOGNISERS = (fsdp_wgrad_overwrites, fsdp_wgrad_follows_overwrite_main_grad)
