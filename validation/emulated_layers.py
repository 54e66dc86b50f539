"""Units that follow TransformerEngine's fused-wgrad contract without TE, for the GPU harness.

The default ``layer="emulated"`` of a case: two bias-free Linears per unit whose wgrad GEMM writes
straight into Megatron-FSDP's ``main_grad`` as TE's ``fuse_wgrad_accumulation`` does, so that a
case needs no TransformerEngine (te_layers.py builds the same units of real TE layers).
"""

from __future__ import annotations

from typing import Any

import schedule_faults


def fused_linear_class(torch: Any) -> Any:
    """A bias-free Linear whose weight, once Megatron-FSDP gives it ``get_main_grad``, takes the
    fused-wgrad path of :func:`build_classes`' contract (the plain ``x @ w.t()`` before that)."""
    nn = torch.nn
    _dummy: dict[Any, Any] = {}

    def dummy_wgrad(w: Any) -> Any:
        key = (tuple(w.shape), w.dtype, w.device)
        t = _dummy.get(key)
        if t is None:
            t = _dummy[key] = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
        return t

    class FusedWgradLinearFn(torch.autograd.Function):
        """TE's fuse_wgrad_accumulation contract: the bound ``weight.get_main_grad`` captured at
        FORWARD time is called lazily in backward, the wgrad GEMM writes straight into it
        (overwrite when ``weight.overwrite_main_grad``, else accumulate), the weight is flagged
        ``grad_added_to_main_grad`` and a dummy wgrad is returned so the post-accumulate hook fires."""

        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, main_grad_func: Any) -> Any:
            ctx.save_for_backward(x)
            ctx.weight = weight
            ctx.main_grad_func = main_grad_func
            return x @ weight.t()

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            w = ctx.weight
            dx = g @ w
            main_grad = ctx.main_grad_func()
            g2 = g.reshape(-1, g.shape[-1])
            x2 = x.reshape(-1, x.shape[-1])
            if getattr(w, "overwrite_main_grad", False):
                torch.mm(g2.t(), x2, out=main_grad)
            else:
                main_grad.addmm_(g2.t(), x2)
            w.grad_added_to_main_grad = True
            return dx, dummy_wgrad(w), None

    class FusedLinear(nn.Module):
        def __init__(self, fan_in: int, fan_out: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(fan_out, fan_in) / fan_in ** 0.5)

        def forward(self, x: Any) -> Any:
            w = self.weight
            getter = getattr(w, "get_main_grad", None)
            if getter is None:
                return x @ w.t()
            return FusedWgradLinearFn.apply(x, w, getter)

    return FusedLinear


def build_classes(torch: Any) -> tuple[Any, Any]:
    """The emulated TE contract: units of two bias-free Linears with fused wgrad accumulation,
    optionally a LayerNorm at the end (non-fused params on the ordinary autograd path)."""
    nn = torch.nn
    point = schedule_faults.compute_point_class(torch)
    fused_linear = fused_linear_class(torch)

    class Unit(nn.Module):
        def __init__(self, h: int, f: int, norm: bool, index: int = 0) -> None:
            super().__init__()
            self.index = index
            self.fc1 = fused_linear(h, f)
            self.fc2 = fused_linear(f, h)
            self.norm = nn.LayerNorm(h) if norm else None

        def forward(self, x: Any) -> Any:
            x = point.apply(x, self.index)  # compute-stream fault point (fwd and bwd)
            y = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
            if self.norm is not None:
                y = self.norm(y)
            return x + y

    class Model(nn.Module):
        """Units in order, then an optional plain Linear head outside the units. ``units`` is a
        list of ``{"ffn", "norm"}`` dicts (or, with ``unit_factory``, whatever it takes)."""

        def __init__(self, units: list[dict[str, Any]], h: int, head: bool,
                     unit_factory: Any = None) -> None:
            super().__init__()
            make = unit_factory or (lambda i, u: Unit(h, int(u["ffn"]), bool(u["norm"]), i))
            self.units = nn.ModuleList(make(i, u) for i, u in enumerate(units))
            self.head = nn.Linear(h, h, bias=False) if head else None

        def forward(self, x: Any) -> Any:
            for u in self.units:
                x = u(x)
            if self.head is not None:
                x = self.head(x)
            return x

    return Unit, Model
