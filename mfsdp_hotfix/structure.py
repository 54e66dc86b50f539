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
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


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

    The shape: ``UNITS = set()`` filled (``UNITS.add(...)``) in a loop over the function's
    first argument (the incoming buckets); ``assert len(UNITS) <= N``;
    ``keep_n = len(<...>.grad_reduce_queue)``; a loop over ``reversed(<...>.grad_reduce_queue)``
    whose body adds to the same UNITS (``UNITS.add(...)``) and then, in an ``if len(UNITS) > N``
    of its own, does ``keep_n -= 1`` alone; and, as its last statement, one
    ``<...>.wait_for_previous_grad_reduce(keep_n)`` under ``torch.cuda.stream(<...>.rs_stream)``
    (``on_rs_stream`` False: the same call on its own, on the caller's stream, as the change
    proposed upstream makes it). N is an attribute path through a ``*config`` object, directly
    or through one local name assigned from it: the release drains' constant 2 made the
    configured pool size, whatever the config option is called. Not checked: which unit each
    ``add`` adds (the release's ``param_groups[bucket_id].fsdp_unit_id``) and the incoming
    loop's filter (units of ``double_buf_units``); the N-slot rule also relies on the pool
    allocators, which are not read here (docs/N_SLOT_POOLS.md).
    """
    function = _only_function(source)
    if function is None or not function.body:
        return None
    aliases = {target.id: statement.value for statement in function.body
               if isinstance(statement, ast.Assign) and len(statement.targets) == 1
               and isinstance(target := statement.targets[0], ast.Name)}
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
    filled = any(isinstance(node, ast.For) and _name(node.iter) == incoming
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


def _len_of(test: ast.expr) -> str | None:
    """NAME in ``len(NAME) <op> X``, else None."""
    if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Call)
            and _name(test.left.func) == "len" and len(test.left.args) == 1):
        return _name(test.left.args[0])
    return None


def _adds_to(node: ast.AST, name: str | None) -> bool:
    """``name.add(...)`` as a statement of its own."""
    return (name is not None and isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "add"
            and _name(node.value.func.value) == name)


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
    """Whether the function assigns ``<anything>.overwrite_main_grad`` and every such value,
    evaluated for each sharding strategy (:func:`_evaluate`), is True exactly where gradients are
    sharded (optim_grads, optim_grads_params), as NVIDIA/Megatron-LM#6357 decides. A value that
    cannot be evaluated from the strategy alone, or that yields anything else (``strategy !=
    "no_shard"`` is True for ZeRO-1), is not recognised."""
    values = _overwrite_main_grad_values(source)
    if not values:
        return False
    for strategy in STRATEGIES:
        model = _model(strategy)
        for value in values:
            try:
                if _evaluate(value, {"self": model}) is not (strategy in SHARDED_GRADIENTS):
                    return False
            except _Unknown:
                return False
    return True


def lazy_and_reduces_unsharded_once(source: str) -> bool:
    """``MegatronFSDP._register_fsdp_hooks`` that releases stale units lazily
    (:func:`releases_stale_units_lazily`) and reduces gradients in its backward hooks exactly
    when NVIDIA/Megatron-LM#6357 does (:func:`hook_reduction`)."""
    return releases_stale_units_lazily(source) and hook_reduction(source) == REDUCES_ONCE


def lazy_and_reduces_unsharded_always(source: str) -> bool:
    """As :func:`lazy_and_reduces_unsharded_once`, with the releases' reduction condition: the
    hooks reduce unsharded gradients on the last microbatch whatever overlap_grad_reduce says."""
    return releases_stale_units_lazily(source) and hook_reduction(source) == REDUCES_ALWAYS


def reduces_every_buffer(source: str) -> bool:
    """Whether ``ParamAndGradBuffer.reduce_scatter_gradients`` / ``all_reduce_gradients`` loops
    over ``<...>.parameter_groups``, takes ``gbuf = <group>.main_grad_buffer``, skips a group
    only ``if gbuf is None``, and then calls ``<...>.reduce_scatter_tensor`` or
    ``<...>.all_reduce``: the synchronous reduction ``finish_grad_sync`` runs without
    ``overlap_grad_reduce`` reduces every gradient buffer (megatron-fsdp 0.5.0 / megatron-core
    0.18.0 on; reduce-scatter from 0.3.0 / 0.16.0)."""
    return _buffer_guard(source) == "is None"


def skips_every_buffer(source: str) -> bool:
    """As :func:`reduces_every_buffer`, but the loop skips ``if gbuf is not None``: every
    gradient buffer, so the synchronous reduction reduces nothing (megatron-fsdp 0.1.0-0.2.3 /
    megatron-core 0.14-0.15 both, 0.3.0-0.4.0 / 0.16-0.17 the all-reduce)."""
    return _buffer_guard(source) == "is not None"


def _buffer_guard(source: str) -> str | None:
    function = _only_function(source)
    if function is None:
        return None
    guards = set()
    for loop in ast.walk(function):
        if not (isinstance(loop, ast.For) and _attribute(loop.iter) == "parameter_groups"):
            continue
        taken = {_names(node.targets)[0] for node in loop.body if isinstance(node, ast.Assign)
                 and len(node.targets) == 1 and _attribute(node.value) == "main_grad_buffer"}
        reduces = _called_attributes(loop) & {"reduce_scatter_tensor", "all_reduce"}
        for node in loop.body:
            if (isinstance(node, ast.If) and len(node.body) == 1
                    and isinstance(node.body[0], ast.Continue) and not node.orelse
                    and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
                    and _name(node.test.left) in taken and reduces
                    and isinstance(node.test.comparators[0], ast.Constant)
                    and node.test.comparators[0].value is None):
                if isinstance(node.test.ops[0], ast.Is):
                    guards.add("is None")
                elif isinstance(node.test.ops[0], ast.IsNot):
                    guards.add("is not None")
    return guards.pop() if len(guards) == 1 else None


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SHARDED_GRADIENTS = ("optim_grads", "optim_grads_params")
REDUCES_ONCE, REDUCES_ALWAYS = "once", "always"


def hook_reduction(source: str) -> str | None:
    """When the backward hooks of ``_register_fsdp_hooks`` reduce gradients: every ``if`` whose
    body calls ``<...>.reduce_gradients(...)`` is evaluated (:func:`_evaluate`, with the names
    its enclosing function assigned before it) for each strategy, ``overlap_grad_reduce``,
    ``is_last_microbatch`` and ``model_auto_sync``. :data:`REDUCES_ONCE`: each reduces with
    sharded gradients, else only with overlap on the last microbatch or auto-sync
    (NVIDIA/Megatron-LM#6357). :data:`REDUCES_ALWAYS`: each reduces with sharded gradients, on
    the last microbatch or with auto-sync (every release). None: anything else, or no such
    ``if``."""
    function = _only_function(source)
    if function is None:
        return None
    tables = []
    for scope in ast.walk(function):
        if not isinstance(scope, ast.FunctionDef) or scope is function:
            continue
        for statement in ast.walk(scope):
            if isinstance(statement, ast.If) and any(
                    _attribute(call.func) == "reduce_gradients"
                    for body_statement in statement.body for call in ast.walk(body_statement)
                    if isinstance(call, ast.Call)):
                tables.append(_reduction_table(scope, statement))
    if not tables or None in tables:
        return None
    for name, wanted in ((REDUCES_ONCE, True), (REDUCES_ALWAYS, False)):
        expected = {case: sharded or ((overlap or not wanted) and (last or auto))
                    for case in _reduction_cases()
                    for sharded, overlap, last, auto in [(case[0] in SHARDED_GRADIENTS,
                                                          *case[1:])]}
        if all(table == expected for table in tables):
            return name
    return None


def _reduction_cases() -> list[tuple[str, bool, bool, bool]]:
    return [(strategy, overlap, last, auto) for strategy in STRATEGIES
            for overlap in (False, True) for last in (False, True) for auto in (False, True)]


def _reduction_table(scope: ast.FunctionDef, branch: ast.If
                     ) -> dict[tuple[str, bool, bool, bool], bool] | None:
    """What ``branch.test`` yields per case, with the names ``scope`` assigned above it."""
    assignments = [node for node in ast.walk(scope) if isinstance(node, ast.Assign)
                   and node.lineno < branch.lineno and len(node.targets) == 1
                   and isinstance(node.targets[0], ast.Name)]
    assignments.sort(key=lambda node: node.lineno)
    table = {}
    for case in _reduction_cases():
        strategy, overlap, last, auto = case
        env: dict[str, object] = {"self": _model(strategy, overlap, last, auto)}
        for node in assignments:
            try:
                env[_names(node.targets)[0] or ""] = _evaluate(node.value, env)
            except _Unknown:
                continue
        try:
            table[case] = bool(_evaluate(branch.test, env))
        except _Unknown:
            return None
    return table


def _model(strategy: str, overlap: bool = True, last: bool = False, auto: bool = False
           ) -> SimpleNamespace:
    """What a MegatronFSDP's decisions read: its strategy, its ddp_config, its sync flags."""
    config = SimpleNamespace(data_parallel_sharding_strategy=strategy,
                             overlap_grad_reduce=overlap)
    return SimpleNamespace(data_parallel_sharding_strategy=strategy, ddp_config=config,
                           is_last_microbatch=last, model_auto_sync=auto)


class _Unknown(Exception):
    """An expression :func:`_evaluate` does not evaluate."""


def _evaluate(node: ast.expr, env: dict[str, object]) -> object:
    """The value of a decision made of constants, names in ``env``, attributes of the
    :func:`_model`, ``getattr(x, "name", default)``, comparisons, ``and``/``or``/``not`` and
    literal lists; anything else (a call, a subscript, an unknown name) raises _Unknown."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise _Unknown(node.id)
        return env[node.id]
    if isinstance(node, ast.Attribute):
        owner = _evaluate(node.value, env)
        if not isinstance(owner, SimpleNamespace) or not hasattr(owner, node.attr):
            raise _Unknown(node.attr)
        return getattr(owner, node.attr)
    if (isinstance(node, ast.Call) and _name(node.func) == "getattr" and len(node.args) == 3
            and not node.keywords and isinstance(node.args[1], ast.Constant)):
        owner = _evaluate(node.args[0], env)
        if not isinstance(owner, SimpleNamespace) or not isinstance(node.args[1].value, str):
            raise _Unknown("getattr")
        return getattr(owner, node.args[1].value, _evaluate(node.args[2], env))
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_evaluate(element, env) for element in node.elts]
    if isinstance(node, ast.BoolOp):
        values = [bool(_evaluate(value, env)) for value in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _evaluate(node.operand, env)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        left, right = _evaluate(node.left, env), _evaluate(node.comparators[0], env)
        compare = _COMPARISONS.get(type(node.ops[0]))
        if compare is None:
            raise _Unknown(type(node.ops[0]).__name__)
        try:
            return compare(left, right)
        except TypeError as exc:
            raise _Unknown(str(exc)) from exc
    raise _Unknown(type(node).__name__)


_COMPARISONS: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Eq: lambda a, b: bool(a == b), ast.NotEq: lambda a, b: bool(a != b),
    ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
}


def _overwrite_main_grad_values(source: str) -> list[ast.expr]:
    function = _only_function(source)
    if function is None:
        return []
    return [node.value for node in ast.walk(function) if isinstance(node, ast.Assign)
            and any(isinstance(target, ast.Attribute) and target.attr == "overwrite_main_grad"
                    for target in node.targets)]


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def fsdp_wgrad_overwrites(source: str) -> bool:
    """``LinearWithGradAccumulationAndAsyncCommunication.backward`` (megatron-core's fused
    linear): whether it has a Megatron-FSDP branch (:func:`_fsdp_wgrad_branch`) and nothing in
    that branch reads ``overwrite_main_grad``, so the wgrad written into the weight's
    ``main_grad`` there overwrites it whatever the parameter says (every release, NVIDIA main
    as of d98e8a64dd)."""
    branch = _fsdp_wgrad_branch(source)
    return branch is not None and "overwrite_main_grad" not in _names_read(branch)


def fsdp_wgrad_follows_overwrite_main_grad(source: str) -> bool:
    """As :func:`fsdp_wgrad_overwrites`, but the branch reads ``overwrite_main_grad`` (an
    attribute, or ``getattr(weight, "overwrite_main_grad", ...)``): the change proposed
    upstream, which overwrites only where the parameter says so. Which way each value leads is
    not checked here: the fix is not applied to such a tree, and its own test (upstream/)
    shows the way."""
    branch = _fsdp_wgrad_branch(source)
    return branch is not None and "overwrite_main_grad" in _names_read(branch)


def _fsdp_wgrad_branch(source: str) -> ast.If | None:
    """The ``if hasattr(<w>, "__fsdp_param__"):`` of a function that reads
    ``<ctx>.gradient_accumulation_fusion``, whose body assigns ``<w>.main_grad =
    <w>.get_main_grad()``: the fused wgrad of a Megatron-FSDP weight, written into the bucket
    its lazy getter hands out (what ``core-linear-accumulate`` rests on). None if there is not
    exactly one."""
    function = _only_function(source)
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
    if (isinstance(test, ast.Call) and _name(test.func) == "hasattr" and len(test.args) == 2
            and isinstance(test.args[1], ast.Constant) and test.args[1].value == "__fsdp_param__"):
        return _name(test.args[0])
    return None


def _takes_main_grad(statement: ast.stmt, weight: str | None) -> bool:
    """``<weight>.main_grad = <weight>.get_main_grad()``."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
        return False
    target, value = statement.targets[0], statement.value
    return (isinstance(target, ast.Attribute) and target.attr == "main_grad"
            and _name(target.value) == weight and isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute) and value.func.attr == "get_main_grad"
            and _name(value.func.value) == weight and not value.args)


def _names_read(node: ast.AST) -> set[str]:
    """Attribute names and string constants under ``node`` (``getattr(w, "name", ...)``)."""
    return ({child.attr for child in ast.walk(node) if isinstance(child, ast.Attribute)}
            | {child.value for child in ast.walk(node)
               if isinstance(child, ast.Constant) and isinstance(child.value, str)})
