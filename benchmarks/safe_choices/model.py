"""The model: identical FSDP units of real TE layers in bf16, the parameter GEMMs of a
transformer layer; its classes are made in the worker, once torch and TE are imported."""

from __future__ import annotations


def build_classes(torch, te):
    nn = torch.nn
    bf16 = torch.bfloat16

    class Block(nn.Module):
        """The parameter GEMMs of a transformer layer, as TE layers (one FSDP unit)."""

        def __init__(self, hidden, ffn, fuse):
            super().__init__()
            kw = dict(params_dtype=bf16, fuse_wgrad_accumulation=fuse, device="cuda")
            self.qkv = te.LayerNormLinear(hidden, 3 * hidden, **kw)
            self.proj = te.Linear(hidden, hidden, **kw)
            self.mlp = te.LayerNormMLP(hidden, ffn, **kw)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            x = x + self.proj(v * torch.sigmoid(q + k))  # stands in for attention
            return x + self.mlp(x)

    class Model(nn.Module):
        def __init__(self, units, hidden, ffn, fuse):
            super().__init__()
            self.units = nn.ModuleList(Block(hidden, ffn, fuse) for _ in range(units))

        def forward(self, x):
            for unit in self.units:
                x = unit(x)
            return x

    return Block, Model
