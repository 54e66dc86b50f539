"""Fix ``expert-accumulate``: MoE experts through TransformerEngine's op fuser keep the
``overwrite_main_grad`` that Megatron-FSDP decided for its parameters.

megatron-core 0.19.0-0.19.2 (and NVIDIA main as of d98e8a64dd) run ``TEGroupedMLP`` with
``--use-transformer-engine-op-fuser`` through TransformerEngine's fused ``GroupedLinear`` ops. The
pre-forward hook of those ops (``TEGroupedMLP._make_fused_impl_pre_forward_hook``) first runs the
expert linears' own pre-forward hooks, Megatron-FSDP's among them (the all-gather, after which
``MegatronFSDP.all_gather_and_wait_parameters_ready`` sets each parameter's
``overwrite_main_grad``), then ``TEGroupedMLP._ensure_main_grad`` on each linear, which exposes
``main_grad`` and sets ``overwrite_main_grad = True`` on every parameter that has the attribute.
The ``GroupedLinear`` op's fused wgrad then overwrites ``main_grad`` instead of adding into it.
Where Megatron-FSDP (with ``zero1-accumulate`` or ``single-rank-reduce``, or
NVIDIA/Megatron-LM#6357 and #6773) said to add, that is wrong: ZeRO-1 experts, and ZeRO-2/3
experts whose expert data-parallel group has one rank, keep only the last microbatch of a step.

The repair wraps ``_ensure_main_grad``: for each parameter of the linear that is Megatron-FSDP's
(``__fsdp_param__``, which Megatron-FSDP sets in the same loop as ``overwrite_main_grad``) and has
the attribute, the value before the call is put back after it. Everything else the function does
(``main_grad`` from the lazy getter) and every other parameter are untouched; where Megatron-FSDP
said True (ZeRO-2/3 over several ranks) nothing changes. If the fix raises, the step is stopped.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .. import guard
from ..fix_catalogue_outside import EXPERT_ACCUMULATE
from ..patching import Undo, wrap_static_method

OWNER = "TEGroupedMLP"
FUNCTION = "_ensure_main_grad"
WHERE = f"{OWNER}.{FUNCTION}"


def fsdp_decisions(linear_module: Any) -> list[tuple[Any, Any]]:
    """``(parameter, overwrite_main_grad)`` for each of ``linear_module``'s own parameters that is
    Megatron-FSDP's and carries the attribute."""
    return [(param, param.overwrite_main_grad)
            for param in linear_module.parameters(recurse=False)
            if hasattr(param, "__fsdp_param__") and hasattr(param, "overwrite_main_grad")]


def restore(decisions: list[tuple[Any, Any]]) -> None:
    for param, value in decisions:
        param.overwrite_main_grad = value


def apply(experts_module: ModuleType) -> Undo:
    """Wrap ``TEGroupedMLP._ensure_main_grad`` (a static method) of megatron-core's experts."""

    def keeping_fsdp_decisions(ensure: Any, _: Any, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> Any:
        linear_module = args[0] if args else kwargs["linear_module"]
        decisions = guard.attempt(EXPERT_ACCUMULATE, WHERE,
                                  lambda: fsdp_decisions(linear_module))
        result = ensure(*args, **kwargs)
        guard.attempt(EXPERT_ACCUMULATE, WHERE, lambda: restore(decisions))
        return result

    return wrap_static_method(getattr(experts_module, OWNER), FUNCTION, keeping_fsdp_decisions,
                              EXPERT_ACCUMULATE.id)
