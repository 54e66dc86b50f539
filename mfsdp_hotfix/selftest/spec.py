"""What one selftest case is, and what it found (plain data, JSON-friendly, no torch).

Why a separate module: the user's process (CLI, pytest) builds and reads these without importing
torch or megatron; only the worker processes run them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from mfsdp_hotfix.selftest.protocol import DEFAULT as DEFAULT_PROTOCOL

FLAVOURS = ("auto", "standalone", "core")
ZERO_STAGE = {"optim": 1, "optim_grads": 2, "optim_grads_params": 3}
HOTFIX_MODES = ("on", "off")
GRAD_REDUCES = ("scale-then-sum", "per-token", "premul-sum")
# The selftest command's reduction: "scale-then-sum", but "per-token" on a copy whose
# scale-then-sum reduction is wrong (sharded-grads-summed-unscaled, megatron-fsdp 0.1.0-0.2.3 /
# megatron-core 0.14-0.15), which the hotfix refuses instead of repairing; each worker decides
# from the copy it imported and reports which it ran (CaseResult.grad_reduce).
BY_COPY = "by-copy"


@dataclass
class CaseSpec:
    """One run: which Megatron-FSDP copy, which configuration, and whether the hotfix is loaded.

    ``hotfix``: "on" imports ``mfsdp_hotfix`` before the release (nothing else); "off" does the
    same with ``MFSDP_HOTFIX=0`` (the product's kill switch), which is how a user turns it off;
    "late" builds the model first and installs the hotfix afterwards (a late import).
    ``disabled_fixes`` goes to ``MFSDP_HOTFIX_DISABLED_FIXES`` (negative controls).
    ``path``: a folder put first on the workers' ``sys.path`` (an unpacked release), or None for
    whatever is importable.
    ``grad_reduce``: how the mean over ranks is formed, gloo having no PREMUL_SUM.
    "scale-then-sum": the release multiplies by 1/world size, then reduces with SUM
    (``gradient_reduce_div_fusion=False``).  "per-token": ``calculate_per_token_loss=True``, so
    the release only sums, and each rank's loss carries the 1/world size (exact: a power of two).
    megatron-fsdp 0.1.0-0.2.3 / megatron-core 0.14-0.15 need "per-token": their scale-then-sum
    path scales the local shard instead of the bucket it reduces (see docs/OLDEST_RELEASES.md).
    "premul-sum": the release's default ``gradient_reduce_div_fusion=True``, with NCCL's
    PREMUL_SUM emulated on gloo (``premul``): the buffer reduced is not scaled in place.
    ``BY_COPY``: one of the first two, chosen by the copy (the selftest command's).
    ``protocol``: how the microbatches of a step are driven (``protocol.PROTOCOLS``):
    "megatron-lm" (``no_sync()`` around all but the last) or "auto-sync" (fully_shard's default).
    ``audit``: run the workers with ``MFSDP_HOTFIX_AUDIT`` set, so that the audit's counts can be
    compared with the stand-in's.
    ``options``: further ``fully_shard_model`` keywords (``maxpool_double_buffer``,
    ``fsdp_db_use_persist_buf_on_alloc_fail``, ...); a release without one of them fails the
    case instead of silently running another configuration.
    ``wide_units``: that many units (the first ones) get a 4x instead of 2x inner width, so they
    are not symmetric to the others and a ``FixedPoolAllocator`` gives them no pool slot (its
    fallback: the backup allocator, or a persistent buffer).
    ``world``/``outer``: ranks, and the size of HSDP's DP-Outer dimension (1: plain FSDP over
    all ranks; more: a (outer, world/outer) mesh, DP-Outer replicated).
    ``overlap_grad_reduce``: the ``fully_shard_model`` option (its default, True: gradients
    reduced in the backward hooks; False: ZeRO-1 and no_shard reduce synchronously in
    ``finish_grad_sync``; the releases force it on for ZeRO-2/3).
    ``grad_comm_dtype``: ``MixedPrecisionPolicy(grad_comm_dtype=...)`` (e.g. "bfloat16"): the
    gradients are reduced in that dtype, in buckets of its own (with HSDP, from the
    ``hsdp_grad_comm`` pool too).
    ``experts``: that many units, the last ones, hold their MLP as an MoE layer's experts with
    expert-parallel equal to data-parallel, as megatron-core lays it out: the expert parameters
    are marked as megatron-core marks them and ``fully_shard_model`` gets an expert device mesh
    whose data-parallel dimension has one rank (``expt_device_mesh``; a release without it fails
    the case). Every rank's expert sees every rank's tokens (``model.Experts``), so the
    reference is the same mean over ranks as for the other parameters. Not with HSDP.
    ``norm``: where each unit's LayerNorm sits ("pre": before its MLP, "post": after the
    residual). ``outside``: parameters outside every FSDP unit (``model.OUTSIDE_PARTS`` joined by
    "+": a root-level linear before or after the units, a final norm, a parameter of the root
    module itself). ``head`` False: the model has no parameter-free module registered last
    (where Megatron-FSDP hangs a root pre-backward hook).
    """

    flavour: str = "auto"
    path: str | None = None
    hotfix: str = "on"
    disabled_fixes: str = ""
    double_buffer: bool = True
    strategy: str = "optim_grads_params"
    grad_reduce: str = "scale-then-sum"
    python: str | None = None  # interpreter of the workers (another torch); None: this one
    linear: str = "emulated"
    units: int = 5
    hidden: int = 16
    tokens: int = 8
    microbatches: int = 2
    iterations: int = 2
    lr: float = 0.1  # SGD step after each iteration (0: none)
    seed: int = 1234
    dtype: str = "float32"
    timeout_s: float = 240.0
    audit: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    wide_units: int = 0
    world: int = 2
    outer: int = 1
    grad_comm_dtype: str | None = None
    protocol: str = DEFAULT_PROTOCOL
    overlap_grad_reduce: bool = True
    experts: int = 0
    norm: str = "pre"
    outside: str = ""
    head: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CaseSpec:
        return cls(**json.loads(text))

    def label(self, hotfix_state: bool = True) -> str:
        """Plain words for progress lines and failed assertions (``hotfix_state``: with the
        hotfix's state, which the selftest's runs differ in)."""
        copy = {"auto": "the Megatron-FSDP copy importable here",
                "standalone": "megatron-fsdp", "core": "megatron-core's vendored copy"}
        hotfix = {"on": "hotfix on", "off": "hotfix off (MFSDP_HOTFIX=0)",
                  "late": "hotfix loaded after the model was built"}
        bits = [copy.get(self.flavour, self.flavour) + (f" from {self.path}" if self.path else "")]
        if hotfix_state:
            bits.append(hotfix.get(self.hotfix, self.hotfix))
        if self.disabled_fixes:
            bits.append(f"fixes disabled: {self.disabled_fixes}")
        bits.append(f"ZeRO-{ZERO_STAGE.get(self.strategy, self.strategy)}")
        bits.append("double buffer" if self.double_buffer else "no double buffer")
        bits.append(f"{self.units} units, {self.microbatches} microbatch(es), "
                    f"{self.protocol} protocol")
        if not self.overlap_grad_reduce:
            bits.append("overlap_grad_reduce=False")
        if self.grad_reduce == BY_COPY:
            bits.append("grad reduce scale-then-sum (per-token on a copy with "
                        "sharded-grads-summed-unscaled)")
        elif self.grad_reduce != "scale-then-sum":
            bits.append(f"grad reduce {self.grad_reduce}")
        if self.linear != "emulated":
            bits.append(f"linear={self.linear}")
        if self.options:
            bits.append(", ".join(f"{k}={v}" for k, v in sorted(self.options.items())))
        if self.wide_units:
            bits.append(f"{self.wide_units} wide unit(s)")
        if self.world != 2 or self.outer != 1:
            bits.append(f"{self.world} rank{'' if self.world == 1 else 's'}"
                        + (f", HSDP outer {self.outer}" if self.outer != 1 else ""))
        if self.grad_comm_dtype:
            bits.append(f"gradients reduced in {self.grad_comm_dtype}")
        if self.experts:
            bits.append(f"{self.experts} expert unit(s), expert-parallel = data-parallel")
        if self.norm != "pre":
            bits.append(f"{self.norm}-norm units")
        if self.outside:
            bits.append(f"parameters outside the units: {self.outside}")
        if not self.head:
            bits.append("no parameter-free head")
        if self.audit:
            bits.append("audit on")
        return ", ".join(bits)


@dataclass
class CaseResult:
    """What the two ranks reported, merged (rank 0 compares the grads with the reference)."""

    spec: CaseSpec
    crashed: bool = True
    exception: str | None = None
    traceback: str | None = None
    grads_compared: int = 0  # gradient tensors rank 0 compared with the reference, all iterations
    max_abs_grad_error: float | None = None  # None: crashed, or nothing compared
    max_rel_grad_error: float | None = None
    grad_digest: str | None = None
    worst_grads: dict[str, float] = field(default_factory=dict)
    ordering_checks: int | None = None
    ordering_violations: int | None = None
    first_violations: list[dict[str, Any]] = field(default_factory=list)
    # the audit's view (spec.audit), summed over ranks and copies; None: no rank reported one
    audit_reuses: int | None = None
    audit_unordered: int | None = None
    audit_crashed: bool | None = None
    audit_state: str | None = None  # "on", or why it was disabled / not armed
    audit_files: int = 0  # rank files found after the run
    audit_verdict: str | None = None  # what `mfsdp-hotfix audit` says of those files
    audit_report: dict[str, Any] | None = None  # the first rank file, as written
    wall_s: float = 0.0
    worker_s: float | None = None  # slowest rank, imports included
    fsdp_s: float | None = None  # slowest rank, training loop only (wrap to last gather)
    release: dict[str, Any] = field(default_factory=dict)
    grad_reduce: str | None = None  # the reduction the workers ran (BY_COPY: which they chose)
    hotfix_status: Any = None
    hotfix_import_error: str | None = None
    # the copy asked for could not be imported: {"module": the missing one or None, "error"}
    cannot_import: dict[str, Any] | None = None
    attempts: int = 1
    returncodes: list[int | None] = field(default_factory=list)
    log_tail: str = ""

    def grads_match(self, tolerance: float) -> bool:
        return (not self.crashed and self.max_abs_grad_error is not None
                and self.max_abs_grad_error <= tolerance)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
