"""The cases of a GPU call, each one parity check, most important first, in groups that
``--groups`` names, and what each is expected to say.

A case's model and layout come from ``validation/megatron_lm`` (``megatron_lm.plan.case``, whose
``pretrain_args`` gives the command line): the user's job is Megatron-FSDP with the double buffer
and overlapped reduce-scatter and all-gather, fused wgrad accumulation (Megatron-LM's default;
local layers then have TE importable, which Megatron-FSDP requires), no deterministic options
(the command adds them), three iterations of four microbatches.
"""

from __future__ import annotations

import re
from typing import Any

from megatron_lm.plan import case as mlm_case

RELEASES = ("core-0.19.2", "core-0.18.2")
ITERS = 3
VERDICTS = ("MATCH", "MISMATCH", "CANNOT COMPARE")
DISABLED_FIX = "core-linear-accumulate"
# megatron-core's TE op-fuser MoE path (megatron_lm's ``op_fuser`` case): 0.19 sets
# overwrite_main_grad there (expert-accumulate); 0.18.2 stops in TE's forward
OP_FUSER_RELEASES = ("core-0.19.2",)
# seconds one run of pretrain_gpt.py took side by side with a dozen others on one H100
# (validation/megatron_lm's records: 25 to 43 s), and a check's own overhead
RUN_S = 45.0
CHECK_OVERHEAD_S = 15.0
# the command's --timeout: a run past it is hung (the command ends it and says so)
RUN_TIMEOUT_S = 240.0


def case(group: str, release: str, *, zero: int, impl: str = "te", dtype: str = "fp32",
         model: str = "gpt", dp: int = 1, fusion: bool = True, shipped: bool = False,
         disabled: tuple[str, ...] = (), expected: str = "MATCH",
         expected_shipped: str | None = None) -> dict[str, Any]:
    """One parity check. ``model``: ``gpt``, ``moe`` (four experts, expert-parallel size one,
    TE's grouped GEMM) or ``moe-opfuser`` (the same through TE's op fuser); ``dp=2``: both
    data-parallel ranks in one process (``--fake-process-group``); ``fusion=False``: the user's
    job computes the wgrad apart (needs no TE with local layers); ``shipped``: ``--with-shipped``;
    ``disabled``: fixes named in ``MFSDP_HOTFIX_DISABLED_FIXES``."""
    base = mlm_case(group, release, dp=dp, zero=zero, dtype=dtype, moe=model != "gpt",
                    op_fuser=model == "moe-opfuser", variant="hotfix", impl=impl, fusion=fusion)
    variant = ("disabled " + ",".join(disabled)) if disabled else "hotfix"
    wgrad = "fused" if base["fusion"] else "apart"
    c = dict(base, group=group, model=model, dp=dp, shipped=shipped, disabled=list(disabled),
             variant=variant, wgrad=wgrad, iterations=ITERS, expected=expected,
             expected_shipped=expected_shipped if shipped else None,
             route="fake process group" if dp == 2 else "torchrun, NCCL")
    c["id"] = "|".join([release, f"dp{dp}", f"zero{zero}", impl, wgrad, dtype, model,
                        variant.replace(" ", "-") + ("+shipped" if shipped else "")])
    c["runs"] = 3 if shipped else 2
    c["estimate_s"] = RUN_S * c["runs"] + CHECK_OVERHEAD_S
    return c


GROUPS = ("apart", "dp1", "disabled", "moe", "opfuser", "fake")


def group_cases(group: str, release: str) -> list[dict[str, Any]]:
    """``apart``: local layers with the wgrad apart (no TE needed: they run while TE is built);
    ``dp1``: ZeRO-1/2/3 × TE and local layers × fp32 and bf16 (ZeRO-1 and ZeRO-3 with TE in fp32
    also as shipped); ``disabled``: ZeRO-1 with ``core-linear-accumulate`` off; ``moe``: a MoE
    model, ZeRO-1 and ZeRO-3; ``opfuser``: the TE op-fuser MoE, ZeRO-1 and ZeRO-3 (0.19 only);
    ``fake``: two data-parallel ranks on one GPU, ZeRO-1 and ZeRO-3."""
    out: list[dict[str, Any]] = []
    if group == "apart":
        out += [case(group, release, zero=z, impl="local", dtype=d, fusion=False)
                for z in (1, 3) for d in ("fp32", "bf16")]
    elif group == "dp1":
        # as shipped first: the fused wgrad defects make the shipped run differ by far more
        # than any floor
        out += [case(group, release, zero=z, shipped=True, expected_shipped="MISMATCH")
                for z in (1, 3)]
        out += [case(group, release, zero=z, impl=i, dtype=d)
                for z in (1, 2, 3) for i in ("te", "local") for d in ("fp32", "bf16")
                if not (i == "te" and d == "fp32" and z in (1, 3))]
    elif group == "disabled":
        # the output layer's fused wgrad keeps the last microbatch only (grad norm 1.6 % off)
        out += [case(group, release, zero=1, impl=i, disabled=(DISABLED_FIX,),
                     expected="MISMATCH") for i in ("te", "local")]
    elif group == "moe":
        out += [case(group, release, zero=z, model="moe") for z in (1, 3)]
    elif group == "opfuser":
        if release in OP_FUSER_RELEASES:
            # expert-accumulate repairs it (float noise against DDP in docs/MEGATRON_LM.md);
            # not yet run through parity, so whatever the verdict, it is recorded
            out += [case(group, release, zero=z, model="moe-opfuser", expected="")
                    for z in (1, 3)]
    elif group == "fake":
        out += [case(group, release, zero=z, dp=2) for z in (1, 3)]
    else:
        raise ValueError(f"unknown group {group!r} (known: {', '.join(GROUPS)})")
    return out


def plan(releases: tuple[str, ...] = RELEASES, groups: tuple[str, ...] = GROUPS
         ) -> list[dict[str, Any]]:
    """Every case, release by release, each release's groups in the order given."""
    out = [c for rel in releases for g in groups for c in group_cases(g, rel)]
    ids = [c["id"] for c in out]
    assert len(ids) == len(set(ids)), "a case is planned twice"
    return out


def selected(releases: tuple[str, ...], groups: tuple[str, ...], only: str
             ) -> list[dict[str, Any]]:
    """The plan of ``--releases`` and ``--groups``, cut to the ids ``--only`` matches."""
    for rel in releases:
        if rel not in RELEASES:
            raise ValueError(f"unknown release {rel!r} (known: {', '.join(RELEASES)})")
    return [c for c in plan(releases, groups) if not only or re.search(only, c["id"])]
