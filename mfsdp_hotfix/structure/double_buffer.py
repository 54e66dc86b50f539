"""The double buffer's functions recognised by structure: the getter that drains before it
fetches (a port of NVIDIA #5222's guard in its own words), the drain that keeps its configured
pool size live (NVIDIA PR #6316), and the slot count the pool builder gives the gradient pool."""

from __future__ import annotations

import ast
from collections import Counter

from .syntax import attribute_of, name_id, name_ids, names_in, only_function


def drains_before_fetching(source: str) -> bool:
    """Whether the function's body calls ``<anything>._enforce_double_buffer_limit(...)`` as a
    statement of its own, unconditionally, before any statement that names ``fetch_bucket``
    (calls it, or takes it to call later; and such a statement follows): the getter makes room
    in the pool before it takes a bucket, whatever attribute path reaches the pipeline."""
    function = only_function(source)
    if function is None:
        return False
    drained = False
    for statement in function.body:
        if "fetch_bucket" in names_in(statement):
            return drained
        if (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
                and attribute_of(statement.value.func) == "_enforce_double_buffer_limit"):
            drained = True
    return False


def configured_pool_size(source: str, on_rs_stream: bool = True) -> str | None:
    """The config attribute a drain shaped like NVIDIA PR #6316's takes its pool size N from
    (``self.buffer.ddp_config.fsdp_buffer_count``), else None.

    The shape: ``UNITS = set()`` filled (``UNITS.add(...)``) in a loop over the function's
    first argument (the incoming buckets); ``assert len(UNITS) <= N``;
    ``keep_n = len(<...>.grad_reduce_queue)``; a loop over ``reversed(<...>.grad_reduce_queue)``
    whose body adds to the same UNITS (``UNITS.add(...)``) and then, in an ``if len(UNITS) > N``
    of its own, does ``keep_n -= 1`` alone; and, as its last statement, one
    ``<...>.wait_for_previous_grad_reduce(keep_n)`` under ``torch.cuda.stream(<...>.rs_stream)``
    (``on_rs_stream`` False: the same call on its own, on the caller's stream, as the change
    proposed upstream makes it). N is an attribute path through a ``*config`` object, directly
    or through one local name assigned from it and bound nowhere else; ``keep_n`` is bound
    only where it starts and where it is counted down: the release drains' constant 2 made the
    configured pool size, whatever the config option is called. Not checked: which unit each
    ``add`` adds (the release's ``param_groups[bucket_id].fsdp_unit_id``) and the incoming
    loop's filter (units of ``double_buf_units``); the N-slot rule also relies on the pool
    allocators, which are not read here (docs/N_SLOT_POOLS.md).
    """
    function = only_function(source)
    if function is None or not function.body:
        return None
    bound = _binding_counts(function)
    aliases = {target.id: statement.value for statement in function.body
               if isinstance(statement, ast.Assign) and len(statement.targets) == 1
               and isinstance(target := statement.targets[0], ast.Name)
               and bound[target.id] == 1}
    asserted = next((node.test for node in ast.walk(function) if isinstance(node, ast.Assert)
                     and _len_bound(node.test, ast.LtE) is not None), None)
    if asserted is None:
        return None
    units = _len_of(asserted)
    limit = _config_path(_len_bound(asserted, ast.LtE), aliases)
    waits_last = _waits_last_under_rs_stream if on_rs_stream else _waits_last
    if limit is None or not waits_last(function.body[-1], "keep_n"):
        return None
    incoming = function.args.args[1].arg if len(function.args.args) > 1 else None
    filled = any(isinstance(node, ast.For) and name_id(node.iter) == incoming
                 and any(_adds_to(inner, units) for inner in ast.walk(node))
                 for node in function.body)
    counted = any(isinstance(node, ast.For) and _is_reversed_queue(node.iter)
                  and any(isinstance(inner, ast.If) and _len_of(inner.test) == units
                          and _config_path(_len_bound(inner.test, ast.Gt), aliases) == limit
                          and _decrements(inner.body, "keep_n")
                          and any(_adds_to(before, units) for before in node.body[:position])
                          for position, inner in enumerate(node.body))
                  for node in ast.walk(function))
    counted = counted and filled
    starts_full = any(isinstance(node, ast.Assign) and name_ids(node.targets) == ["keep_n"]
                      and isinstance(node.value, ast.Call) and name_id(node.value.func) == "len"
                      and len(node.value.args) == 1
                      and attribute_of(node.value.args[0]) == "grad_reduce_queue"
                      for node in function.body)
    # keep_n is bound twice: where it starts full and where it is counted down
    return limit if counted and starts_full and bound["keep_n"] == 2 else None


def _binding_counts(function: ast.FunctionDef) -> Counter[str]:
    """How many times each name is bound anywhere in ``function`` (targets and arguments)."""
    return Counter([node.id for node in ast.walk(function) if isinstance(node, ast.Name)
                    and not isinstance(node.ctx, ast.Load)]
                   + [node.arg for node in ast.walk(function) if isinstance(node, ast.arg)])


def drains_to_configured_pool_size(source: str) -> bool:
    """Whether the drain keeps its configured pool size N live (:func:`configured_pool_size`)."""
    return configured_pool_size(source) is not None


def drains_to_configured_pool_size_on_callers_stream(source: str) -> bool:
    """Whether the drain keeps its configured pool size N live and waits on the caller's stream
    (:func:`configured_pool_size` with ``on_rs_stream`` False)."""
    return configured_pool_size(source, on_rs_stream=False) is not None


def gradient_pool_size(source: str) -> int | str | None:
    """The slot count ``ParamAndGradBuffer._init_each_parameter_group_buffers`` gives the
    gradient pool (the allocator built with ``name="fsdp_grads"``): an int where the code fixes
    it (every release: ``UB_BUFFER_NUM = 2``), else the expression it is read from (NVIDIA PR
    #6316: ``self.ddp_config.fsdp_buffer_count``); None where no such allocator is built."""
    function = only_function(source)
    if function is None:
        return None
    assigned = {target.id: node.value for node in ast.walk(function)
                if isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(target := node.targets[0], ast.Name)}
    for call in ast.walk(function):
        if not isinstance(call, ast.Call):
            continue
        keywords = {k.arg: k.value for k in call.keywords if k.arg is not None}
        name = keywords.get("name")
        if (isinstance(name, ast.Constant) and name.value == "fsdp_grads"
                and "size" in keywords):
            size = keywords["size"]
            if isinstance(size, ast.Name) and size.id in assigned:
                size = assigned[size.id]
            if isinstance(size, ast.Constant) and isinstance(size.value, int):
                return size.value
            return ast.unparse(size)
    return None


def _config_path(node: ast.expr | None, aliases: dict[str, ast.expr]) -> str | None:
    """``self.buffer.ddp_config.fsdp_buffer_count`` for an attribute path that passes through a
    ``*config`` attribute (or a local name assigned one), else None."""
    if isinstance(node, ast.Name) and node.id in aliases:
        node = aliases[node.id]
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or len(parts) < 2 or not parts[1].endswith("config"):
        return None
    return ".".join([node.id, *reversed(parts)])


def _len_bound(test: ast.expr, operator: type[ast.cmpop]) -> ast.expr | None:
    """X in ``len(NAME) <operator> X``, else None."""
    if (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], operator) and isinstance(test.left, ast.Call)
            and name_id(test.left.func) == "len" and len(test.left.args) == 1
            and isinstance(test.left.args[0], ast.Name)):
        return test.comparators[0]
    return None


def _len_of(test: ast.expr) -> str | None:
    """NAME in ``len(NAME) <op> X``, else None."""
    if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Call)
            and name_id(test.left.func) == "len" and len(test.left.args) == 1):
        return name_id(test.left.args[0])
    return None


def _adds_to(node: ast.AST, name: str | None) -> bool:
    """``name.add(...)`` as a statement of its own."""
    return (name is not None and isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "add"
            and name_id(node.value.func.value) == name)


def _is_reversed_queue(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and name_id(node.func) == "reversed" and len(node.args) == 1
            and attribute_of(node.args[0]) == "grad_reduce_queue")


def _decrements(body: list[ast.stmt], name: str) -> bool:
    """The body is ``name -= 1`` alone."""
    return (len(body) == 1 and isinstance(step := body[0], ast.AugAssign)
            and isinstance(step.op, ast.Sub) and name_ids([step.target]) == [name]
            and isinstance(step.value, ast.Constant) and step.value.value == 1)


def _waits_last_under_rs_stream(statement: ast.stmt, argument: str) -> bool:
    """``with <...>.stream(<...>.rs_stream): <...>.wait_for_previous_grad_reduce(argument)``."""
    if not (isinstance(statement, ast.With) and len(statement.items) == 1
            and len(statement.body) == 1):
        return False
    context = statement.items[0].context_expr
    return (isinstance(context, ast.Call) and attribute_of(context.func) == "stream"
            and len(context.args) == 1 and attribute_of(context.args[0]) == "rs_stream"
            and _waits_last(statement.body[0], argument))


def _waits_last(statement: ast.stmt, argument: str) -> bool:
    """``<...>.wait_for_previous_grad_reduce(argument)`` as a statement of its own."""
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            and attribute_of(statement.value.func) == "wait_for_previous_grad_reduce"
            and name_ids(statement.value.args) == [argument] and not statement.value.keywords)


# The tests the registry's shapes name (``Shape.structure``).
RECOGNISERS = (drains_before_fetching, drains_to_configured_pool_size,
               drains_to_configured_pool_size_on_callers_stream)
