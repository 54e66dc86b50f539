"""The eras the known getter and drain shapes form, as status tells them: what each pair does
wrong, what protects a job without the hotfix, and the change proposed upstream that leaves
none."""

from __future__ import annotations

from dataclasses import dataclass

from .registry import POOL_SIZE, RELEASE_POOL_SIZE, Shape


@dataclass(frozen=True)
class Era:
    """What a combination of getter and drain shapes does wrong (for status; the fixes follow
    the shapes themselves). ``None`` in a field matches any value. ``without_hotfix`` says what
    protects a job that does not load the hotfix, as measured with real TransformerEngine
    (docs/VALIDATION.md): the widespread workaround, fused wgrad accumulation off, protects
    only against era A's crash. ``live_units`` is counted in a 2-slot pool: a drain that keeps
    its pool's N of N slots live (:data:`POOL_SIZE`) matches 2."""

    name: str
    defect: str
    guarded: bool | None
    drain_stream: str | None
    live_units: int
    without_hotfix: str


# The change this project proposes upstream (upstream/PR.md): the drain waits on the caller's
# stream again, as it did before megatron-core 0.18 (NVIDIA/Megatron-LM#4054 moved it to
# rs_stream). A copy whose getter drains and whose drain already does this is era "none".
ORDERED_DRAIN_UPSTREAM = (
    "the upstream change 'Megatron-FSDP: wait on the writer's stream when recycling a "
    "double-buffer gradient slot' (mfsdp-hotfix upstream/main.patch, upstream/pr6316.patch)")

_ONLY_NO_DOUBLE_BUFFER = (
    "only fsdp_double_buffer=False; turning fused wgrad accumulation off does NOT protect "
    "(gradients measured wrong with real TransformerEngine, docs/VALIDATION.md)")

ERAS = (
    Era("A", "crash: 'No buffer found for bucket_id' (unguarded getter)", False, None, 2,
        "fsdp_double_buffer=False, or fused wgrad accumulation off (measured on megatron-fsdp "
        "0.4.0 with real TransformerEngine: no crash, gradients bit-identical, "
        "docs/VALIDATION.md)"),
    Era("B", "silent gradient corruption: a freed slot is rewritten while its reduce-scatter "
             "may still read it", None, None, 1, _ONLY_NO_DOUBLE_BUFFER),
    Era("C", "race when a reduce-scatter is slower than one unit's backward (the drain orders "
             "only rs_stream)", True, "rs_stream", 2, _ONLY_NO_DOUBLE_BUFFER),
    Era("none", "no known defect: the getter drains before it allocates and the drain orders "
                "the caller's stream", True, "caller", 2,
        "nothing is needed: the copy's own code orders the writer of a recycled slot after the "
        "reduce-scatter that last read it, as " + ORDERED_DRAIN_UPSTREAM + " does"),
)


def era_of(getter: Shape, drain: Shape) -> Era:
    """The era a known getter and drain form (the table covers every pair of known shapes)."""
    return next(era for era in ERAS
                if era.guarded in (None, getter.guarded)
                and era.drain_stream in (None, drain.drain_stream)
                and era.live_units == (RELEASE_POOL_SIZE if drain.live_units == POOL_SIZE
                                       else drain.live_units))
