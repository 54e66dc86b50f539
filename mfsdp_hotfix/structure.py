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


def configured_pool_size(source: str, on_rs_stream: bool = True) -> str | None:
    """The config attribute a drain shaped like NVIDIA PR #6316's takes its pool size N from
    (``self.buffer.ddp_config.fsdp_buffer_count``), else None.

    The shape: ``keep_n = len(<...>.grad_reduce_queue)``; ``assert len(UNITS) <= N`` on the
    incoming units; a loop over ``reversed(<...>.grad_reduce_queue)`` that adds each entry's unit
    and does ``keep_n -= 1`` while ``len(UNITS) > N``; and, as its last statement, one
    ``<...>.wait_for_previous_grad_reduce(keep_n)`` under ``torch.cuda.stream(<...>.rs_stream)``
    (``on_rs_stream`` False: the same call on its own, on the caller's stream, as the change
    proposed upstream makes it). N is an attribute path through a ``*config`` object, directly
    or through one local name assigned from it: the release drains' constant 2 made the
    configured pool size, whatever the config option is called.
    """
    function = _only_function(source)
    if function is None or not function.body:
        return None
    aliases = {target.id: statement.value for statement in function.body
               if isinstance(statement, ast.Assign) and len(statement.targets) == 1
               and isinstance(target := statement.targets[0], ast.Name)}
    limit = _config_path(next((bound for node in ast.walk(function) if isinstance(node, ast.Assert)
                               if (bound := _len_bound(node.test, ast.LtE)) is not None), None),
                         aliases)
    waits_last = _waits_last_under_rs_stream if on_rs_stream else _waits_last
    if limit is None or not waits_last(function.body[-1], "keep_n"):
        return None
    counted = any(isinstance(node, ast.For) and _is_reversed_queue(node.iter)
                  and any(isinstance(inner, ast.If)
                          and _config_path(_len_bound(inner.test, ast.Gt), aliases) == limit
                          and _decrements(inner.body, "keep_n") for inner in node.body)
                  for node in ast.walk(function))
    starts_full = any(isinstance(node, ast.Assign) and _names(node.targets) == ["keep_n"]
                      and isinstance(node.value, ast.Call) and _name(node.value.func) == "len"
                      and len(node.value.args) == 1
                      and _attribute(node.value.args[0]) == "grad_reduce_queue"
                      for node in function.body)
    return limit if counted and starts_full else None


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
    function = _only_function(source)
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


def _only_function(source: str) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    function = tree.body[0] if len(tree.body) == 1 else None
    return function if isinstance(function, ast.FunctionDef) else None


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
            and _name(test.left.func) == "len" and len(test.left.args) == 1
            and isinstance(test.left.args[0], ast.Name)):
        return test.comparators[0]
    return None


def _is_reversed_queue(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and _name(node.func) == "reversed" and len(node.args) == 1
            and _attribute(node.args[0]) == "grad_reduce_queue")


def _decrements(body: list[ast.stmt], name: str) -> bool:
    """The body is ``name -= 1`` alone."""
    return (len(body) == 1 and isinstance(step := body[0], ast.AugAssign)
            and isinstance(step.op, ast.Sub) and _names([step.target]) == [name]
            and isinstance(step.value, ast.Constant) and step.value.value == 1)


def _waits_last_under_rs_stream(statement: ast.stmt, argument: str) -> bool:
    """``with <...>.stream(<...>.rs_stream): <...>.wait_for_previous_grad_reduce(argument)``."""
    if not (isinstance(statement, ast.With) and len(statement.items) == 1
            and len(statement.body) == 1):
        return False
    context = statement.items[0].context_expr
    return (isinstance(context, ast.Call) and _attribute(context.func) == "stream"
            and len(context.args) == 1 and _attribute(context.args[0]) == "rs_stream"
            and _waits_last(statement.body[0], argument))


def _waits_last(statement: ast.stmt, argument: str) -> bool:
    """``<...>.wait_for_previous_grad_reduce(argument)`` as a statement of its own."""
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            and _attribute(statement.value.func) == "wait_for_previous_grad_reduce"
            and _names(statement.value.args) == [argument] and not statement.value.keywords)


def _names(nodes: list[ast.expr]) -> list[str | None]:
    return [node.id if isinstance(node, ast.Name) else None for node in nodes]


def _name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _called_attributes(node: ast.AST) -> set[str]:
    return {name for call in ast.walk(node) if isinstance(call, ast.Call)
            if (name := _attribute(call.func)) is not None}


def _attribute(node: ast.expr) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else None


def always_overwrites_main_grad(source: str) -> bool:
    """Whether the function assigns ``<anything>.overwrite_main_grad`` and every such assignment
    is the constant ``True``: fused wgrad overwrites ``main_grad`` whatever the strategy (the
    releases before NVIDIA/Megatron-LM#6357)."""
    values = _overwrite_main_grad_values(source)
    return bool(values) and all(_is_true(value) for value in values)


def decides_overwrite_main_grad(source: str) -> bool:
    """Whether the function assigns ``<anything>.overwrite_main_grad`` and never the constant
    ``True``: the value is computed (from the strategy, as NVIDIA/Megatron-LM#6357 does, or per
    parameter)."""
    values = _overwrite_main_grad_values(source)
    return bool(values) and not any(isinstance(value, ast.Constant) for value in values)


def _overwrite_main_grad_values(source: str) -> list[ast.expr]:
    function = _only_function(source)
    if function is None:
        return []
    return [node.value for node in ast.walk(function) if isinstance(node, ast.Assign)
            and any(isinstance(target, ast.Attribute) and target.attr == "overwrite_main_grad"
                    for target in node.targets)]


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True
