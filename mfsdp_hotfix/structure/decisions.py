"""The decisions a Megatron-FSDP function makes, read from its syntax tree: each condition on
the way to a statement evaluated for a stand-in model that holds only what those decisions read
(its sharding strategy, its ddp_config, its sync flags); anything else is undecidable."""

from __future__ import annotations

import ast
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from ..errors import Unknown as Unknown
from .syntax import name_id, name_ids

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SHARDED_GRADIENTS = ("optim_grads", "optim_grads_params")


def model_for(strategy: str, overlap: bool = True, last: bool = False, auto: bool = False
              ) -> SimpleNamespace:
    """What a MegatronFSDP's decisions read: its strategy, its ddp_config, its sync flags. It
    holds nothing else: any other attribute, read with or without a default, is undecidable."""
    config = SimpleNamespace(data_parallel_sharding_strategy=strategy,
                             overlap_grad_reduce=overlap)
    return SimpleNamespace(data_parallel_sharding_strategy=strategy, ddp_config=config,
                           is_last_microbatch=last, model_auto_sync=auto)


# What the model holds (:func:`model_for`): a function that writes one of these decides from
# state the model does not hold.
_MODEL_STATE = frozenset({*vars(model_for("no_shard")), *vars(model_for("no_shard").ddp_config)})
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


class FunctionReader:
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
            if isinstance(node, ast.Call) and name_id(node.func) in ("setattr", "delattr",
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
        value :func:`evaluate` cannot evaluate leaves its name out."""
        assignments, decided, self_is_the_model = self._decided_at(scope, point)
        env: dict[str, object] = {"self": model} if self_is_the_model else {}
        for node in assignments:
            name = name_ids(node.targets)[0] or ""
            try:
                if name not in decided:
                    raise Unknown(name)
                env[name] = evaluate(node.value, env)
            except Unknown:
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
                    value = bool(evaluate(test, self.environment(scope, statement, model)))
                except Unknown:
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


def evaluate(node: ast.expr, env: dict[str, object]) -> object:
    """The value of a decision made of constants, names in ``env``, attributes of the
    :func:`model_for`, ``getattr(x, "name"[, default])`` of an attribute the model holds,
    comparisons, ``and``/``or``/``not`` and literal lists; anything else (a call, a subscript,
    an unknown name, ``getattr`` of an attribute the model does not hold, whatever its default)
    raises Unknown."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise Unknown(node.id)
        return env[node.id]
    if isinstance(node, ast.Attribute):
        return _held(evaluate(node.value, env), node.attr)
    if (isinstance(node, ast.Call) and name_id(node.func) == "getattr" and len(node.args) in (2, 3)
            and not node.keywords and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)):
        return _held(evaluate(node.args[0], env), node.args[1].value)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [evaluate(element, env) for element in node.elts]
    if isinstance(node, ast.BoolOp):
        values = [bool(evaluate(value, env)) for value in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not evaluate(node.operand, env)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        left, right = evaluate(node.left, env), evaluate(node.comparators[0], env)
        compare = _COMPARISONS.get(type(node.ops[0]))
        if compare is None:
            raise Unknown(type(node.ops[0]).__name__)
        try:
            return compare(left, right)
        except TypeError as exc:
            raise Unknown(str(exc)) from exc
    raise Unknown(type(node).__name__)


def _held(owner: object, attribute: str) -> object:
    """``owner.attribute`` where ``owner`` is (part of) the model and holds it."""
    if not isinstance(owner, SimpleNamespace) or attribute not in vars(owner):
        raise Unknown(attribute)
    return vars(owner)[attribute]


_COMPARISONS: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Eq: lambda a, b: bool(a == b), ast.NotEq: lambda a, b: bool(a != b),
    ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
}
