"""What the hotfix knows of the code it reads, declared in one place: the copies it targets,
the functions it reads in each, and the code shapes it recognises in each of those functions (and
what each shape implies). The rest of what the hotfix knows is declared on top of these: the
releases that shipped which shapes (``verified_releases``), the eras those shapes form
(``eras``), the fixes (``fix_catalogue``), the release defects (``release_defects``) and the
gradient pools the audit watches (``gradient_pools``).

Every fingerprint below was computed from the released wheels (``tests/test_detection.py``
recomputes them).
A shape is named after the first megatron-core release that shipped it: ``"0.17"`` is the code
as shipped in megatron-core 0.17.0 (and megatron-fsdp 0.4.0);
:func:`~mfsdp_hotfix.verified_releases.shipped_in` says where else.
"""

from __future__ import annotations

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
        return f"{self.package}{BUFFER}"

    @property
    def model_module(self) -> str:
        """Defines ``MegatronFSDP``."""
        return f"{self.package}{MODEL}"

    @property
    def core_linear_module(self) -> str | None:
        """megatron-core's own fused linear (:data:`CORE_LINEAR_MODULE`), for the copy vendored in
        megatron-core (``import megatron.core`` imports both); None for any other copy."""
        return self.module(CORE_LINEAR_MODULE)

    def module(self, where: str) -> str | None:
        """The module a fix patches or a gate is read from: ``where`` relative (``.name``) is a
        module of this copy's package; absolute, a megatron-core module outside Megatron-FSDP,
        in the tree of the copy vendored in megatron-core only (None for any other copy)."""
        if where.startswith("."):
            return f"{self.package}{where}"
        return where if self.package.startswith("megatron.core.") else None


# Where a fix patches or a gate is read (:meth:`Copy.module`): the copy's buffer module and its
# model module.
BUFFER = ".param_and_grad_buffer"
MODEL = ".megatron_fsdp"


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

    ``fingerprint`` None: recognised by its structure (``structure`` names the test, a key of
    :data:`mfsdp_hotfix.structure.RECOGNISERS`), not by its text.
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


# No copy's hooks are prepared for TransformerEngine's per-layer CUDA graph capture (its forward
# hooks that wrap backward handlers are not tagged for it: NVIDIA/Megatron-LM#4232, open).
TE_GRAPHS = frozenset({"te-partial-cuda-graphs"})
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
              needs=frozenset({"missed-post-backward", "reduce-once", "single-rank-reduce"}),
              carries=TE_GRAPHS),
        # 0.16-0.18 release a stale unit lazily into a pool that does not pin buckets to slots
        # (missed-post-backward); 0.19 pins them.
        *(Shape(name, fingerprint,
                needs=frozenset({"missed-post-backward", "reduce-once", "single-rank-reduce"}),
                carries=TE_GRAPHS)
          for name, fingerprint in (
              ("0.16", "819fea0a1dbddaa5c909b026dd6660a873509886698a31a6d71e785aef76e450"),
              ("0.17", "32fe8ef255b44a394c015edfbcaaf81868496e158c1dc3d32e7dbae0c93ef99c"),
              ("0.18", "049be221636061637620cac833fc943cf6c8eedd59bd4b659d60f278751407fb"))),
        Shape("0.19", "fa95ce6cc803e35c9d0b319da2ef2115c31985aa725592638fbe1a6343079c9d",
              needs=frozenset({"reduce-once", "single-rank-reduce"}), carries=TE_GRAPHS),
        # Forks, snapshots and git trees of 0.16 and later in their own words (the ROCm fork,
        # NVIDIA main), told apart by what their reduction condition yields (structure/hooks.py).
        Shape("releases stale units lazily, reduces unsharded gradients once",
              structure="lazy_and_reduces_unsharded_once",
              needs=frozenset({"single-rank-reduce"}), carries=TE_GRAPHS),
        Shape("releases stale units lazily, reduces unsharded gradients in the hooks always",
              structure="lazy_and_reduces_unsharded_always",
              needs=frozenset({"reduce-once", "single-rank-reduce"}), carries=TE_GRAPHS),
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
# Where each gate above is read from (:meth:`Copy.module`), parsed, not imported. A gate only one
# fix reads may be declared on that fix instead (``Fix.gate_module``, ``Fix.gate_shapes``).
GATE_MODULES = {HOOKS: MODEL, OVERWRITE_SETTER: MODEL, CORE_LINEAR_BACKWARD: CORE_LINEAR_MODULE}
