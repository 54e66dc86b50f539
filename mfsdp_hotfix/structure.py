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
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


def drains_before_fetching(source: str) -> bool:
    """Whether the function's body calls ``<anything>._enforce_double_buffer_limit(...)`` as a
    statement of its own, unconditionally, before any statement that names ``fetch_bucket``
    (calls it, or takes it to call later; and such a statement follows): the getter makes room
    in the pool before it takes a bucket, whatever attribute path reaches the pipeline."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return False
    function = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(function, ast.FunctionDef):
        return False
    drained = False
    for statement in function.body:
        if "fetch_bucket" in _names_in(statement):
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
    or through one local name assigned from it and bound nowhere else; ``keep_n`` is bound
    only where it starts and where it is counted down: the release drains' constant 2 made the
    configured pool size, whatever the config option is called. Not checked: which unit each
    ``add`` adds (the release's ``param_groups[bucket_id].fsdp_unit_id``) and the incoming
    loop's filter (units of ``double_buf_units``); the N-slot rule also relies on the pool
    allocators, which are not read here (docs/N_SLOT_POOLS.md).
    """
    function = _only_function(source)
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


def _attribute(node: ast.expr) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else None


def always_overwrites_main_grad(source: str) -> bool:
    """Whether the function assigns ``<anything>.overwrite_main_grad`` and every such assignment
    is the constant ``True``: fused wgrad overwrites ``main_grad`` whatever the strategy (the
    releases before NVIDIA/Megatron-LM#6357). A write it cannot read (:func:`_overwrite_stores`)
    is not recognised."""
    function = _only_function(source)
    stores = _overwrite_stores(function) if function is not None else None
    return bool(stores) and all(_is_true(value) for _, value in stores or ())


def decides_overwrite_main_grad(source: str) -> bool:
    """Whether the function assigns ``<anything>.overwrite_main_grad`` and every such value,
    evaluated for each sharding strategy (:func:`_evaluate`, with the names decided where it is
    assigned, :meth:`_Function.environment`) wherever its assignment may run, is True exactly
    where gradients are sharded (optim_grads, optim_grads_params), as NVIDIA/Megatron-LM#6357
    decides. A value or a condition on the way to it that cannot be evaluated from the strategy
    alone (a call, ``getattr`` of an attribute the model does not hold, a name bound in a
    branch), a write in another form (``setattr``, unpacking), a write of the state the decision
    reads, or a value that yields anything else (``strategy != "no_shard"`` is True for ZeRO-1)
    is not recognised."""
    function = _only_function(source)
    stores = _overwrite_stores(function) if function is not None else None
    if function is None or not stores:
        return False
    reader = _Function(function)
    if reader.writes_model_state():
        return False
    for strategy in STRATEGIES:
        model = _model(strategy)
        for statement, value in stores:
            reached = reader.reached(statement, model)
            scope = reader.scope(statement)
            try:
                if reached is None or (reached and _evaluate(
                        value, reader.environment(scope, statement, model))
                        is not (strategy in SHARDED_GRADIENTS)):
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
_COLLECTIVES = frozenset({"reduce_scatter_tensor", "all_reduce", "reduce_scatter",
                          "_reduce_scatter_base", "all_reduce_coalesced",
                          "reduce_scatter_tensor_coalesced"})


def _buffer_guard(source: str) -> str | None:
    """``"is None"`` or ``"is not None"``: the one guard of every loop over the parameter groups
    that reduces; None where a loop's guard is another, a collective comes before it or only
    conditionally after it, or a collective is named outside such a loop."""
    function = _only_function(source)
    if function is None:
        return None
    loops = [node for node in ast.walk(function) if isinstance(node, ast.For)
             and _attribute(node.iter) == "parameter_groups" and _names_in(node) & _COLLECTIVES]
    inside = {id(node) for loop in loops for node in ast.walk(loop)}
    if any(_name_of(node) in _COLLECTIVES for node in ast.walk(function)
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
        name = _name(node.test.left)
        bound = [target for statement in loop.body for target in ast.walk(statement)
                 if isinstance(target, ast.Name) and target.id == name
                 and not isinstance(target.ctx, ast.Load)]
        taken = [statement for statement in loop.body[:position]
                 if isinstance(statement, ast.Assign) and len(statement.targets) == 1
                 and statement.targets[0] in bound
                 and _attribute(statement.value) == "main_grad_buffer"]
        if (len(bound) != 1 or len(taken) != 1
                or any(_names_in(before) & _COLLECTIVES for before in loop.body[:position])):
            return None
        if isinstance(node.test.ops[0], ast.IsNot):
            return "is not None"
        if not isinstance(node.test.ops[0], ast.Is):
            return None
        for after in loop.body[position + 1:]:
            value = after.value if isinstance(after, (ast.Expr, ast.Assign)) else None
            if isinstance(value, ast.Call) and _attribute(value.func) in _COLLECTIVES:
                return "is None"
            if any(isinstance(leaves, (ast.Continue, ast.Break, ast.Return, ast.Raise))
                   for leaves in ast.walk(after)):
                return None
        return None
    return None


def _name_of(node: ast.AST) -> str | None:
    """An attribute's name, or a string constant: what a node may call or look up."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _names_in(node: ast.AST) -> set[str]:
    """Every attribute name and string constant in ``node`` (:func:`_name_of`)."""
    return {name for inner in ast.walk(node) if (name := _name_of(inner)) is not None}


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SHARDED_GRADIENTS = ("optim_grads", "optim_grads_params")
REDUCES_ONCE, REDUCES_ALWAYS = "once", "always"
# The hooks' reductions the verdict is made of; any other reduction named in the hooks (a
# synchronous one, a collective) leaves them unrecognised.
_HOOK_REDUCTIONS = frozenset({"reduce_gradients", "finish_grad_sync"})
_OTHER_REDUCTIONS = _COLLECTIVES | {"start_grad_sync", "synchronize_gradient_reduce",
                                    "reduce_scatter_gradients", "all_reduce_gradients"}


def hook_reduction(source: str) -> str | None:
    """When the backward hooks of ``_register_fsdp_hooks`` reduce gradients, judged over the
    whole function: every call of ``<...>.reduce_gradients(...)`` and
    ``<...>.finish_grad_sync(...)``, in every branch and after it, is followed up to its hook
    through every condition on its way (:meth:`_Function.reached`, :func:`_evaluate` with the
    names decided there) for each strategy, ``overlap_grad_reduce``, ``is_last_microbatch`` and
    ``model_auto_sync``, and counted per hook. :data:`REDUCES_ONCE`: each hook that reduces
    calls ``reduce_gradients`` once with sharded gradients, else only with overlap on the last
    microbatch or auto-sync, and never otherwise (NVIDIA/Megatron-LM#6357);
    :data:`REDUCES_ALWAYS`: once with sharded gradients, on the last microbatch or with
    auto-sync (every release); either way ``finish_grad_sync`` once exactly with auto-sync.
    None: anything else, a condition it cannot decide, a reduction named any other way (passed
    on, looked up by name, another collective, called outside a hook), a write of the state the
    conditions read, or no ``reduce_gradients`` call."""
    function = _only_function(source)
    if function is None:
        return None
    reader = _Function(function)
    if reader.writes_model_state():
        return None
    calls: dict[tuple[ast.AST, str], list[ast.Call]] = {}
    for node in ast.walk(function):
        if _name_of(node) not in _HOOK_REDUCTIONS | _OTHER_REDUCTIONS:
            continue
        call, scope = reader.parents.get(node), reader.scope(node)
        if not (isinstance(node, ast.Attribute) and node.attr in _HOOK_REDUCTIONS
                and isinstance(call, ast.Call) and call.func is node
                and isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef))
                and scope is not function):
            return None
        calls.setdefault((scope, node.attr), []).append(call)
    if not any(name == "reduce_gradients" for _, name in calls):
        return None
    counts: dict[tuple[ast.AST, str], dict[tuple[str, bool, bool, bool], int]] = {}
    for key, group in calls.items():
        counts[key] = {}
        for case in _reduction_cases():
            reached = [reader.reached(call, _model(*case)) for call in group]
            if None in reached:
                return None
            counts[key][case] = sum(map(bool, reached))
    for name, with_overlap_only in ((REDUCES_ONCE, True), (REDUCES_ALWAYS, False)):
        if all(count == _expected(reduction, case, with_overlap_only)
               for (_, reduction), table in counts.items() for case, count in table.items()):
            return name
    return None


def _expected(reduction: str, case: tuple[str, bool, bool, bool], with_overlap_only: bool
              ) -> int:
    """How many times one hook calls ``reduction`` in ``case`` (see :func:`hook_reduction`)."""
    strategy, overlap, last, auto = case
    if reduction == "finish_grad_sync":
        return int(auto)
    return int(strategy in SHARDED_GRADIENTS
               or ((overlap or not with_overlap_only) and (last or auto)))


def _reduction_cases() -> list[tuple[str, bool, bool, bool]]:
    return [(strategy, overlap, last, auto) for strategy in STRATEGIES
            for overlap in (False, True) for last in (False, True) for auto in (False, True)]


def _model(strategy: str, overlap: bool = True, last: bool = False, auto: bool = False
           ) -> SimpleNamespace:
    """What a MegatronFSDP's decisions read: its strategy, its ddp_config, its sync flags. It
    holds nothing else: any other attribute, read with or without a default, is undecidable."""
    config = SimpleNamespace(data_parallel_sharding_strategy=strategy,
                             overlap_grad_reduce=overlap)
    return SimpleNamespace(data_parallel_sharding_strategy=strategy, ddp_config=config,
                           is_last_microbatch=last, model_auto_sync=auto)


# What the model holds (:func:`_model`): a function that writes one of these decides from state
# the model does not hold.
_MODEL_STATE = frozenset({*vars(_model("no_shard")), *vars(_model("no_shard").ddp_config)})
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


class _Function:
    """One function's syntax tree read as a whole: each node's parent, scope and statement, what
    each scope binds, which names are decided at a statement and whether a node may run."""

    def __init__(self, function: ast.FunctionDef) -> None:
        self.function = function
        self.parents = {child: parent for parent in ast.walk(function)
                        for child in ast.iter_child_nodes(parent)}
        self._cache: dict[tuple[int, int], tuple[list[ast.Assign], set[str], bool]] = {}

    def ancestors(self, node: ast.AST) -> list[ast.AST]:
        """From ``node``'s parent up to the function."""
        found = []
        while node is not self.function:
            node = self.parents[node]
            found.append(node)
        return found

    def scope(self, node: ast.AST) -> ast.AST:
        return next(up for up in self.ancestors(node) if isinstance(up, _SCOPES))

    def statement(self, node: ast.AST) -> ast.stmt:
        if isinstance(node, ast.stmt):
            return node
        return next(up for up in self.ancestors(node) if isinstance(up, ast.stmt))

    def writes_model_state(self) -> bool:
        """Whether the function writes an attribute the model holds (:data:`_MODEL_STATE`), or
        any attribute by a name or a mapping it does not spell (``setattr(x, name, v)``,
        ``__dict__``, ``vars``)."""
        for node in ast.walk(self.function):
            if isinstance(node, ast.Attribute) and (
                    (not isinstance(node.ctx, ast.Load) and node.attr in _MODEL_STATE)
                    or node.attr in ("__dict__", "__setattr__")):
                return True
            if isinstance(node, ast.Call) and _name(node.func) in ("setattr", "delattr",
                                                                    "vars"):
                named = node.args[1] if len(node.args) > 1 else None
                if not (isinstance(named, ast.Constant) and named.value not in _MODEL_STATE):
                    return True
        return False

    def bindings(self, scope: ast.AST) -> dict[str, list[ast.AST]]:
        """Every node that binds a name in ``scope`` (not in the scopes nested in it): targets,
        arguments, loop and ``with`` names, imports, nested definitions, ``global``."""
        found: dict[str, list[ast.AST]] = {}
        pending = list(ast.iter_child_nodes(scope))
        while pending:
            node = pending.pop()
            names: list[str] = []
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                names = [node.id]
            elif isinstance(node, ast.arg):
                names = [node.arg]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                names = list(node.names)
            elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)):
                names = [node.name] if node.name else []
            elif isinstance(node, ast.MatchMapping):
                names = [node.rest] if node.rest else []
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [(alias.asname or alias.name).split(".")[0] for alias in node.names]
            for name in names:
                found.setdefault(name, []).append(node)
            if not isinstance(node, _SCOPES):
                pending.extend(ast.iter_child_nodes(node))
        return found

    def environment(self, scope: ast.AST, point: ast.stmt, model: SimpleNamespace
                    ) -> dict[str, object]:
        """The names decided where ``point`` (a statement of ``scope``) runs, with their values
        for ``model`` (:meth:`_decided_at`), each assignment evaluated in order; one whose
        value :func:`_evaluate` cannot evaluate leaves its name out."""
        assignments, decided, self_is_the_model = self._decided_at(scope, point)
        env: dict[str, object] = {"self": model} if self_is_the_model else {}
        for node in assignments:
            name = _names(node.targets)[0] or ""
            try:
                if name not in decided:
                    raise _Unknown(name)
                env[name] = _evaluate(node.value, env)
            except _Unknown:
                env.pop(name, None)
        return env

    def _decided_at(self, scope: ast.AST, point: ast.stmt
                    ) -> tuple[list[ast.Assign], set[str], bool]:
        """Where ``point`` runs: the one-name assignments that run before it on every way to it
        (in order), the names decided there, and whether ``self`` is the model (the function's
        first argument, rebound by no scope on the way). A name is decided where its every
        binding in ``scope`` is one of those assignments or runs only after ``point`` (later,
        and in no loop around it); a name bound any other way (in a branch, by unpacking, as an
        argument, in a loop around ``point``, ``nonlocal`` anywhere) is not."""
        key = (id(scope), id(point))
        if key in self._cache:
            return self._cache[key]
        assignments: list[ast.Assign] = []
        loops: list[ast.AST] = []
        child: ast.AST = point
        while child is not scope:
            parent = self.parents[child]
            if isinstance(child, _LOOPS):
                loops.append(child)
            for field in ("body", "orelse", "finalbody"):
                statements = getattr(parent, field, None)
                if isinstance(statements, list) and child in statements:
                    assignments += [node for node in statements[:statements.index(child)]
                                    if isinstance(node, ast.Assign) and len(node.targets) == 1
                                    and isinstance(node.targets[0], ast.Name)]
            child = parent
        targets = {id(node.targets[0]) for node in assignments}
        nonlocal_names = {name for node in ast.walk(self.function)
                          if isinstance(node, ast.Nonlocal) for name in node.names}

        def later(node: ast.AST) -> bool:
            return ((getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
                    > (point.lineno, point.col_offset)
                    and not any(loop in self.ancestors(node) for loop in loops))

        decided = {name for name, nodes in self.bindings(scope).items()
                   if name not in nonlocal_names
                   and all(id(node) in targets or later(node) for node in nodes)}
        arguments = self.function.args.args
        first = arguments[0] if arguments and arguments[0].arg == "self" else None
        scopes = [scope, *(up for up in self.ancestors(scope) if isinstance(up, _SCOPES))]
        self_is_the_model = (first is not None and "self" not in nonlocal_names
                             and all(node is first for each in scopes
                                     for node in self.bindings(each).get("self", [])))
        found = (sorted(assignments, key=lambda node: node.lineno), decided, self_is_the_model)
        self._cache[key] = found
        return found

    def reached(self, node: ast.AST, model: SimpleNamespace) -> bool | None:
        """Whether ``node`` may run for ``model``: False where a condition on its way up to its
        scope (an ``if``, ``elif``/``else``, ``while``, conditional expression, ``and``/``or``)
        is decided against it, None where one is undecidable or ``node`` is part of a
        condition, True otherwise (a loop may run it, an early return may skip it)."""
        scope = self.scope(node)
        verdict: bool | None = True
        child = node
        for parent in self.ancestors(node):
            if parent is scope:
                break
            for test, wanted in _guards(parent, child):
                if test is None:
                    return None
                statement = self.statement(parent)
                try:
                    value = bool(_evaluate(test, self.environment(scope, statement, model)))
                except _Unknown:
                    verdict = None
                    continue
                if value is not wanted:
                    return False
            child = parent
        return verdict


def _guards(parent: ast.AST, child: ast.AST) -> list[tuple[ast.expr | None, bool]]:
    """The conditions ``parent`` puts on ``child``: (test, the value it needs); a None test:
    ``child`` is the condition itself."""
    if isinstance(parent, (ast.If, ast.While, ast.IfExp)):
        if child is parent.test:
            return [(None, True)]
        in_body = (child is parent.body if isinstance(parent, ast.IfExp)
                   else child in parent.body)
        return [(parent.test, in_body)]
    if isinstance(parent, ast.BoolOp):
        position = next(i for i, value in enumerate(parent.values) if value is child)
        return [(value, isinstance(parent.op, ast.And)) for value in parent.values[:position]]
    return []


class _Unknown(Exception):
    """An expression :func:`_evaluate` does not evaluate."""


def _evaluate(node: ast.expr, env: dict[str, object]) -> object:
    """The value of a decision made of constants, names in ``env``, attributes of the
    :func:`_model`, ``getattr(x, "name"[, default])`` of an attribute the model holds,
    comparisons, ``and``/``or``/``not`` and literal lists; anything else (a call, a subscript,
    an unknown name, ``getattr`` of an attribute the model does not hold, whatever its default)
    raises _Unknown."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise _Unknown(node.id)
        return env[node.id]
    if isinstance(node, ast.Attribute):
        return _held(_evaluate(node.value, env), node.attr)
    if (isinstance(node, ast.Call) and _name(node.func) == "getattr" and len(node.args) in (2, 3)
            and not node.keywords and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)):
        return _held(_evaluate(node.args[0], env), node.args[1].value)
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


def _held(owner: object, attribute: str) -> object:
    """``owner.attribute`` where ``owner`` is (part of) the model and holds it."""
    if not isinstance(owner, SimpleNamespace) or attribute not in vars(owner):
        raise _Unknown(attribute)
    return vars(owner)[attribute]


_COMPARISONS: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Eq: lambda a, b: bool(a == b), ast.NotEq: lambda a, b: bool(a != b),
    ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
}


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
