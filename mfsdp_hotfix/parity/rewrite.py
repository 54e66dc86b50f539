"""The reference run's command: the user's Megatron-LM flags rewritten to Megatron's own DDP.

One table, ``FSDP_ONLY``, says for every flag that exists only for Megatron-FSDP (or for
PyTorch FSDP2) in any megatron-core release from 0.14 to 0.19 and NVIDIA main what the
reference does with it, and why (a test reads each release's own ``arguments.py`` and fails on
an FSDP flag missing here). ``KEPT`` names the flags whose help mentions FSDP but which Megatron's
DDP takes as well. The reference then adds ``REFERENCE_ADDS``: the distributed optimizer (so
that the optimizer step is sharded over the data-parallel ranks as Megatron-FSDP's is) and
fused wgrad accumulation off (the path a reference must not share with the candidate). The
parallel layout, seed and data flags are the user's, untouched."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from . import flags

REFERENCE = "the reference"
EVERY_RUN = "every run"


@dataclass(frozen=True)
class Rule:
    """What a run does with a flag: drops it (with its ``values`` words) or, with
    ``replace``, keeps the flag with each listed value replaced; ``runs`` says which runs."""

    values: int
    reason: str
    runs: str = REFERENCE
    replace: dict[str, str] = field(default_factory=dict)


_SHARDING = "Megatron-FSDP's sharding; Megatron's DDP shards only the optimizer (distributed " \
            "optimizer, added)"
_FSDP_BUFFERS = "Megatron-FSDP's communication buffers; DDP has its own"
_FSDP_DTYPE = "Megatron-FSDP's main-parameter/gradient/communication dtype; DDP keeps fp32 " \
              "main gradients (its default), the reference the comparison's floor assumes"

FSDP_ONLY: dict[str, Rule] = {
    "--use-megatron-fsdp": Rule(0, "selects Megatron-FSDP: the reference is Megatron's DDP"),
    "--use-custom-fsdp": Rule(0, "the older name of --use-megatron-fsdp (megatron-core 0.13 "
                                 "and earlier)"),
    "--megatron-fsdp-version": Rule(1, "picks Megatron-FSDP's implementation"),
    "--data-parallel-sharding-strategy": Rule(1, _SHARDING),
    "--outer-dp-sharding-strategy": Rule(1, "Megatron-FSDP's HSDP outer sharding; the "
                                            "reference replicates over those ranks"),
    "--enable-full-sharding-in-hsdp": Rule(0, "Megatron-FSDP's HSDP mode"),
    "--fsdp-double-buffer": Rule(0, _FSDP_BUFFERS),
    "--megatron-fsdp-max-pool-double-buffer": Rule(0, _FSDP_BUFFERS),
    "--fsdp-db-use-persist-buf-on-alloc-fail": Rule(0, _FSDP_BUFFERS),
    "--fsdp-manual-registration": Rule(0, "registers Megatron-FSDP's buffers with NCCL "
                                          "(asserts --use-megatron-fsdp)"),
    "--suggested-communication-unit-size": Rule(1, "Megatron-FSDP's all-gather/reduce-scatter "
                                                   "unit size"),
    "--megatron-fsdp-enable-fine-grained-param-gather": Rule(
        0, "Megatron-FSDP's parameter all-gather granularity"),
    "--keep-fp8-transpose-cache": Rule(0, "Megatron-FSDP's fp8 transpose cache (used by "
                                          "Megatron-FSDP only)"),
    "--megatron-fsdp-main-params-dtype": Rule(1, _FSDP_DTYPE),
    "--megatron-fsdp-main-grads-dtype": Rule(1, _FSDP_DTYPE),
    "--megatron-fsdp-grad-comm-dtype": Rule(1, _FSDP_DTYPE),
    "--no-strict-fsdp-dtensor-load": Rule(0, "loading of fsdp_dtensor checkpoints only"),
    "--ckpt-format": Rule(1, "fsdp_dtensor is Megatron-FSDP's checkpoint format (its "
                             "releases assert it); the reference uses torch_dist, Megatron's "
                             "default. Other formats are kept",
                          replace={"fsdp_dtensor": "torch_dist"}),
    "--init-model-with-meta-device": Rule(
        0, "meta-device initialisation works only under FSDP; it is dropped from the "
           "candidate too, so that both runs initialise their weights the same way (the first "
           "iteration's loss is then a pure check of the same weights on the same data)",
        runs=EVERY_RUN),
    "--use-torch-fsdp2": Rule(0, "PyTorch FSDP2, not Megatron's DDP (parity's candidate is "
                                 "meant to be Megatron-FSDP)"),
    "--torch-fsdp2-no-reshard-after-forward": Rule(0, "PyTorch FSDP2 only"),
}

# Flags whose help mentions FSDP that Megatron's DDP takes too: kept as the user gave them.
KEPT: dict[str, str] = {
    "--use-nccl-ub": "NCCL user buffers for DP and FSDP communication alike",
    "--dist-ckpt-strictness": "how a checkpoint load treats key mismatches, for every format",
    "--overlap-dispatch-backward-with-experts-wgrad": "MoE expert wgrad scheduling, under DDP "
                                                      "and FSDP alike",
}

REFERENCE_ADDS: dict[str, str] = {
    "--use-distributed-optimizer": "the optimizer state sharded over the data-parallel ranks, "
                                   "as Megatron-FSDP shards it",
    "--no-gradient-accumulation-fusion": "wgrad accumulated by autograd into .grad and copied "
                                         "to main_grad, not fused into main_grad: a different "
                                         "path from the one the hotfix repairs",
}


def applies(rule: Rule, reference: bool) -> bool:
    return reference or rule.runs == EVERY_RUN


def rewrite(args: Sequence[str], reference: bool) -> tuple[list[str], list[str]]:
    """``args`` for the reference (``reference``) or for the candidate: every rule of
    ``FSDP_ONLY`` that applies, then (reference) ``REFERENCE_ADDS``. Returns the new args and
    one note per change ("dropped --fsdp-double-buffer: why")."""
    out, notes = list(args), []
    for flag, rule in FSDP_ONLY.items():
        if not applies(rule, reference) or not flags.has(out, flag):
            continue
        if rule.replace:
            value = flags.value_of(out, flag)
            if value in rule.replace:
                out = flags.replace_value(out, flag, rule.replace[value])
                notes.append(f"{flag} {value} -> {rule.replace[value]}: {rule.reason}")
            continue
        out, removed = flags.remove(out, flag, rule.values)
        notes.append(f"dropped {' '.join(removed)}: {rule.reason}")
    if reference:
        for flag, reason in REFERENCE_ADDS.items():
            if not flags.has(out, flag):
                out.append(flag)
                notes.append(f"added {flag}: {reason}")
    return out, notes
