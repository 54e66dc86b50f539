"""A CPU stand-in of TransformerEngine's ``te.Linear`` (TE is not installed here): only its
main_grad contract, to test the harness' delayed-wgrad plumbing against real Megatron-FSDP.
In backward the wgrad goes into ``weight.get_main_grad()`` (captured at forward; overwrite when
``overwrite_main_grad``, else accumulate) when fused, else it is returned; with
``delay_wgrad_compute`` the wgrad GEMM is stored and run by ``backward_dw()``. It cannot show
anything about TE's own kernels or streams."""

from __future__ import annotations

import types
from typing import Any

import torch


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Any, w: Any, mod: Any) -> Any:
        ctx.save_for_backward(x)
        ctx.w, ctx.mod = w, mod
        fused = mod.fuse and hasattr(w, "__fsdp_param__")
        ctx.main_grad_func = w.get_main_grad if fused else None
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        (x,) = ctx.saved_tensors
        w, mod = ctx.w, ctx.mod
        main_grad = ctx.main_grad_func() if ctx.main_grad_func else None

        def gemm() -> Any:
            wg = g.t() @ x
            if main_grad is None:
                return wg
            if getattr(w, "overwrite_main_grad", False):
                main_grad.copy_(wg)
            else:
                main_grad.add_(wg)
            return None

        if mod.delay:
            mod.store.append(gemm)
            wg = None
        else:
            wg = gemm()
        if main_grad is not None and hasattr(w, "grad_added_to_main_grad"):
            w.grad_added_to_main_grad = True
            return g @ w, torch.zeros_like(w), None  # a dummy wgrad: the grad hook still fires
        return g @ w, wg, None


class Linear(torch.nn.Module):
    def __init__(self, fan_in: int, fan_out: int, fuse_wgrad_accumulation: bool = False,
                 params_dtype: Any = None, device: Any = None, bias: bool = False,
                 delay_wgrad_compute: bool = False) -> None:
        super().__init__()
        w = torch.randn(fan_out, fan_in, dtype=params_dtype, device=device) / fan_in ** 0.5
        self.weight = torch.nn.Parameter(w)
        self.fuse, self.delay = fuse_wgrad_accumulation, delay_wgrad_compute
        self.store: list[Any] = []

    def forward(self, x: Any) -> Any:
        return _Fn.apply(x, self.weight, self)

    def need_backward_dw(self) -> bool:
        return self.delay

    def backward_dw(self) -> None:
        if not self.delay:
            return
        wg = self.store.pop(0)()
        if wg is not None:
            self.weight.grad = wg


te = types.SimpleNamespace(Linear=Linear, __version__="fake")
