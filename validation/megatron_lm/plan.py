"""The plan: every run of a GPU call as a case (a dict of its settings and its id), most important
first, in groups that ``--groups`` names."""

from __future__ import annotations

import re
from typing import Any

RELEASES = ("core-0.19.2", "core-0.18.2")
UNIT_TESTS = {"core-0.19.2": "tests/unit_tests/distributed/mfsdp_v1",
              "core-0.18.2": "tests/unit_tests/distributed/megatron_fsdp"}
ZERO = {"optim_grads_params": 3, "optim_grads": 2, "optim": 1}
VARIANTS = ("shipped", "hotfix", "db-off")
AUDITS = ("audit-shipped", "audit-hotfix")  # audit route, with MFSDP_HOTFIX=0 / as installed
ITERS = 3
MICROBATCHES = 4
SIZE = dict(layers=4, hidden=512, heads=8, ffn=2048, seq=512, mbs=2, vocab=8192, experts=4,
            moe_ffn=1024)
DELAYS = (0.0, 20.0)


def case(group: str, release: str, *, dp: int = 2, zero: int = 3, dtype: str = "fp32",
         ogr: bool = True, recompute: bool = False, moe: bool = False, variant: str = "shipped",
         delay_ms: float = 0.0, serialized: bool = False, impl: str = "te",
         fusion: bool | None = None, fsdp: bool = True, deterministic: bool = False,
         op_fuser: bool = False, disabled_fix: str = "") -> dict[str, Any]:
    """``impl``: ``te`` (TE layers) or ``local`` (megatron-core's own layers; TE importable only
    with ``fusion``, ``needs_te``).
    ``fusion``: fused wgrad accumulation; by default on with TE layers (Megatron-LM's default)
    and off with local layers. ``fsdp=False``: Megatron's own ``DistributedDataParallel`` with
    the distributed optimizer instead of Megatron-FSDP (``zero`` is then 0). ``deterministic``:
    ``--deterministic-mode``. ``op_fuser`` (with ``moe``): the experts through TE's op fuser,
    weighted squared-ReLU (the fused path Hopper reaches). ``disabled_fix``: a hotfix run with
    that one fix turned off (``MFSDP_HOTFIX_DISABLED_FIXES``), what a user who turns it off
    gets."""
    zero = zero if fsdp else 0
    c = dict(group=group, release=release, dp=dp, launcher="fake" if dp == 2 else "torchrun",
             impl=impl, fsdp=fsdp, zero=zero, sharding={v: k for k, v in ZERO.items()}.get(zero),
             fusion=(impl == "te") if fusion is None else fusion, deterministic=deterministic,
             dtype=dtype, overlap_grad_reduce=ogr, overlap_param_gather=ogr,
             recompute=recompute, moe=moe, op_fuser=moe and op_fuser, variant=variant,
             disabled_fix=disabled_fix if variant == "hotfix" else "",
             db=fsdp and variant != "db-off", delay_ms=0.0 if serialized else float(delay_ms),
             serialized=serialized, iterations=ITERS, microbatches=MICROBATCHES)
    c["config"] = config_key(c)
    label = f"{variant}-without-{c['disabled_fix']}" if c["disabled_fix"] else variant
    c["id"] = f"{c['config']}|{label}|" + ("serialized" if serialized else f"d{delay_ms:g}")
    return c


def config_key(c: dict[str, Any]) -> str:
    fusion_default = c["impl"] == "te"
    extra = [x for x, on in (("local", c["impl"] == "local"),
                             ("fused" if c["fusion"] else "unfused",
                              c["fusion"] != fusion_default),
                             ("recompute", c["recompute"]), ("moe", c["moe"]),
                             ("op-fuser", c["op_fuser"]),
                             ("no-overlap", not c["overlap_grad_reduce"]),
                             ("det", c["deterministic"])) if on]
    layout = f"zero{c['zero']}" if c["fsdp"] else "ddp"
    return "|".join([c["release"], f"dp{c['dp']}", layout, c["dtype"]] + extra)


def truth_variant(c: dict[str, Any]) -> str:
    """Whose serialized run a case is compared with: its own variant's (the audit runs: the
    code they run, shipped or hotfix)."""
    return {"audit-shipped": "shipped", "audit-hotfix": "hotfix"}.get(c["variant"], c["variant"])


def configurations(release: str, dp: int, zero: int, dtype: str, ogr: bool = True,
                   recompute: bool = False, moe: bool = False, delays=DELAYS,
                   group: str = "dp2", variants=VARIANTS, impl: str = "te"
                   ) -> list[dict[str, Any]]:
    """One configuration: a serialized run per variant, then each variant at each delay."""
    kw = dict(dp=dp, zero=zero, dtype=dtype, ogr=ogr, recompute=recompute, moe=moe, impl=impl)
    out = [case(group, release, variant=v, serialized=True, **kw) for v in variants]
    out += [case(group, release, variant=v, delay_ms=d, **kw) for d in delays for v in variants]
    return out


GROUPS = ("local", "core", "dp1", "zero1", "unit", "extras")
MORE_GROUPS = ("core3", "core2", "local3", "local2", "dp1-local")  # halves, or without TE
# judged against a reference that is not the code under test (``reference_cases``)
REFERENCE_GROUPS = ("ddp", "ddp-local", "fused", "fused-local", "moe-ref", "moe-opfuser")


def reference_cases(group: str, release: str) -> list[dict[str, Any]]:
    """The runs of a ``REFERENCE_GROUPS`` group, fp32 and ``--deterministic-mode``, each judged
    by ``mlm_verdict`` against its reference (``judge``: the reference's id; a reference is
    ``judged``; ``set``: the reference's id, which ``pipelined`` keeps together):

    * ``ddp`` (TE layers), ``ddp-local`` (local layers): world size 1 through ``torchrun`` and
      NCCL; the reference is ``DistributedDataParallel`` + the distributed optimizer with the
      wgrad apart (``--no-gradient-accumulation-fusion``: fusion in megatron-core's own linear
      needs APEX, which the machine lacks); judged are Megatron-FSDP ZeRO-1/2/3, fused wgrad
      accumulation on and off, as shipped and with the hotfix, by the reported losses and grad
      norm;
    * ``fused``, ``fused-local``: two data-parallel ranks through ``--fake-process-group``;
      each ZeRO level and variant fused against the same run unfused, by the reported values
      and the reduced gradient;
    * ``moe-ref``: a MoE model (expert-parallel size 1), ZeRO-3 with fused wgrad: at world size
      1 against DDP, and at two ranks fused against unfused.

    * ``moe-opfuser``: the MoE model with its experts through TE's op fuser (weighted
      squared-ReLU), world size 1 against DDP (the op fuser on, the wgrad apart): Megatron-FSDP
      ZeRO-1/2/3 with fused wgrad, as shipped and with the hotfix, and ZeRO-1 with the hotfix
      but without ``expert-accumulate``.

    Expert-parallel size equal to the data-parallel size is not here: the fake group's
    all-to-all moves no tokens between its ranks."""
    if group == "moe-opfuser":
        return op_fuser_cases(group, release)
    impl = "local" if group.endswith("-local") else "te"
    moe = group == "moe-ref"
    zeros = (3,) if moe else (1, 2, 3)
    kw = dict(dtype="fp32", deterministic=True, impl=impl, moe=moe)
    out: list[dict[str, Any]] = []
    if group.startswith("ddp") or moe:
        ref = dict(case(group, release, dp=1, fsdp=False, fusion=False, **kw), judged=True)
        ref["set"] = ref["id"]
        out.append(ref)
        for fusion in (True,) if moe else (True, False):
            for zero in zeros:
                out += [dict(case(group, release, dp=1, zero=zero, fusion=fusion, variant=v,
                                  **kw), judge=ref["id"], set=ref["id"])
                        for v in ("shipped", "hotfix")]
    if group.startswith("fused") or moe:
        for zero in zeros:
            for v in ("shipped", "hotfix"):
                unfused = dict(case(group, release, zero=zero, fusion=False, variant=v, **kw),
                               judged=True)
                unfused["set"] = unfused["id"]
                out += [unfused, dict(case(group, release, zero=zero, fusion=True, variant=v,
                                           **kw), judge=unfused["id"], set=unfused["id"])]
    return out


def op_fuser_cases(group: str, release: str) -> list[dict[str, Any]]:
    """The ``moe-opfuser`` group (``reference_cases``)."""
    kw = dict(dtype="fp32", deterministic=True, moe=True, op_fuser=True, dp=1)
    ref = dict(case(group, release, fsdp=False, fusion=False, **kw), judged=True)
    ref["set"] = ref["id"]
    runs = [case(group, release, zero=zero, fusion=True, variant=v, **kw)
            for zero in (1, 2, 3) for v in ("shipped", "hotfix")]
    runs.append(case(group, release, zero=1, fusion=True, variant="hotfix",
                     disabled_fix="expert-accumulate", **kw))
    return [ref] + [dict(r, judge=ref["id"], set=ref["id"]) for r in runs]


def plan(releases=RELEASES, groups=GROUPS) -> list[dict[str, Any]]:
    """Every run, in the order of ``groups`` (a cut time budget drops the end of the list):
    ``local`` (``core`` without TE: megatron-core's own layers; runs while TE is being built),
    ``core`` (ZeRO-3 and ZeRO-2, fp32 and bf16, the audit route; the first release, then the
    others), ``dp1`` (world size one), ``zero1``, ``unit``, ``extras`` (fp8, recompute, MoE);
    and ``MORE_GROUPS``: ``core3``/``core2`` and ``local3``/``local2`` (one ZeRO level),
    ``dp1-local`` (world size one without TE). ``GROUP@RELEASE`` plans a group for one
    release."""
    out: list[dict[str, Any]] = []
    for spec in groups:
        group, _, only = spec.partition("@")  # GROUP@RELEASE: that release only
        if only and only not in releases:
            raise ValueError(f"{spec}: {only} is not among the releases {releases}")
        first, rest = (only, ()) if only else (releases[0], releases[1:])
        releases_here = (first,) + tuple(rest)
        if group in ("core", "core3", "core2", "local", "local3", "local2"):
            # core3/core2 (local3/local2): its ZeRO-3/ZeRO-2 half; local*: without TE
            zeros = {"": (3, 2), "3": (3,), "2": (2,)}[group[-1] if group[-1] in "23" else ""]
            impl = "local" if group.startswith("local") else "te"
            label = "local" if impl == "local" else "core"
            for rel in releases_here:
                for zero in zeros:
                    for dtype in ("fp32", "bf16"):
                        out.extend(configurations(rel, 2, zero, dtype, group=label, impl=impl))
                    # the audit route on the DP=2 job, at the delay that breaks the shipped
                    # code
                    out.extend(case(label, rel, zero=zero, variant=v, delay_ms=DELAYS[-1],
                                    impl=impl) for v in AUDITS)
        elif group in ("dp1", "dp1-local"):
            # world size 1, real NCCL: the plain route and the audit route (no fake group, no
            # delay); dp1-local: the same without TE
            impl = "local" if group == "dp1-local" else "te"
            out.extend(configurations(first, 1, 3, "fp32", delays=(0.0,), group="dp1",
                                      variants=("shipped", "hotfix"), impl=impl))
            out.extend(case("dp1", first, dp=1, variant=v, impl=impl) for v in AUDITS)
        elif group == "zero1":
            for rel in releases_here:
                for ogr in (True, False):
                    out.extend(configurations(rel, 2, 1, "fp32", ogr=ogr, group="zero1"))
        elif group in REFERENCE_GROUPS:
            for rel in releases_here:
                out.extend(reference_cases(group, rel))
        elif group == "unit":
            for rel in releases_here:
                out.extend(dict(group="unit", release=rel, variant=v, impl="te",
                                id=f"{rel}|unit-tests|{v}", serialized=False)
                           for v in ("shipped", "hotfix"))
        elif group == "extras":
            for rel in releases_here:
                out.extend(configurations(rel, 2, 3, "fp8", group="extras"))
                out.extend(configurations(rel, 2, 3, "bf16", recompute=True, group="extras"))
                out.extend(configurations(rel, 2, 3, "bf16", moe=True, group="extras"))
        else:
            raise ValueError(f"unknown group {group!r} (known: "
                             f"{', '.join(GROUPS + MORE_GROUPS + REFERENCE_GROUPS)})")
    ids = [c["id"] for c in out]
    assert len(ids) == len(set(ids)), "a case is planned twice"
    return out


def selected(releases: tuple[str, ...], groups: tuple[str, ...], only: str
             ) -> list[dict[str, Any]]:
    """The plan of ``--releases`` and ``--groups``, cut to the ids ``--only`` matches."""
    return [c for c in plan(releases, groups) if not only or re.search(only, c["id"])]


def needs_te(c: dict[str, Any]) -> bool:
    """TE layers, or fused wgrad accumulation with any layers: Megatron-FSDP asserts
    TransformerEngine 2.10 or later for ``gradient_accumulation_fusion`` (megatron-core's own
    linear then takes TE's ``general_gemm`` for the wgrad), so a local-layer run with fusion
    has TE importable, as a user's job with TE installed has."""
    return bool(c.get("impl", "te") == "te" or c.get("fusion"))
