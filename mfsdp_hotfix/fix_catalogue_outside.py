"""The fixes of release defects outside Megatron-FSDP's gradient buffer and its reductions, each
whole in one entry as in ``fix_catalogue.py`` (which lists them with the others): megatron-core's
TE op-fuser experts, ``fully_shard_optimizer``'s warm-up step, the root module's own hooks,
and no_shard's gradient statistics."""

from __future__ import annotations

import sys

from .defects import ReleaseDefect
from .fix_type import Fix, OnFailure
from .limits import Limit, has_one_rank_gradient_group, sharded
from .registry import MODEL, Shape

EXPERTS_MODULE = "megatron.core.transformer.moe.experts"
ENSURE_MAIN_GRAD = "TEGroupedMLP._ensure_main_grad"
EXPERT_UPSTREAM = ("not fixed upstream as of megatron-core 0.19.2 and NVIDIA main d98e8a64dd "
                   "(NVIDIA/Megatron-LM#6773 does not touch transformer/moe/experts.py)")
MOE_OP_FUSER_WGRAD_OVERWRITE = ReleaseDefect(
    "moe-op-fuser-wgrad-overwrite",
    "expert-accumulate",
    {"megatron-core": "0.19.0-0.19.2"},
    "any megatron-core tree whose TEGroupedMLP._ensure_main_grad sets "
    "param.overwrite_main_grad = True (NVIDIA main as of d98e8a64dd, forks based on those "
    "releases)",
    "MoE experts through TransformerEngine's op fuser (--use-transformer-engine-op-fuser "
    "--moe-grouped-gemm, TransformerEngine >= 2.14, expert tensor-parallel 1, SwiGLU, "
    "quick-GeGLU or weighted squared-ReLU with its fusion on) with fused wgrad accumulation and "
    "2 or more microbatches per step, where Megatron-FSDP says to add into main_grad: ZeRO-1 "
    "(with zero1-accumulate or NVIDIA/Megatron-LM#6357), and ZeRO-2/3 experts whose expert "
    "data-parallel group has one rank (with single-rank-reduce)",
    "silently wrong gradients: the experts' fused pre-forward hook sets overwrite_main_grad = "
    "True on every expert weight after Megatron-FSDP's own hooks have decided it, so "
    "TransformerEngine's GroupedLinear op overwrites main_grad and the step keeps only the last "
    "microbatch's expert weight gradients",
    ("the experts without the op fuser (no --use-transformer-engine-op-fuser)",
     "ZeRO-2 or ZeRO-3 with an expert data-parallel group of 2 or more ranks",
     "one microbatch per optimizer step"),
    EXPERT_UPSTREAM,
    "",
)


def _op_fused_experts(model: object) -> bool:
    """Whether the module a built ``MegatronFSDP`` wraps holds a ``TEGroupedMLP`` running
    through TransformerEngine's op fuser (none where megatron-core's experts are not imported)."""
    experts = sys.modules.get(EXPERTS_MODULE)
    grouped = getattr(experts, "TEGroupedMLP", None)
    return grouped is not None and any(
        isinstance(child, grouped) and getattr(child, "_with_fused_impl", True)
        for child in model.module.modules())  # type: ignore[attr-defined]


EXPERT_ACCUMULATE = Fix(
    "expert-accumulate",
    "MoE experts through TransformerEngine's op fuser keep the overwrite_main_grad Megatron-FSDP "
    "decided for its parameters: TEGroupedMLP._ensure_main_grad no longer sets it True on them, "
    "so their fused wgrad adds into main_grad where Megatron-FSDP says to",
    "expert_accumulate", EXPERTS_MODULE,
    "no TEGroupedMLP._ensure_main_grad in this copy's tree (a copy outside megatron-core, or a "
    "release before 0.19 whose experts never name overwrite_main_grad), or it leaves "
    "overwrite_main_grad alone",
    EXPERT_UPSTREAM,
    gate=ENSURE_MAIN_GRAD, gate_module=EXPERTS_MODULE,
    gate_shapes=(
        # megatron-core 0.19.0-0.19.2 and NVIDIA main d98e8a64dd: one text.
        Shape("0.19", "3e5cfbcb62e44febfb3b8eac5094a8078a631b55ff4d792aac9226092cb18980",
              needs=frozenset({"expert-accumulate"})),
        Shape("sets overwrite_main_grad = True", structure="always_overwrites_main_grad",
              needs=frozenset({"expert-accumulate"})),
        Shape("leaves overwrite_main_grad", structure="leaves_overwrite_main_grad",
              note="leaves Megatron-FSDP's overwrite_main_grad alone")),
    gate_absent_unless_named="overwrite_main_grad",
    defect=MOE_OP_FUSER_WGRAD_OVERWRITE,
    limits=(Limit("ZeRO-1 (optim), or ZeRO-2/3 with a one-rank gradient group, with MoE "
                  "experts through TransformerEngine's op fuser (TEGroupedMLP, "
                  "use_transformer_engine_op_fuser)",
                  lambda model: ((model.ddp_config.data_parallel_sharding_strategy == "optim"
                                  or (sharded(model) and has_one_rank_gradient_group(model)))
                                 and _op_fused_experts(model)),
                  MOE_OP_FUSER_WGRAD_OVERWRITE.symptom + ", with 2 or more microbatches per step",
                  " or ".join(MOE_OP_FUSER_WGRAD_OVERWRITE.workarounds)),),
    on_failure=OnFailure.STOP,
    stop_because="let the experts' fused wgrad overwrite the gradients of every later "
                 "microbatch",
)

WARM_UP_UPSTREAM = "NVIDIA/Megatron-LM#5976 (on main; in no release as of megatron-fsdp 0.6.1)"
OPTIMIZER_WARM_UP_STEP = ReleaseDefect(
    "optimizer-warm-up-step",
    "inert-warm-up",
    {"megatron-fsdp": "0.4.0-0.6.1", "megatron-core": "0.17.0-0.19.2"},
    "any copy whose fully_shard_optimizer steps on zero gradients to build the state",
    "fully_shard_optimizer (fully_shard with an optimizer calls it; Megatron-LM does not) with "
    "Adam, AdamW, weight decay or dampened momentum",
    "silently wrong first steps: Adam counts the warm-up as a step (the first real update is "
    "too small), AdamW's decay shrinks the weights once at wrapping, coupled decay moves them",
    ("optimizer.state.clear() right after fully_shard_optimizer, where no checkpoint is loaded",),
    WARM_UP_UPSTREAM,
    "another optimizer than torch.optim.Adam, AdamW, SGD: its state is left (a warning says so)",
)
INERT_WARM_UP = Fix(
    "inert-warm-up",
    "fully_shard_optimizer's warm-up step leaves the parameters and the optimizer state as if "
    "no step had run (Adam, AdamW: step 0, zero moments; SGD: a fresh momentum buffer)",
    "inert_warm_up", ".fully_shard",
    "its fully_shard_optimizer takes no step before training", WARM_UP_UPSTREAM,
    gate="fully_shard_optimizer", gate_module=".fully_shard",
    gate_shapes=tuple(Shape(name, fingerprint, needs=frozenset({"inert-warm-up"})
                            if name == "0.17" else frozenset(),
                            note="builds no optimizer state before training")
                      for name, fingerprint in (
        ("0.14", "3b783e63bad30b7c5610099fc5f0bb4a42c1ea331c7bd5215cc79dbb21f56564"),
        ("0.15.2", "cf371f305d4cce13f476e2a22a9feb173fb85fbf71b48e613e52b7c45c82ddd8"),
        ("0.17", "a77e8003065c75851e0f92a2cc0ecbcbd48275ef51fbca50b6da44f6d60400ac"))),
    defect=OPTIMIZER_WARM_UP_STEP,
    on_failure=OnFailure.STOP,
    stop_because="train from weights and optimizer state a zero-gradient step has moved",
)

ROOT_FORWARD = "MegatronFSDP.forward"  # calls the root module past its hooks, or through them
ROOT_HOOKS_SKIPPED = ReleaseDefect(
    "root-hooks-skipped",
    "root-forward-hooks",
    {"megatron-fsdp": "0.1.0-0.5.1", "megatron-core": "0.14.0-0.18.2"},
    "any copy whose MegatronFSDP.forward calls self.module.forward(...) (git installs of NVIDIA "
    "main before NVIDIA/Megatron-LM#5808, forks based on those releases)",
    "a wrapped module that owns a parameter itself (not through a child) and uses it in "
    "forward, with ZeRO-1, ZeRO-2 or ZeRO-3; and a model whose module registered last is not "
    "the last to run in forward: no parameter-free module registered after everything else, "
    "e.g. a model ending in a pre-norm block, or a root-level linear or norm outside every "
    "FSDP unit registered after the units but run before them (any strategy, number of ranks "
    "and microbatches)",
    "the root's own hooks are skipped. Its pre-forward hook does not gather the parameters the "
    "root owns: with ZeRO-3 the root's forward reads freed storage (SIGSEGV), with ZeRO-1/2 a "
    "copy not synchronised after the optimizer step (silently wrong outputs and gradients). "
    "The root pre-backward hook, hung on the module registered last instead of the root, fires "
    "in the middle of backward and marks every gradient as still to be handled: the gradients "
    "of the modules that ran backward before it are handled and reduced again (silently wrong "
    "gradients; 'Found 2 out of 3 parameters ... pipeline is being reset'; gloo timeouts; with "
    "the double buffer unzeroed slot contents or 'No buffer found for bucket_id')",
    ("register a parameter-free module last, run last (e.g. an nn.Identity head applied to "
     "the output), and keep no parameter on the root module itself (move it into a child "
     "module)",
     "megatron-fsdp >= 0.6.0 / megatron-core >= 0.19.0"),
    "NVIDIA/Megatron-LM#5808 (for #5789), first released in megatron-core 0.19.0 / "
    "megatron-fsdp 0.6.0",
    "",
)


def root_hooks_matter(model: object) -> bool:
    """Whether the root module of ``model`` (a built ``MegatronFSDP``) owns parameters, or its
    module registered last has parameters (so may not be the last to run in forward): where the
    release's forward leaves the root's own parameters ungathered, or its root pre-backward
    hook, hung on that module, can fire in the middle of backward."""
    root = model.module  # type: ignore[attr-defined]
    last = list(root.modules())[-1]
    return any(True for _ in root.parameters(recurse=False)) or any(
        True for _ in last.parameters())


ROOT_FORWARD_HOOKS = Fix(
    "root-forward-hooks",
    "MegatronFSDP.forward calls the root module through its hooks, so the parameters the root "
    "owns are gathered before its forward and the root pre-backward hook fires first in "
    "backward, not when the module registered last runs backward",
    "root_forward_hooks", MODEL,
    "its MegatronFSDP.forward calls the root module through its hooks "
    "(NVIDIA/Megatron-LM#5808)",
    ROOT_HOOKS_SKIPPED.upstream,
    gate=ROOT_FORWARD, gate_module=MODEL,
    # megatron-fsdp 0.1.0-0.5.1 / megatron-core 0.14-0.18 call self.module.forward(...);
    # 0.6.0 / 0.19.0 call self.module(...) (NVIDIA/Megatron-LM#5808).
    gate_shapes=(
        Shape("0.14", "f8429a53bd8e0357dfbbbc7775f24000af02638f0387024f887d0123a4f81ac7",
              needs=frozenset({"root-forward-hooks"})),
        Shape("0.19", "cf59d8b762cca4bac814453d482817c4b17f3eefc715b1df46a1f92b3e12959d",
              note="calls the root module through its hooks")),
    defect=ROOT_HOOKS_SKIPPED,
    limits=(Limit("a root module that owns parameters, or whose module registered last has "
                  "parameters (it may not be the last to run in forward)",
                  root_hooks_matter, ROOT_HOOKS_SKIPPED.symptom,
                  " or ".join(ROOT_HOOKS_SKIPPED.workarounds)),),
)

OPTIMIZER_MODULE = "megatron.core.optimizer"
NO_SHARD_GRAD_NORM = ReleaseDefect(
    "no-shard-grad-norm-counts-every-rank",
    "replicated-grad-stats",
    {"megatron-core": "0.14.0-0.17.1"},
    "any megatron-core whose get_megatron_optimizer reduces no_shard statistics over data-parallel",
    "no_shard over 2 or more data-parallel ranks through get_megatron_optimizer (Megatron-LM)",
    "silently wrong clipping and logged norm: the norm counts the whole gradient once per "
    "data-parallel rank (sqrt(data-parallel size) too large); the gradients are right",
    ("ZeRO-1 (optim)", "no gradient clipping (clip_grad=0)"),
    "fixed in megatron-core 0.18.0", "",
)
REPLICATED_GRAD_STATS = Fix(
    "replicated-grad-stats",
    "a no_shard Megatron-FSDP model's distributed optimizer reduces its gradient statistics "
    "(the norm clipping uses, the count of zeros) over the model-parallel group only",
    "replicated_grad_stats", OPTIMIZER_MODULE,
    "no megatron-core optimizer is in this copy's tree, or it reduces no_shard statistics over "
    "the model-parallel group (megatron-core 0.18.0)",
    "fixed in megatron-core 0.18.0",
    gate="get_megatron_optimizer", gate_module=OPTIMIZER_MODULE,
    gate_shapes=tuple(Shape(name, fingerprint, needs=frozenset({"replicated-grad-stats"})
                            if name < "0.18" else frozenset(),
                            note="reduces a no_shard model's statistics over model-parallel")
                      for name, fingerprint in (
        ("0.14", "e26ebb3600a0811a1dc09c498385fc696fbd4ee3d304e65998d7674fd660c3eb"),
        ("0.15", "89ba442f310e9d0c0a75c5258bd8b3bd07c91ebda8ee9f2811170e0856b8a1b8"),
        ("0.16", "1c55a4d52b46df034c69f6d93f0950fe7b61009ac4d96908d71f8136237c44b6"),
        ("0.18", "d690247555e130a2653aa6781ff43b5d1a1a907022e78c2acdc350f960eb7097"),
        ("0.19", "2ef243e15a2168de13bca0bbeb5f21f40add5556c738138f06f5334188d8ae2b"))),
    defect=NO_SHARD_GRAD_NORM,
    limits=(Limit("no_shard over 2 or more data-parallel ranks",
                  lambda model: (model.ddp_config.data_parallel_sharding_strategy == "no_shard"
                                 and not has_one_rank_gradient_group(model)),
                  NO_SHARD_GRAD_NORM.symptom, " or ".join(NO_SHARD_GRAD_NORM.workarounds)),),
    on_failure=OnFailure.STOP,
    stop_because="clip every step by a norm sqrt(data-parallel size) too large",
)


OUTSIDE_THE_BUFFER = (EXPERT_ACCUMULATE, INERT_WARM_UP, ROOT_FORWARD_HOOKS, REPLICATED_GRAD_STATS)
