"""Units made of real TransformerEngine layers for the GPU harness (imported only for te-* cases).

Families (spec ``layer``), each unit ending in a residual add, optionally followed by a plain
``torch.nn.LayerNorm`` (spec ``units[i]["norm"]``: non-fused params on the ordinary autograd path):

* ``te-linear``: ``te.Linear(h, f)`` -> gelu -> ``te.Linear(f, h)``
* ``te-layernorm-linear``: ``te.LayerNormLinear(h, f)`` -> gelu -> ``te.LayerNormLinear(f, h)``
* ``te-layernorm-mlp``: ``te.LayerNormMLP(h, f)``
* ``te-grouped-linear``: ``te.GroupedLinear(2, h, f)`` -> gelu -> ``te.GroupedLinear(2, f, h)``
  (tokens split in two groups)

All with ``fuse_wgrad_accumulation=spec["fuse"]``, ``params_dtype`` of the case, on the GPU, no
bias (the LayerNorm parameters of TE's fused-norm layers are non-fused params). TE 2.20 reads
``weight.get_main_grad`` lazily in backward when the weight has ``__fsdp_param__`` (Megatron-FSDP
sets it), writes the wgrad GEMM into it and sets ``grad_added_to_main_grad``.

``delay_wgrad``: the layers are built with ``delay_wgrad_compute=True`` and their weights marked
``skip_backward_post_hook`` as megatron-core marks its delayed-wgrad (MoE expert) parameters;
Megatron-FSDP (0.5 and later) then skips their post-accumulate hook and, at hook registration
(``setup_delayed_wgrad_acc_hook``), gives each of them a ``post_wgrad_grad_acc_hook``. The unit
puts a :class:`BackwardDW` at its input: when the unit's backward is done it calls each layer's
``backward_dw()`` (TE computes the delayed wgrad into ``main_grad``) and then every parameter's
``post_wgrad_grad_acc_hook`` -- what megatron-core 0.19's MoE layer does after its experts'
backward (``moe_layer.py``: ``module.backward_dw(...)`` then ``param.post_wgrad_grad_acc_hook()``),
here on the current stream.
"""

from __future__ import annotations

import os
from typing import Any

FAMILIES = ("te-linear", "te-layernorm-linear", "te-layernorm-mlp", "te-grouped-linear")


def import_te() -> Any:
    import torch  # noqa: F401  (torch before TE: TE's core library needs libnccl on the path)

    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    import transformer_engine
    import transformer_engine.pytorch as te

    te.__version__ = getattr(transformer_engine, "__version__", "?")
    return te


def build(torch: Any, te: Any, s: dict[str, Any], dtype: Any, dev: Any, model_cls: Any
          ) -> tuple[Any, Any]:
    import schedule_faults

    point = schedule_faults.compute_point_class(torch)
    family = s["layer"]
    if family not in FAMILIES:
        raise ValueError(f"unknown layer family {family!r}")
    h = int(s["hidden"])
    kw = dict(fuse_wgrad_accumulation=bool(s["fuse"]), params_dtype=dtype, device=dev,
              bias=False)
    if s["delay_wgrad"]:
        kw["delay_wgrad_compute"] = True
    tokens = int(s["tokens"])
    splits = [tokens // 2, tokens - tokens // 2]

    class BackwardDW(torch.autograd.Function):
        """Identity at the unit's input; in backward (the unit's layers are done) it runs the
        delayed wgrad and the hooks Megatron-FSDP registered for it."""

        @staticmethod
        def forward(ctx: Any, x: Any, unit: Any) -> Any:
            ctx.unit = unit
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            run_backward_dw(ctx.unit)
            return g, None

    class TEUnit(torch.nn.Module):
        def __init__(self, index: int, u: dict[str, Any]) -> None:
            super().__init__()
            self.index = index
            f = int(u["ffn"])
            if family == "te-linear":
                self.a, self.b = te.Linear(h, f, **kw), te.Linear(f, h, **kw)
            elif family == "te-layernorm-linear":
                self.a, self.b = te.LayerNormLinear(h, f, **kw), te.LayerNormLinear(f, h, **kw)
            elif family == "te-layernorm-mlp":
                self.a, self.b = te.LayerNormMLP(h, f, **kw), None
            else:
                self.a, self.b = te.GroupedLinear(2, h, f, **kw), te.GroupedLinear(2, f, h, **kw)
            self.norm = torch.nn.LayerNorm(h, device=dev, dtype=dtype) if u.get("norm") else None
            self.dw_hooks: list[Any] = []
            if s["delay_wgrad"]:
                for layer in self.te_layers():
                    for name, p in layer.named_parameters():
                        if "weight" in name and "layer_norm" not in name:
                            p.skip_backward_post_hook = True

        def te_layers(self) -> list[Any]:
            return [m for m in (self.a, self.b) if m is not None]

        def _layer(self, m: Any, x: Any) -> Any:
            return m(x, splits) if family == "te-grouped-linear" else m(x)

        def forward(self, x: Any) -> Any:
            x = point.apply(x, self.index)
            if s["delay_wgrad"]:
                x = BackwardDW.apply(x, self)
            y = self._layer(self.a, x)
            if self.b is not None:
                y = self._layer(self.b, torch.nn.functional.gelu(y))
            if self.norm is not None:
                y = self.norm(y)
            return x + y

    model = model_cls(s["units"], h, bool(s["head"]),
                      unit_factory=lambda i, u: TEUnit(i, u)).to(dev)
    return TEUnit, model


def run_backward_dw(unit: Any) -> None:
    """What megatron-core's MoE layer does after its experts' backward: the delayed wgrad of
    each layer, then Megatron-FSDP's hook of each of the unit's delayed-wgrad parameters."""
    for layer in unit.te_layers():
        layer.backward_dw()
    for hook in unit.dw_hooks:
        hook()


class UnsupportedByRelease(RuntimeError):
    """A configuration the release cannot run: the case's outcome is ``unsupported``, not a
    crash (the harness reads ``unsupported``)."""

    unsupported = True


def attach_delay_wgrad_hooks(module: Any, buffer: Any) -> dict[str, int]:
    """Give each unit the ``post_wgrad_grad_acc_hook``s Megatron-FSDP registered for its marked
    parameters. They sit on the parameters the buffer holds (``module.parameters()`` are the
    distributed optimizer parameters after wrapping), found by name. A release that carries no
    ``skip_backward_post_hook`` over to them, or registers no hook (0.4.0), is refused: its
    post-accumulate hook would reduce those gradients before the delayed wgrad is computed."""
    units = {f"units.{i}.": u for i, u in enumerate(module.units)}
    for u in units.values():
        u.dw_hooks = []
    marked = hooked = 0
    for p, name in buffer.param_to_name.items():
        if not getattr(p, "skip_backward_post_hook", False):
            continue
        marked += 1
        hook = getattr(p, "post_wgrad_grad_acc_hook", None)
        unit = next((u for prefix, u in units.items() if name.startswith(prefix)), None)
        if hook is not None and unit is not None:
            unit.dw_hooks.append(hook)
            hooked += 1
    if not hooked or hooked != marked:
        raise UnsupportedByRelease(f"delay_wgrad_compute: {marked} parameters marked "
                           f"skip_backward_post_hook after wrapping, {hooked} with Megatron-FSDP's "
                           "post_wgrad_grad_acc_hook: not supported by this release")
    return {"marked": marked, "hooked": hooked}
