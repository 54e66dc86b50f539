"""The plan: the four variants, the sizes, the groups (release, ZeRO level) and the turn order;
and the model's size in parameters and GEMM FLOPs, which the report states."""

from __future__ import annotations

from release_wheels import REL  # stdlib-only at import

REFERENCE = "hotfix"
VARIANTS = [  # key, hotfix imported, fuse_wgrad_accumulation, fsdp_double_buffer, title
    dict(key="hotfix", hotfix=True, fuse=True, db=True,
         title="hotfix: fused wgrad + double buffer (safe)"),
    dict(key="no-db", hotfix=False, fuse=True, db=False,
         title="as shipped, fsdp_double_buffer=False (safe)"),
    dict(key="fuse-off", hotfix=False, fuse=False, db=True,
         title="as shipped, fusion off + double buffer (the workaround; unsafe)"),
    dict(key="shipped", hotfix=False, fuse=True, db=True,
         title="as shipped, fused wgrad + double buffer (default; unsafe)"),
]
SIZES = {
    "full": dict(units=6, hidden=4096, ffn=16384, tokens=4096, microbatches=2, warmup=3,
                 steps=30),
    "smoke": dict(units=2, hidden=256, ffn=1024, tokens=256, microbatches=2, warmup=1, steps=3),
}
GROUPS = {  # release:ZeRO level, in the order they run
    "full": ["fsdp-0.6.1:3", "fsdp-0.6.1:2", "core-0.19.2:3", "core-0.19.2:2"],
    "smoke": ["fsdp-0.6.1:3", "core-0.19.2:2"],
}
STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}


def unit_params(hidden, ffn):
    """Parameters of one unit: LayerNormLinear(h, 3h), Linear(h, h), LayerNormMLP(h, ffn)."""
    qkv = 2 * hidden + 3 * hidden * hidden + 3 * hidden
    proj = hidden * hidden + hidden
    mlp = 2 * hidden + hidden * ffn + ffn + ffn * hidden + hidden
    return qkv + proj + mlp


def gemm_flop(size):
    """FLOPs of one step's weight GEMMs (forward, dgrad, wgrad: 3 x 2 per weight and token), to
    see from the achieved rate that the GEMMs dominate the step."""
    weights = 4 * size["hidden"] ** 2 + 2 * size["hidden"] * size["ffn"]
    return 6 * size["units"] * weights * size["tokens"] * size["microbatches"]


def plan(groups, reps, size):
    """The groups in run order; each has one worker spec per variant and is measured ``reps``
    times, the variants in the same order inside each repetition."""
    out = []
    for group in groups:
        release, zero = group.split(":")
        if release not in REL:
            raise SystemExit(f"unknown release {release!r} (known: {', '.join(REL)})")
        if int(zero) not in STRATEGY:
            raise SystemExit(f"ZeRO level must be 2 or 3, not {zero}")
        workers = [dict(group=group, release=release, pkg=REL[release][2], zero=int(zero),
                        variant=v["key"], hotfix=v["hotfix"], fuse=v["fuse"], db=v["db"], **size)
                   for v in VARIANTS]
        out.append(dict(group=group, release=release, zero=int(zero), reps=reps,
                        workers=workers))
    return out


def turns(group):
    """(rep, worker index) in run order: A B C D A B C D ..."""
    return [(rep, i) for rep in range(group["reps"]) for i in range(len(group["workers"]))]
