"""NCCL's PREMUL_SUM reduction on gloo, for CPU runs with ``gradient_reduce_div_fusion=True``.

Why: Megatron-FSDP's default (``gradient_reduce_div_fusion=True``) averages gradients with
``torch.distributed._make_nccl_premul_sum(1/world)``: NCCL multiplies each rank's input by the
factor *while* reducing and leaves the input buffer as it was. gloo has no such op, and the other
path (``gradient_reduce_div_fusion=False``) scales the buffer in place first, which changes what
a buffer reduced more than once holds. To measure the default on CPU, this module stands in for
NCCL's semantics: the factory returns a marker, and ``reduce_scatter_tensor`` / ``all_reduce``
called with it reduce a scaled *copy* with SUM (``all_reduce`` writes into its tensor, as NCCL's
in-place all-reduce does). Installed only in selftest worker processes, before the release is
imported; it patches nothing of Megatron.
"""

from __future__ import annotations

from typing import Any

STATS = {"premul_reductions": 0}


class PremulSum:
    """What ``_make_nccl_premul_sum(factor)`` returns here."""

    def __init__(self, factor: Any) -> None:
        self.factor = factor

    def __repr__(self) -> str:
        return f"PremulSum({self.factor!r})"


def _split_op(args: tuple[Any, ...], kwargs: dict[str, Any], position: int) -> tuple[
        Any, tuple[Any, ...], dict[str, Any]]:
    """The ``op`` argument (keyword, or positional at ``position``) and the call without it."""
    if "op" in kwargs:
        kwargs = dict(kwargs)
        return kwargs.pop("op"), args, kwargs
    if len(args) > position:
        return args[position], args[:position] + args[position + 1:], kwargs
    return None, args, kwargs


def install() -> None:
    """Route PREMUL_SUM reductions through SUM on a scaled copy (idempotent)."""
    import torch.distributed as dist

    if getattr(dist, "_mfsdp_premul_emulated", False):
        return
    rs, ar = dist.reduce_scatter_tensor, dist.all_reduce

    def make(factor: Any) -> PremulSum:
        return PremulSum(factor)

    def reduce_scatter_tensor(*args: Any, **kwargs: Any) -> Any:
        op, rest, kw = _split_op(args, kwargs, 2)
        if not isinstance(op, PremulSum):
            return rs(*args, **kwargs)
        STATS["premul_reductions"] += 1
        names = ("output", "input")
        bound = dict(zip(names, rest, strict=False))
        bound.update({k: kw.pop(k) for k in names if k in kw})
        scaled = bound["input"] * op.factor  # the input buffer stays as it was
        return rs(bound["output"], scaled, dist.ReduceOp.SUM, *rest[2:], **kw)

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        op, rest, kw = _split_op(args, kwargs, 1)
        if not isinstance(op, PremulSum):
            return ar(*args, **kwargs)
        STATS["premul_reductions"] += 1
        tensor = rest[0] if rest else kw.pop("tensor")
        tensor.mul_(op.factor)  # in place: the all-reduce's output is this tensor anyway
        return ar(tensor, dist.ReduceOp.SUM, *rest[1:], **kw)

    setattr(dist, "_make_nccl_premul_sum", make)  # noqa: B010 (a private name of torch's)
    dist.reduce_scatter_tensor = reduce_scatter_tensor
    dist.all_reduce = all_reduce
    dist._mfsdp_premul_emulated = True  # type: ignore[attr-defined]
