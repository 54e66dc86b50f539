"""``TEGroupedMLP._ensure_main_grad`` (megatron-core's MoE experts through TransformerEngine's op
fuser) recognised by structure: whether it leaves a parameter's ``overwrite_main_grad`` alone.
Whether it sets it always True is :func:`.overwrite_setter.always_overwrites_main_grad`."""

from __future__ import annotations

from .syntax import names_in, only_function


def leaves_overwrite_main_grad(source: str) -> bool:
    """Whether the function parses and nothing in it names ``overwrite_main_grad`` (no attribute,
    no ``setattr``/``getattr`` string): it cannot change what Megatron-FSDP decided."""
    function = only_function(source)
    return function is not None and "overwrite_main_grad" not in names_in(function)


# The tests the registry's shapes name (``Shape.structure``).
RECOGNISERS = (leaves_overwrite_main_grad,)
