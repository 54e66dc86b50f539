"""``MegatronFSDP._register_fsdp_hooks`` recognised by structure: whether it releases stale
units lazily, and when its backward hooks reduce gradients (every release's condition, or
NVIDIA/Megatron-LM#6357's)."""

from __future__ import annotations

import ast
import textwrap

from .decisions import SHARDED_GRADIENTS, STRATEGIES, FunctionReader, model_for
from .synchronous_reductions import COLLECTIVES
from .syntax import looked_up, only_function

REDUCES_ONCE, REDUCES_ALWAYS = "once", "always"
# The hooks' reductions the verdict is made of; any other reduction named in the hooks (a
# synchronous one, a collective) leaves them unrecognised.
_HOOK_REDUCTIONS = frozenset({"reduce_gradients", "finish_grad_sync"})
_OTHER_REDUCTIONS = COLLECTIVES | {"start_grad_sync", "synchronize_gradient_reduce",
                                   "reduce_scatter_gradients", "all_reduce_gradients"}


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


def lazy_and_reduces_unsharded_once(source: str) -> bool:
    """``MegatronFSDP._register_fsdp_hooks`` that releases stale units lazily
    (:func:`releases_stale_units_lazily`) and reduces gradients in its backward hooks exactly
    when NVIDIA/Megatron-LM#6357 does (:func:`hook_reduction`)."""
    return releases_stale_units_lazily(source) and hook_reduction(source) == REDUCES_ONCE


def lazy_and_reduces_unsharded_always(source: str) -> bool:
    """As :func:`lazy_and_reduces_unsharded_once`, with the releases' reduction condition: the
    hooks reduce unsharded gradients on the last microbatch whatever overlap_grad_reduce says."""
    return releases_stale_units_lazily(source) and hook_reduction(source) == REDUCES_ALWAYS


def hook_reduction(source: str) -> str | None:
    """When the backward hooks of ``_register_fsdp_hooks`` reduce gradients, judged over the
    whole function: every call of ``<...>.reduce_gradients(...)`` and
    ``<...>.finish_grad_sync(...)``, in every branch and after it, is followed up to its hook
    through every condition on its way (:meth:`FunctionReader.reached`, :func:`evaluate` with the
    names decided there) for each strategy, ``overlap_grad_reduce``, ``is_last_microbatch`` and
    ``model_auto_sync``, and counted per hook. :data:`REDUCES_ONCE`: each hook that reduces
    calls ``reduce_gradients`` once with sharded gradients, else only with overlap on the last
    microbatch or auto-sync, and never otherwise (NVIDIA/Megatron-LM#6357);
    :data:`REDUCES_ALWAYS`: once with sharded gradients, on the last microbatch or with
    auto-sync (every release); either way ``finish_grad_sync`` once exactly with auto-sync.
    None: anything else, a condition it cannot decide, a reduction named any other way (passed
    on, looked up by name, another collective, called outside a hook), a write of the state the
    conditions read, or no ``reduce_gradients`` call."""
    function = only_function(source)
    if function is None:
        return None
    reader = FunctionReader(function)
    if reader.writes_model_state():
        return None
    calls: dict[tuple[ast.AST, str], list[ast.Call]] = {}
    for node in ast.walk(function):
        if looked_up(node) not in _HOOK_REDUCTIONS | _OTHER_REDUCTIONS:
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
            reached = [reader.reached(call, model_for(*case)) for call in group]
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


# The tests the registry's shapes name (``Shape.structure``).
RECOGNISERS = (lazy_and_reduces_unsharded_once, lazy_and_reduces_unsharded_always)
