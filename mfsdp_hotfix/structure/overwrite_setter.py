"""``MegatronFSDP.all_gather_and_wait_parameters_ready`` recognised by structure: whether it
sets ``overwrite_main_grad`` always, or per parameter exactly where gradients are sharded."""

from __future__ import annotations

import ast

from .decisions import SHARDED_GRADIENTS, STRATEGIES, FunctionReader, Unknown, evaluate, model_for
from .syntax import only_function


def always_overwrites_main_grad(source: str) -> bool:
    """Whether the function assigns ``<anything>.overwrite_main_grad`` and every such assignment
    is the constant ``True``: fused wgrad overwrites ``main_grad`` whatever the strategy (the
    releases before NVIDIA/Megatron-LM#6357). A write it cannot read (:func:`_overwrite_stores`)
    is not recognised."""
    function = only_function(source)
    stores = _overwrite_stores(function) if function is not None else None
    return bool(stores) and all(_is_true(value) for _, value in stores or ())


def decides_overwrite_main_grad(source: str) -> bool:
    """Whether the function assigns ``<anything>.overwrite_main_grad`` and every such value,
    evaluated for each sharding strategy (:func:`evaluate`, with the names decided where it is
    assigned, :meth:`FunctionReader.environment`) wherever its assignment may run, is True exactly
    where gradients are sharded (optim_grads, optim_grads_params), as NVIDIA/Megatron-LM#6357
    decides. A value or a condition on the way to it that cannot be evaluated from the strategy
    alone (a call, ``getattr`` of an attribute the model does not hold, a name bound in a
    branch), a write in another form (``setattr``, unpacking), a write of the state the decision
    reads, or a value that yields anything else (``strategy != "no_shard"`` is True for ZeRO-1)
    is not recognised."""
    function = only_function(source)
    stores = _overwrite_stores(function) if function is not None else None
    if function is None or not stores:
        return False
    reader = FunctionReader(function)
    if reader.writes_model_state():
        return False
    for strategy in STRATEGIES:
        model = model_for(strategy)
        for statement, value in stores:
            reached = reader.reached(statement, model)
            scope = reader.scope(statement)
            try:
                if reached is None or (reached and evaluate(
                        value, reader.environment(scope, statement, model))
                        is not (strategy in SHARDED_GRADIENTS)):
                    return False
            except Unknown:
                return False
    return True


def _overwrite_stores(function: ast.FunctionDef) -> list[tuple[ast.stmt, ast.expr]] | None:
    """Each write of ``<anything>.overwrite_main_grad`` in the function, nested functions
    included: (its statement, the value); None where one is written another way (unpacking,
    ``+=``, ``del``, ``setattr``, by its name as a string), so the values cannot all be read."""
    stores: list[tuple[ast.stmt, ast.expr]] = []
    for node in ast.walk(function):
        if isinstance(node, ast.Constant) and node.value == "overwrite_main_grad":
            return None
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (isinstance(target, ast.Attribute) and target.attr == "overwrite_main_grad"
                        and not isinstance(node, ast.AugAssign) and node.value is not None):
                    stores.append((node, node.value))
    written = [node for node in ast.walk(function) if isinstance(node, ast.Attribute)
               and node.attr == "overwrite_main_grad" and not isinstance(node.ctx, ast.Load)]
    return stores if len(written) == len(stores) else None


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


# The tests the registry's shapes name (``Shape.structure``).
RECOGNISERS = (always_overwrites_main_grad, decides_overwrite_main_grad)
