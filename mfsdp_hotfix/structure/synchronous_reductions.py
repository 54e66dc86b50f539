"""The synchronous reductions (``ParamAndGradBuffer.reduce_scatter_gradients`` /
``all_reduce_gradients``) recognised by structure: whether their loop over the parameter groups
reduces every gradient buffer or skips every one."""

from __future__ import annotations

import ast

from .syntax import attribute_of, looked_up, name_id, names_in, only_function


def reduces_every_buffer(source: str) -> bool:
    """Whether ``ParamAndGradBuffer.reduce_scatter_gradients`` / ``all_reduce_gradients`` loops
    over ``<...>.parameter_groups``, takes ``gbuf = <group>.main_grad_buffer``, skips a group
    only ``if gbuf is None``, and then calls ``<...>.reduce_scatter_tensor`` or
    ``<...>.all_reduce`` unconditionally: the synchronous reduction ``finish_grad_sync`` runs
    without ``overlap_grad_reduce`` reduces every gradient buffer (megatron-fsdp 0.5.0 /
    megatron-core 0.18.0 on; reduce-scatter from 0.3.0 / 0.16.0). A collective anywhere else in
    the function is not recognised (:func:`_buffer_guard`)."""
    return _buffer_guard(source) == "is None"


def skips_every_buffer(source: str) -> bool:
    """As :func:`reduces_every_buffer`, but the loop skips ``if gbuf is not None``: every
    gradient buffer, so the synchronous reduction reduces nothing (megatron-fsdp 0.1.0-0.2.3 /
    megatron-core 0.14-0.15 both, 0.3.0-0.4.0 / 0.16-0.17 the all-reduce)."""
    return _buffer_guard(source) == "is not None"


# What the synchronous reductions call to reduce, and what a function may call instead.
COLLECTIVES = frozenset({"reduce_scatter_tensor", "all_reduce", "reduce_scatter",
                         "_reduce_scatter_base", "all_reduce_coalesced",
                         "reduce_scatter_tensor_coalesced"})


def _buffer_guard(source: str) -> str | None:
    """``"is None"`` or ``"is not None"``: the one guard of every loop over the parameter groups
    that reduces; None where a loop's guard is another, a collective comes before it or only
    conditionally after it, or a collective is named outside such a loop."""
    function = only_function(source)
    if function is None:
        return None
    loops = [node for node in ast.walk(function) if isinstance(node, ast.For)
             and attribute_of(node.iter) == "parameter_groups" and names_in(node) & COLLECTIVES]
    inside = {id(node) for loop in loops for node in ast.walk(loop)}
    if any(looked_up(node) in COLLECTIVES for node in ast.walk(function)
           if id(node) not in inside):
        return None
    guards = {_loop_guard(loop) for loop in loops}
    return guards.pop() if len(guards) == 1 else None


def _loop_guard(loop: ast.For) -> str | None:
    """The guard of one loop over the parameter groups: ``gbuf = <group>.main_grad_buffer``
    (gbuf bound nowhere else in the loop), then ``if gbuf is [not] None: continue`` with no
    collective before it; ``"is None"`` also needs a collective called as a statement of the
    loop's own after it, with nothing before that call that leaves the iteration."""
    for position, node in enumerate(loop.body):
        if not (isinstance(node, ast.If) and len(node.body) == 1
                and isinstance(node.body[0], ast.Continue) and not node.orelse
                and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
                and isinstance(node.test.comparators[0], ast.Constant)
                and node.test.comparators[0].value is None):
            continue
        name = name_id(node.test.left)
        bound = [target for statement in loop.body for target in ast.walk(statement)
                 if isinstance(target, ast.Name) and target.id == name
                 and not isinstance(target.ctx, ast.Load)]
        taken = [statement for statement in loop.body[:position]
                 if isinstance(statement, ast.Assign) and len(statement.targets) == 1
                 and statement.targets[0] in bound
                 and attribute_of(statement.value) == "main_grad_buffer"]
        if (len(bound) != 1 or len(taken) != 1
                or any(names_in(before) & COLLECTIVES for before in loop.body[:position])):
            return None
        if isinstance(node.test.ops[0], ast.IsNot):
            return "is not None"
        if not isinstance(node.test.ops[0], ast.Is):
            return None
        for after in loop.body[position + 1:]:
            value = after.value if isinstance(after, (ast.Expr, ast.Assign)) else None
            if isinstance(value, ast.Call) and attribute_of(value.func) in COLLECTIVES:
                return "is None"
            if any(isinstance(leaves, (ast.Continue, ast.Break, ast.Return, ast.Raise))
                   for leaves in ast.walk(after)):
                return None
        return None
    return None


# The tests the registry's shapes name (``Shape.structure``).
RECOGNISERS = (reduces_every_buffer, skips_every_buffer)
