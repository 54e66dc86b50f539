"""What the hotfix knows, declared in one place: the copies it targets, the code shapes it
recognises in each of the three functions the fixes rest on (and what each shape implies), the
releases that shipped which shapes, the eras those shapes form, and the fixes.

Every fingerprint below was computed from the released wheels (``tests/test_detection.py``
recomputes them).
A shape is named after the first megatron-core release that shipped it: ``"0.17"`` is the code
as shipped in megatron-core 0.17.0 (and megatron-fsdp 0.4.0); :func:`shipped_in` says where else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Copy:
    """One importable copy of Megatron-FSDP; each has its own classes and is patched on its own."""

    label: str
    package: str
    distribution: str

    @property
    def buffer_module(self) -> str:
        """Defines ``ParamAndGradBuffer`` and ``GradReducePipeline``."""
        return f"{self.package}.param_and_grad_buffer"

    @property
    def model_module(self) -> str:
        """Defines ``MegatronFSDP``."""
        return f"{self.package}.megatron_fsdp"

    @property
    def core_linear_module(self) -> str | None:
        """megatron-core's own fused linear (:data:`CORE_LINEAR_MODULE`), for the copy vendored in
        megatron-core (``import megatron.core`` imports both); None for any other copy."""
        return CORE_LINEAR_MODULE if self.package.startswith("megatron.core.") else None


COPIES = (
    Copy("megatron-fsdp", "megatron_fsdp", "megatron-fsdp"),
    Copy("megatron-core (vendored)", "megatron.core.distributed.fsdp.src.megatron_fsdp",
         "megatron-core"),
)

# Copies whose design the fixes do not fit: importing them gets a refusal, never a patch.
REFUSED_MODULES = {
    "megatron.core.distributed.custom_fsdp.param_and_grad_buffer": (
        "megatron-core 0.13 custom_fsdp",
        "its main_grad getter is a class-level property on torch.nn.Parameter, a different design "
        "that this hotfix does not patch; upgrade to megatron-core >= 0.14 (with mfsdp-hotfix) or "
        "run with fsdp_double_buffer=False",
    ),
}

GETTER = "ParamAndGradBuffer._init_each_parameter_group_buffers.<locals>.main_grad_getter"
DRAIN = "GradReducePipeline._enforce_double_buffer_limit"
WAIT = "GradReducePipeline.wait_for_previous_grad_reduce"
FUNCTIONS = (GETTER, DRAIN, WAIT)
# In the model module (megatron_fsdp.py), read beside the buffer module. Only a fix's own gate:
# an unknown shape here does not refuse the copy, it leaves the fixes it gates unverified.
HOOKS = "MegatronFSDP._register_fsdp_hooks"
# Where every release since megatron-core 0.15.0 / megatron-fsdp 0.2.0 sets each parameter's
# ``overwrite_main_grad`` (after its all-gather), which decides whether fused wgrad accumulation
# overwrites or adds into ``main_grad``.
OVERWRITE_SETTER = "MegatronFSDP.all_gather_and_wait_parameters_ready"
GATES = (HOOKS, OVERWRITE_SETTER)
# In the buffer module: the synchronous reductions ``finish_grad_sync`` runs without
# ``overlap_grad_reduce``, per unsharded strategy. Read to decide reduce-once's need: where one
# reduces nothing (its loop skips every buffer), the hooks' reduction is that strategy's only one.
REDUCE_SCATTER = "ParamAndGradBuffer.reduce_scatter_gradients"
ALL_REDUCE = "ParamAndGradBuffer.all_reduce_gradients"
SYNCHRONOUS_REDUCTIONS = {"optim": REDUCE_SCATTER, "no_shard": ALL_REDUCE}
# In the buffer module: where each bucket's gradients are scaled and reduced. Read only to decide
# the release defects no fix repairs (a shape's ``carries``); like a gate, never the refusal.
BUCKET_REDUCE = "GradReducePipeline._bucket_group_gradient_reduce"
DEFECT_CARRIERS = (BUCKET_REDUCE,)
# Builds the pools; read only to say how many slots the gradient pool has (status).
POOL_BUILDER = "ParamAndGradBuffer._init_each_parameter_group_buffers"
# Every release's pools have 2 slots (``UB_BUFFER_NUM = 2``); NVIDIA PR #6316 makes it the
# configured ``fsdp_buffer_count``. A drain shape's ``live_units`` POOL_SIZE: that pool size, N.
RELEASE_POOL_SIZE = 2
POOL_SIZE = "N"


def short_name(qualname: str) -> str:
    """``main_grad_getter``, ``_enforce_double_buffer_limit``, ..."""
    return qualname.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Shape:
    """One known form of one function, and what it implies for the fixes.

    ``fingerprint`` None: recognised by its structure (``structure`` names the test in
    :mod:`mfsdp_hotfix.structure`), not by its text.
    """

    name: str
    fingerprint: str | None = None
    structure: str | None = None
    guarded: bool | None = None  # getter: drains the reduce-scatter queue before it allocates
    drain_stream: str | None = None  # drain: where retired reduce-scatters are waited on,
    #                                  "caller" (the writer's stream) or "rs_stream"
    live_units: int | str | None = None  # drain: units left live, counting the incoming one
    #                                        (POOL_SIZE: the pool size N, from the config)
    needs: frozenset[str] = frozenset()  # gate: ids of the fixes this shape needs
    reduces: bool | None = None  # synchronous reduction: reduces every gradient buffer
    carries: frozenset[str] = frozenset()  # carrier: names of the release defects no fix
    #                                        repairs that this code has
    note: str = "ordered-drain reuses it"  # what any other shape implies

    def implies(self) -> str:
        """What the shape means for the fixes, in a few words."""
        if self.guarded is not None:
            return "guarded" if self.guarded else "unguarded"
        if self.drain_stream is not None:
            where = "the caller's stream" if self.drain_stream == "caller" else self.drain_stream
            if self.live_units == POOL_SIZE:
                return f"waits on {where}, keeps N units live, N the configured pool size"
            units = "unit" if self.live_units == 1 else "units"
            return f"waits on {where}, keeps {self.live_units} {units} live"
        if self.reduces is not None:
            return ("reduces every gradient buffer" if self.reduces else
                    "skips every gradient buffer: reduces nothing")
        if self.needs:
            return "needs " + ", ".join(sorted(self.needs))
        if self.carries:
            return "has " + ", ".join(sorted(self.carries)) + ", which no fix repairs"
        return self.note


SHAPES: dict[str, tuple[Shape, ...]] = {
    GETTER: (
        Shape("0.14", "991107f2e75eaa6e2f5567049a45235be088a70697e281c937dd01ce2e69f495",
              guarded=False),
        Shape("0.17", "0480c5a8ac2347fe62a2103b10b13f88a227086cd017499eba3c1b10ae2f07ff",
              guarded=False),
        Shape("0.19", "9536069f4985f747be30ef6fd5b73ba366d0325847d531a9af6629d46f4eb02a",
              guarded=True),
        # ROCm/Megatron-LM PR #146 (a port of NVIDIA #5222), or any getter that calls the drain
        # before it fetches its bucket: the text varies, the order of the two calls does not.
        Shape("drains before fetching", structure="drains_before_fetching", guarded=True),
    ),
    DRAIN: (
        Shape("0.14", "cc2d1fa2642c351d39147350dafca5a1a00903f1269e5a7fd9308f62e9c1ee85",
              drain_stream="caller", live_units=2),
        Shape("0.18", "a1783b8dc8f20c5e639262da00c959dcff7666e0132ad89868340b10cd3c3578",
              drain_stream="rs_stream", live_units=1),
        Shape("0.19", "9b70f49286019d5cb6b84bb6e52df6025f9d3c118579eabc67a4aa062ffcb2bd",
              drain_stream="rs_stream", live_units=2),
        # NVIDIA PR #6316 (and #6317, #6318, #6665 on top of it): 0.19's drain with its pool
        # size N read from the config (fsdp_buffer_count) instead of the constant 2.
        Shape("pool size from the config", structure="drains_to_configured_pool_size",
              drain_stream="rs_stream", live_units=POOL_SIZE),
        # The change proposed upstream (ORDERED_DRAIN_UPSTREAM) on PR #6316: the same drain,
        # waiting on the caller's stream. On main the change gives 0.14's drain text again
        # (comments aside), which "0.14" above recognises.
        Shape("pool size from the config, on the caller's stream",
              structure="drains_to_configured_pool_size_on_callers_stream",
              drain_stream="caller", live_units=POOL_SIZE),
    ),
    WAIT: (
        Shape("0.14", "18a7000ad753206566df235d409814de9319429954a1f2761717b20d53920b2e"),
        Shape("0.17", "274b821a5fb1391b53f2cc32f68e06300fb7fafb7429e5a54b1f3134b232653f"),
    ),
    # A unit whose post-backward hook never ran stays PRE_BACKWARD; from 0.16 its next
    # post-forward releases its parameters lazily, before 0.16 it keeps them gathered. Every
    # release's hooks also reduce unsharded gradients on the last microbatch whatever
    # overlap_grad_reduce says (reduce-once); NVIDIA/Megatron-LM#6357 reduces them there only
    # with overlap. With ZeRO-2/3 every release's hooks, and NVIDIA main's before
    # NVIDIA/Megatron-LM#6773, reduce every gradient buffer in every microbatch, a buffer whose
    # data-parallel group has one rank too (single-rank-reduce).
    HOOKS: (
        Shape("0.14", "165cb11b0521d204ab991b78257547ca679b491978d7c2240c64068e0ffe4ce0",
              needs=frozenset({"missed-post-backward", "reduce-once", "single-rank-reduce"})),
        *(Shape(name, fingerprint, needs=frozenset({"reduce-once", "single-rank-reduce"}))
          for name, fingerprint in (
              ("0.16", "819fea0a1dbddaa5c909b026dd6660a873509886698a31a6d71e785aef76e450"),
              ("0.17", "32fe8ef255b44a394c015edfbcaaf81868496e158c1dc3d32e7dbae0c93ef99c"),
              ("0.18", "049be221636061637620cac833fc943cf6c8eedd59bd4b659d60f278751407fb"),
              ("0.19", "fa95ce6cc803e35c9d0b319da2ef2115c31985aa725592638fbe1a6343079c9d"))),
        # Forks, snapshots and git trees of 0.16 and later in their own words (the ROCm fork,
        # NVIDIA main), told apart by what their reduction condition yields (structure.py).
        Shape("releases stale units lazily, reduces unsharded gradients once",
              structure="lazy_and_reduces_unsharded_once",
              needs=frozenset({"single-rank-reduce"})),
        Shape("releases stale units lazily, reduces unsharded gradients in the hooks always",
              structure="lazy_and_reduces_unsharded_always",
              needs=frozenset({"reduce-once", "single-rank-reduce"})),
    ),
    # Fused wgrad accumulation overwrites main_grad where the parameter says so. Right with
    # sharded gradients (each microbatch's wgrad lands in a fresh bucket that is reduce-scattered
    # and accumulated into the shard); wrong with unsharded ones (ZeRO-1), whose one buffer must
    # add up the microbatches.
    OVERWRITE_SETTER: (
        Shape("0.14", "55ba5dad1b6ec254dd157f6e4911fb3bd5361c27cd2aa9b4c9090468f255341e",
              note="does not set overwrite_main_grad"),
        *(Shape(name, fingerprint, needs=frozenset({"zero1-accumulate"}))
          for name, fingerprint in (
              ("0.15", "aee0a25a64f54cd5ff4f4bb6af4caeb14195ee5f84206872f5ecd930a0694722"),
              ("0.16", "d3cae2766d5256229bd3ed4f3e2bccf3daaef0bbaf4a1303d4cc56692a931b02"))),
        # NVIDIA main since NVIDIA/Megatron-LM#6357 (not in a release yet).
        Shape("NVIDIA/Megatron-LM#6357",
              "ddbe9102d9f29958d94269a7595a54ba7f0eed902320cfd442ad4c9cfb13d0fa",
              note="sets overwrite_main_grad for sharded gradients only"),
        # Forks and backports in their own words.
        Shape("sets overwrite_main_grad = True", structure="always_overwrites_main_grad",
              needs=frozenset({"zero1-accumulate"})),
        Shape("sets overwrite_main_grad per parameter", structure="decides_overwrite_main_grad",
              note="sets overwrite_main_grad from the parameter's strategy, not always True"),
    ),
}

SHAPES.update({qualname: (
    Shape("reduces every buffer", structure="reduces_every_buffer", reduces=True),
    Shape("skips every buffer", structure="skips_every_buffer", reduces=False))
    for qualname in SYNCHRONOUS_REDUCTIONS.values()})
# megatron-fsdp 0.1.0-0.2.3 / megatron-core 0.14.0-0.15.3 pre-scale the buffer's local data,
# not the bucket they reduce (SHARDED_GRADS_SUMMED_UNSCALED); 0.3.0 / 0.16.0 scale the bucket,
# but reduce-scatter an unsharded buffer into itself and then add the result onto it
# (UNSHARDED_SHARD_ADDED_TO_ITSELF), which 0.1.0-0.2.3 all-reduce and 0.4.0 / 0.17.0 copy.
# A text not listed here may have any of the defects (status says so; a model built in a
# configuration one of them hits is refused).
SHAPES[BUCKET_REDUCE] = (
    Shape("0.14", "f01923e16ccee5d907463f6c716bef6a16e5f8cb65a00e7a2c3cb27967c4322b",
          carries=frozenset({"sharded-grads-summed-unscaled"})),
    Shape("0.16", "ce9962803fc1cf08756f51a63756077f8cec43d67828c6831448a560d7e109e7",
          carries=frozenset({"unsharded-shard-added-to-itself"})),
    Shape("0.17", "dc74523e2efbcce02a3015f671701ce60296c8a3cdf7605be77c6d151280f37f",
          note="scales the bucket it reduces"),
)

# megatron-core's own fused linear, outside Megatron-FSDP: ColumnParallelLinear and
# RowParallelLinear (the GPT output layer of every Megatron-LM model, every layer with
# --transformer-impl local) run their weight gradient through this backward. Read from the
# megatron-core tree the vendored copy belongs to (tensor_parallel/layers.py); a copy outside
# megatron-core, or a tree without that package, has none.
CORE_LINEAR_MODULE = "megatron.core.tensor_parallel.layers"
CORE_LINEAR_BACKWARD = "LinearWithGradAccumulationAndAsyncCommunication.backward"
# With gradient_accumulation_fusion, a Megatron-FSDP weight's (``__fsdp_param__``) wgrad is
# written into ``weight.get_main_grad()`` with ``out=`` and never added, whatever
# overwrite_main_grad says: matmul in 0.14-0.17, TE's general_gemm (accumulate=False) in 0.18
# and 0.19, ``_wgrad_gemm`` on NVIDIA main (NVIDIA/Megatron-LM#6624). Shape "0.14" is the text of
# megatron-core 0.14.0-0.17.1, "0.18" of 0.18.0-0.18.2, "0.19" of 0.19.0-0.19.2.
SHAPES[CORE_LINEAR_BACKWARD] = (
    *(Shape(name, fingerprint, needs=frozenset({"core-linear-accumulate"}))
      for name, fingerprint in (
          ("0.14", "4505ae9d8664d268d98ef706ee0aa22a307e844e1050c239ce0efaf94c5406ac"),
          ("0.18", "670004e49bac7e35199866812610ca8512362d2c25e698b45659a2719123c64d"),
          ("0.19", "034d10a93552d91a5bfeb1362110606cb80fe818bc70698464970d69bc6d5dda"),
          ("NVIDIA main d98e8a64dd",
           "b068be53ef505268ec505a121ae9dbc72fd3944ca1bb672cd0aa13e3518100c6"))),
    # Forks and later trees in their own words, told apart by whether the Megatron-FSDP branch
    # reads overwrite_main_grad (the change proposed upstream, upstream/core_linear.patch).
    Shape("overwrites a Megatron-FSDP main_grad", structure="fsdp_wgrad_overwrites",
          needs=frozenset({"core-linear-accumulate"})),
    Shape("follows overwrite_main_grad", structure="fsdp_wgrad_follows_overwrite_main_grad",
          note="the Megatron-FSDP wgrad overwrites main_grad only where overwrite_main_grad "
               "says so"),
)

# The shapes (getter, drain, wait) each verified release shipped, checked against every wheel by
# tests/test_detection.py. Only these labels can make a copy a "verified release".
_SHIPPED = (
    (("0.14", "0.14", "0.14"),
     {"megatron-core": "0.14.0 0.15.0 0.15.1 0.15.2 0.15.3 0.16.0 0.16.1",
      "megatron-fsdp": "0.1.0 0.2.0 0.2.1 0.2.2 0.2.3 0.3.0 0.3.1"}),
    (("0.17", "0.14", "0.17"), {"megatron-core": "0.17.0 0.17.1", "megatron-fsdp": "0.4.0"}),
    (("0.17", "0.18", "0.17"),
     {"megatron-core": "0.18.0 0.18.1 0.18.2", "megatron-fsdp": "0.5.0 0.5.1"}),
    (("0.19", "0.19", "0.17"),
     {"megatron-core": "0.19.0 0.19.1 0.19.2", "megatron-fsdp": "0.6.0 0.6.1"}),
)
# (distribution, "X.Y.Z") -> {function: shape name}
RELEASES: dict[tuple[str, str], dict[str, str]] = {
    (distribution, version): dict(zip(FUNCTIONS, names, strict=True))
    for names, by_distribution in _SHIPPED
    for distribution, versions in by_distribution.items()
    for version in versions.split()
}


def shipped_in(qualname: str, shape: Shape) -> str | None:
    """``"megatron-core 0.17.0-0.18.2, megatron-fsdp 0.4.0-0.5.1"``; None for a structural one."""
    parts = []
    for distribution in ("megatron-core", "megatron-fsdp"):
        found = sorted((tuple(int(n) for n in version.split(".")), version)
                       for (dist, version), shapes in RELEASES.items()
                       if dist == distribution and shapes.get(qualname) == shape.name)
        if found:
            first, last = found[0][1], found[-1][1]
            parts.append(f"{distribution} {first}" + (f"-{last}" if last != first else ""))
    return ", ".join(parts) or None


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


@dataclass(frozen=True)
class Fix:
    """One repair, what it replaces or relies on, and where it stands upstream.

    ``depends_on``: functions that must have a known shape for the fix to be applied (or for
    its need to be decided); an unknown shape there refuses the copy, and this fix with it
    (``refused``), while a fix that depends on none of them still applies.
    ``only_unguarded``: needed only where the getter's shape is unguarded.
    ``only_unordered``: not needed where the getter drains and the drain orders the caller's
    stream with at most pool-size units live (era "none": the change proposed upstream).
    ``gate``: a model-module function (:data:`GATES`), or megatron-core's fused linear
    (:data:`CORE_LINEAR_BACKWARD`), whose shape decides the need (its :attr:`Shape.needs`); an
    unknown shape there leaves the fix unverified, not the copy refused; a gate whose code is not
    in the copy's tree at all (megatron-core's linear beside megatron-fsdp): not needed.
    ``reductions``: buffer-module functions of which at least one must reduce
    (:attr:`Shape.reduces`) for the fix to be needed; an unknown shape there: unverified.
    """

    id: str
    summary: str
    depends_on: tuple[str, ...]
    only_unguarded: bool
    upstream: str
    gate: str | None = None
    reductions: tuple[str, ...] = ()
    only_unordered: bool = False  # not needed where the getter and drain form era "none"


GETTER_GUARD = Fix(
    "getter-guard",
    "main_grad_getter drains the reduce-scatter queue before it allocates a gradient bucket",
    (GETTER, DRAIN, WAIT), True,
    "NVIDIA/Megatron-LM#5222, first released in megatron-core 0.19.0 / megatron-fsdp 0.6.0",
)
ORDERED_DRAIN = Fix(
    "ordered-drain",
    "at most pool-size units live, counting the incoming one; the stream that writes into a "
    "recycled slot waits on the reduce-scatter that last read it",
    (DRAIN, WAIT), False,
    "not fixed upstream as of megatron-core 0.19.2 / megatron-fsdp 0.6.1; proposed as "
    + ORDERED_DRAIN_UPSTREAM,
    only_unordered=True,
)
MISSED_POST_BACKWARD = Fix(
    "missed-post-backward",
    "a ZeRO-3 unit whose post-backward hook never ran (no input needs a gradient, e.g. the "
    "first unit) is released before the next forward instead of keeping one of the 2 slots of "
    "the double-buffered parameter pool ('[fsdp_params] No buffer found for bucket_id')",
    (), False,
    "not fixed as such; megatron-fsdp 0.3.0 / megatron-core 0.16.0 release such a unit's "
    "parameters lazily, which avoids the crash",
    gate=HOOKS,
)
ZERO1_ACCUMULATE = Fix(
    "zero1-accumulate",
    "with unsharded gradients (ZeRO-1 'optim'), fused wgrad accumulation adds each microbatch "
    "into main_grad instead of overwriting it: overwrite_main_grad is left True only for "
    "sharded gradients (optim_grads, optim_grads_params)",
    (), False,
    "NVIDIA/Megatron-LM#6357 (on main; not in a release as of megatron-core 0.19.2 / "
    "megatron-fsdp 0.6.1)",
    gate=OVERWRITE_SETTER,
)
REDUCE_ONCE = Fix(
    "reduce-once",
    "with unsharded gradients (ZeRO-1 'optim', 'no_shard') and overlap_grad_reduce=False, the "
    "backward hooks leave the reduction to finish_grad_sync, which reduces the buffer once",
    (), False,
    "NVIDIA/Megatron-LM#6357 (on main; not in a release as of megatron-core 0.19.2 / "
    "megatron-fsdp 0.6.1)",
    gate=HOOKS, reductions=(REDUCE_SCATTER, ALL_REDUCE),
)
SINGLE_RANK_REDUCE = Fix(
    "single-rank-reduce",
    "with ZeRO-2/3, a gradient buffer whose data-parallel group has one rank (data-parallel size "
    "1; the experts' when expert-parallel equals data-parallel) accumulates its microbatches in "
    "place (fused wgrad adds into it) and is scaled once per step in finish_grad_sync, instead "
    "of being reduced over that one rank in every microbatch",
    (), False,
    "NVIDIA/Megatron-LM#6773 (on main; not in a release as of megatron-core 0.19.2 / "
    "megatron-fsdp 0.6.1)",
    gate=HOOKS,
)
CORE_LINEAR_ACCUMULATE = Fix(
    "core-linear-accumulate",
    "megatron-core's own fused linear (ColumnParallelLinear, RowParallelLinear) adds a "
    "Megatron-FSDP weight's wgrad into main_grad where overwrite_main_grad is False (unsharded "
    "gradients, with zero1-accumulate or NVIDIA/Megatron-LM#6357), as TransformerEngine does",
    (), False,
    "not fixed upstream as of megatron-core 0.19.2 and NVIDIA main d98e8a64dd; proposed as the "
    "upstream change 'megatron-core fused linear: accumulate into a Megatron-FSDP main_grad "
    "unless overwrite_main_grad' (mfsdp-hotfix upstream/core_linear.patch)",
    gate=CORE_LINEAR_BACKWARD,
)
# The double buffer's fixes (the eras); the others repair release defects outside it and rest on
# none of the double buffer's functions, so they apply to a copy refused for those.
DOUBLE_BUFFER_FIXES = (GETTER_GUARD, ORDERED_DRAIN, MISSED_POST_BACKWARD)
FIXES = (*DOUBLE_BUFFER_FIXES, ZERO1_ACCUMULATE, REDUCE_ONCE, SINGLE_RANK_REDUCE,
         CORE_LINEAR_ACCUMULATE)
FIX_IDS = frozenset(fix.id for fix in FIXES)


def needed(fix: Fix, shapes: Mapping[str, Shape]) -> bool:
    """Whether a copy with these (known) shapes needs ``fix`` (a gated fix: its gate's shape)."""
    if fix.reductions and not any(name in shapes and shapes[name].reduces
                                  for name in fix.reductions):
        return False
    if fix.gate is not None:
        return fix.gate in shapes and fix.id in shapes[fix.gate].needs
    if fix.only_unordered and era_of(shapes[GETTER], shapes[DRAIN]).name == "none":
        return False
    return not fix.only_unguarded or shapes[GETTER].guarded is False


@dataclass(frozen=True)
class PoolAllocator:
    """One double-buffer pool allocator class a release may build its pools from, and the two
    methods through which a bucket takes and gives back a slot (what the audit watches)."""

    cls: str
    allocate: str
    free: str
    since: str  # the first releases that have it


# Every pool allocator a known release has. The audit watches each one present in a copy; a
# gradient pool built from any other class is reported as unwatched, never as ordered.
POOL_ALLOCATORS = (
    PoolAllocator("FixedPoolAllocator", "allocate", "free",
                  "megatron-core 0.14.0 / megatron-fsdp 0.1.0 (fsdp_double_buffer=True)"),
    PoolAllocator("MaxPoolAllocator", "allocate", "free",
                  "megatron-core 0.19.0 / megatron-fsdp 0.6.0 (fsdp_double_buffer=True with "
                  "megatron_fsdp_max_pool_double_buffer / maxpool_double_buffer=True)"),
)
# The pools (by their ``name``) that hold gradients: the main gradient buckets and HSDP's
# gradient-communication buckets. The parameter pools (fsdp_params, fsdp_fp8_transpose_params)
# are all-gather targets, not reduce-scatter sources, and are not judged by the rule.
GRAD_POOLS = frozenset({"fsdp_grads", "hsdp_grad_comm"})
# Where a built ParamAndGradBuffer keeps its gradient pools (None: not built, e.g. no double
# buffer, or no HSDP).
GRAD_POOL_ATTRIBUTES = ("main_grad_alloc", "hsdp_grad_comm_alloc")


@dataclass(frozen=True)
class ReleaseDefect:
    """A defect of released Megatron-FSDP outside the double buffer that users are told about
    (``status``, docs/RELEASE_DEFECTS.md), and what protects them from it.

    ``fix``: the fix (in :data:`FIXES`) that repairs it; the releases it affects are the copies
    whose code needs that fix (a fix's gate shape decides, whatever the label), so a copy is
    judged by its code and the ranges here only say where the shipped releases stand.
    ``fix`` None: no fix repairs it; ``carrier`` (in :data:`DEFECT_CARRIERS`) is the function
    whose shape decides, by its :attr:`Shape.carries` (an unknown shape: the copy may have it).
    A copy with such a defect is not protected, and a model built in a configuration the
    defect hits is refused (``coverage.py``).
    ``not_covered``: where the defect remains even with the fix (told, not repaired).
    """

    name: str
    fix: str | None
    releases: dict[str, str]  # distribution -> affected release range
    git_trees: str  # how a git install or fork is recognised
    configuration: str  # what triggers it
    symptom: str
    workarounds: tuple[str, ...]  # for users who cannot take the fix, each verified
    upstream: str
    not_covered: str
    carrier: str | None = None  # fix None: the function whose shape has the defect


ZERO1_FUSED_WGRAD_OVERWRITE = ReleaseDefect(
    "zero1-fused-wgrad-overwrite",
    ZERO1_ACCUMULATE.id,
    {"megatron-fsdp": "0.2.0-0.6.1", "megatron-core": "0.15.0-0.19.2"},
    "any copy whose MegatronFSDP.all_gather_and_wait_parameters_ready sets "
    "param.overwrite_main_grad = True (git installs of NVIDIA main before "
    "NVIDIA/Megatron-LM#6357, forks based on those releases)",
    "ZeRO-1 (data_parallel_sharding_strategy='optim') with fused wgrad accumulation "
    "(TransformerEngine fuse_wgrad_accumulation / gradient_accumulation_fusion) and 2 or more "
    "microbatches per optimizer step under no_sync() (Megatron-LM's schedule)",
    "silently wrong gradients: each microbatch's weight gradient overwrites the ones before it "
    "in the unsharded gradient buffer, so the step sees only the last microbatch's weight "
    "gradients",
    ("ZeRO-2 or ZeRO-3 (optim_grads, optim_grads_params)",
     "fused wgrad accumulation off (gradient_accumulation_fusion=False)",
     "one microbatch per optimizer step"),
    ZERO1_ACCUMULATE.upstream,
    "MoE experts through TransformerEngine's op fuser set overwrite_main_grad = True again in "
    "their forward pre-hook: not repaired, use a workaround there. megatron-core's own fused "
    "linear (tensor_parallel/layers.py: the GPT output layer, every layer with "
    "--transformer-impl local) overwrites main_grad whatever overwrite_main_grad says: that is "
    "the release defect core-linear-fused-wgrad-overwrite, repaired by core-linear-accumulate",
)
UNSHARDED_GRADS_REDUCED_TWICE = ReleaseDefect(
    "unsharded-grads-reduced-twice",
    REDUCE_ONCE.id,
    {"megatron-fsdp": "0.3.0-0.6.1", "megatron-core": "0.16.0-0.19.2"},
    "any copy whose MegatronFSDP._register_fsdp_hooks reduces unsharded gradients on "
    "is_last_microbatch or model_auto_sync without asking overlap_grad_reduce and whose "
    "ParamAndGradBuffer.reduce_scatter_gradients or all_reduce_gradients reduces every buffer "
    "(git installs of NVIDIA main before NVIDIA/Megatron-LM#6357, forks based on those "
    "releases)",
    "ZeRO-1 (data_parallel_sharding_strategy='optim'), and from megatron-fsdp 0.5.0 / "
    "megatron-core 0.18.0 no_shard, with overlap_grad_reduce=False, any number of "
    "microbatches, fused wgrad accumulation or not (fully_shard users who turn "
    "overlap_grad_reduce off; Megatron-LM and Megatron-Bridge keep it on wherever they "
    "accumulate)",
    "silently wrong gradients: the backward hooks reduce the unsharded buffer on the last "
    "microbatch and finish_grad_sync reduces it again (ZeRO-1: a second reduce-scatter of the "
    "already reduced buffer; no_shard: a second all-reduce, harmless with averaging but a factor "
    "of the data-parallel size with a SUM reduction, calculate_per_token_loss)",
    ("overlap_grad_reduce=True (the default)",),
    REDUCE_ONCE.upstream,
    "HSDP (a DP-Outer group of 2 or more ranks) with ZeRO-1 or no_shard and "
    "overlap_grad_reduce=False: finish_grad_sync reduces over the DP-Shard group only, and the "
    "DP-Outer all-reduce is only in the hooks' reduction, so reducing once there is wrong too "
    "(NVIDIA main, with NVIDIA/Megatron-LM#6357, as well). Building such a model is refused, "
    "whatever the fix's state; use overlap_grad_reduce=True",
)
CORE_LINEAR_FUSED_WGRAD_OVERWRITE = ReleaseDefect(
    "core-linear-fused-wgrad-overwrite",
    CORE_LINEAR_ACCUMULATE.id,
    {"megatron-core": "0.14.0-0.19.2"},
    "any megatron-core tree whose LinearWithGradAccumulationAndAsyncCommunication.backward "
    "writes a Megatron-FSDP weight's wgrad into main_grad without reading overwrite_main_grad "
    "(NVIDIA main as of d98e8a64dd, forks based on those releases)",
    "ZeRO-1 (data_parallel_sharding_strategy='optim'), and ZeRO-2/3 where a gradient buffer's "
    "data-parallel group has one rank (once single-rank-reduce lets it accumulate), with "
    "gradient_accumulation_fusion on "
    "(Megatron-LM's default) in megatron-core's own linear layers (ColumnParallelLinear, "
    "RowParallelLinear: the GPT output layer of every Megatron-LM model, every layer with "
    "--transformer-impl local) and 2 or more microbatches per optimizer step",
    "silently wrong gradients: each microbatch's weight gradient of those layers overwrites the "
    "ones before it in the unsharded gradient buffer, even where zero1-accumulate (or "
    "NVIDIA/Megatron-LM#6357) has set overwrite_main_grad = False",
    ("fused wgrad accumulation off (gradient_accumulation_fusion=False, Megatron-LM's "
     "--no-gradient-accumulation-fusion)",
     "ZeRO-2 or ZeRO-3 (optim_grads, optim_grads_params)",
     "one microbatch per optimizer step"),
    CORE_LINEAR_ACCUMULATE.upstream,
    "megatron-core 0.14.0, whose Megatron-FSDP sets no overwrite_main_grad, so the fix has "
    "nothing to follow there: its ZeRO-1 through these layers stays wrong, use a workaround",
)
SINGLE_RANK_GRADS = ReleaseDefect(
    "single-rank-grads-reduced-every-microbatch",
    SINGLE_RANK_REDUCE.id,
    {"megatron-fsdp": "0.1.0-0.6.1", "megatron-core": "0.14.0-0.19.2"},
    "any copy whose MegatronFSDP._register_fsdp_hooks reduces every ZeRO-2/3 gradient buffer in "
    "every microbatch whatever the size of its data-parallel group (git installs of NVIDIA main "
    "before NVIDIA/Megatron-LM#6773, forks based on those releases)",
    "ZeRO-2/3 (optim_grads, optim_grads_params) where a gradient buffer's data-parallel group "
    "has one rank: every run with data-parallel size 1 (one GPU, or all of them given to "
    "tensor/pipeline/context parallelism), and the expert gradients of MoE runs whose "
    "expert-parallel size equals their data-parallel size; with 2 or more microbatches per "
    "step, and from one microbatch on megatron-fsdp 0.3.0-0.3.1 / megatron-core 0.16",
    "silently wrong gradients: that buffer is main_grad itself and must add up the step's "
    "microbatches, but fused wgrad overwrites it (only the last microbatch is kept), every "
    "microbatch's reduction over its one rank rescales what it holds (by 1/data-parallel size "
    "for experts), and megatron-fsdp 0.3.0-0.3.1 / megatron-core 0.16 add it onto itself "
    "(it doubles every microbatch); clip-grad hides it until the norm overflows to inf",
    ("one microbatch per step, on megatron-fsdp 0.4.0 and later / megatron-core 0.17 and later",
     "fused wgrad accumulation off (gradient_accumulation_fusion=False), on megatron-fsdp 0.4.0 "
     "and later / megatron-core 0.17 and later, where the scale is 1 (data-parallel size 1, "
     "not experts)"),
    SINGLE_RANK_REDUCE.upstream,
    "HSDP with a one-rank DP-Shard group on megatron-fsdp 0.3.0-0.3.1 / megatron-core 0.16, "
    "whose last reduction still adds the buffer onto itself (unsharded-shard-added-to-itself: "
    "refused)",
)
SHARDED_GRADS_SUMMED_UNSCALED = ReleaseDefect(
    "sharded-grads-summed-unscaled",
    None,
    {"megatron-fsdp": "0.1.0-0.2.3", "megatron-core": "0.14.0-0.15.3"},
    "any copy whose GradReducePipeline._bucket_group_gradient_reduce has the text these "
    "releases shipped (it pre-scales gbuf.data, not the bucket it reduces)",
    "ZeRO-2/3 (optim_grads, optim_grads_params) over 2 or more data-parallel ranks with the "
    "gradients scaled before a SUM reduction: gradient_reduce_div_fusion=False, or a bf16 "
    "gradient buffer (bf16 gradients with grad_reduce_in_fp32=False); not with "
    "calculate_per_token_loss=True or average_in_collective=True (nothing is scaled then), nor "
    "with fp32 gradient buffers and gradient_reduce_div_fusion=True (scaled in the collective)",
    "silently wrong gradients: the scale 1/data-parallel size is applied to the rank's "
    "accumulated gradient shard instead of the bucket that is reduce-scattered, which is "
    "summed unscaled: gradients data-parallel size times too large, and wrong beyond a "
    "constant factor when accumulated over microbatches",
    ("calculate_per_token_loss=True (the release scales nothing; the loss carries the "
     "normalisation)",
     "fp32 gradient reduction (grad_reduce_in_fp32=True) with gradient_reduce_div_fusion=True, "
     "the default",
     "megatron-fsdp >= 0.3.0 / megatron-core >= 0.16.0, which scale the bucket they reduce"),
    "fixed in megatron-fsdp 0.3.0 / megatron-core 0.16.0",
    "every configuration it hits: no fix repairs it, and a model built in one is refused "
    "(UnsupportedConfiguration) while the hotfix is loaded",
    carrier=BUCKET_REDUCE,
)
UNSHARDED_SHARD_ADDED_TO_ITSELF = ReleaseDefect(
    "unsharded-shard-added-to-itself",
    None,
    {"megatron-fsdp": "0.3.0-0.3.1", "megatron-core": "0.16.0-0.16.1"},
    "any copy whose GradReducePipeline._bucket_group_gradient_reduce has the text these "
    "releases shipped (it adds every reduce-scattered shard onto the gradient buffer, sharded or "
    "not)",
    "ZeRO-1 (optim) with overlap_grad_reduce=True (the default), whatever the number of ranks "
    "and microbatches; and HSDP with ZeRO-2/3 whose DP-Shard group has one rank",
    "silently wrong gradients: the backward hooks reduce-scatter an unsharded gradient buffer "
    "into its own shard and then add the reduced shard onto that shard, so each rank's "
    "gradients are its own unreduced ones plus the mean (or twice the mean, with the double "
    "buffer, whose shard is the bucket itself)",
    ("ZeRO-1 with overlap_grad_reduce=False (with the hotfix: reduce-once leaves the reduction "
     "to finish_grad_sync, which does not add)",
     "ZeRO-2 or ZeRO-3",
     "megatron-fsdp >= 0.4.0 / megatron-core >= 0.17.0, which copy the reduced shard"),
    "fixed in megatron-fsdp 0.4.0 / megatron-core 0.17.0",
    "every configuration it hits: no fix repairs it, and a model built in one is refused "
    "(UnsupportedConfiguration) while the hotfix is loaded",
    carrier=BUCKET_REDUCE,
)
# The first releases after those whose one-rank reduction adds the buffer onto itself
# (megatron-fsdp 0.3.x, megatron-core 0.16), by distribution: from these on one microbatch per
# step keeps a one-rank buffer right (SINGLE_RANK_GRADS's first workaround) and
# single-rank-reduce repairs HSDP too (its not_covered). The audit takes a copy labelled before
# them, or with no release label, as one that may add the buffer onto itself.
SINGLE_RANK_NO_SELF_ADD_FROM = {"megatron-fsdp": "0.4.0", "megatron-core": "0.17.0"}
RELEASE_DEFECTS = (ZERO1_FUSED_WGRAD_OVERWRITE, UNSHARDED_GRADS_REDUCED_TWICE, SINGLE_RANK_GRADS,
                   CORE_LINEAR_FUSED_WGRAD_OVERWRITE, SHARDED_GRADS_SUMMED_UNSCALED,
                   UNSHARDED_SHARD_ADDED_TO_ITSELF)


def defects_of(fixes: Mapping[str, str],
               shapes: Mapping[str, Shape | None] | None = None) -> list[ReleaseDefect]:
    """The release defects a copy has, from the state of each fix (``fixes``: id -> state):
    every one whose fix the copy's code needs, or may need (its shape unknown), whatever the
    hotfix then did about it; and, from the copy's ``shapes``, every one no fix repairs whose
    carrier has it (:func:`carried`: yes or unknown). A carrier absent from ``shapes`` (None:
    the code was not read) decides nothing."""
    return [defect for defect in RELEASE_DEFECTS
            if (carried(defect, shapes or {}) is not False if defect.fix is None else
                fixes.get(defect.fix, "not needed") != "not needed")]


def carried(defect: ReleaseDefect, shapes: Mapping[str, Shape | None]) -> bool | None:
    """Whether a copy with these shapes has ``defect``, one no fix repairs: True, False, or None
    where its carrier's shape is unknown (the copy may have it). False where the carrier was not
    read at all (absent from ``shapes``: a copy refused before its code was read)."""
    assert defect.carrier is not None, f"{defect.name} has a fix; its fix's state decides"
    if defect.carrier not in shapes:
        return False
    shape = shapes[defect.carrier]
    return None if shape is None else defect.name in shape.carries
