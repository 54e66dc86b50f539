"""What ``selftest --gpu`` runs and what each run found (plain data, JSON-friendly, no torch).

Why a module of its own: the driver (in the user's process) plans and judges runs without
importing torch; the worker processes (``gpu_worker``) read the same :class:`GpuRun`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from mfsdp_hotfix.selftest.protocol import DEFAULT as DEFAULT_PROTOCOL

VARIANTS = ("shipped", "hotfix")  # MFSDP_HOTFIX=0, and the hotfix on
LAYERS = ("auto", "te-layernorm-mlp", "te-linear", "emulated")
LAYER_LABELS = {
    "te-layernorm-mlp": "te.LayerNormMLP (TransformerEngine, fuse_wgrad_accumulation=True)",
    "te-linear": "te.Linear (TransformerEngine, fuse_wgrad_accumulation=True)",
    "emulated": "emulated fused wgrad (TransformerEngine's contract, in PyTorch)",
}
ZERO_STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass
class GpuRun:
    """One run: a variant, asynchronous or serialized (``CUDA_LAUNCH_BLOCKING=1``: the truth).

    ``fake``: one GPU, one process holding a fake 2-rank group with NCCL work semantics;
    otherwise ``ranks`` processes (one per GPU) over NCCL, started by torchrun.
    ``protocol``: how each step's microbatches are driven (``protocol.PROTOCOLS``).

    Why these numbers: ``units`` 6 identical units share the double buffer's two slots, so each
    backward reuses a slot four times; ``hidden`` 1024 and ``tokens`` 2048 make a unit's
    backward about 34 GFLOP (``te.LayerNormMLP(1024, 2048)``), about a millisecond in fp32 on an
    H100 or H200, so a ``delay_ms`` of 20 keeps each reduce-scatter running through the next
    units' backward with a wide margin (the delay, not the model, makes the race likely); 4
    ``steps`` of 2 ``microbatches`` are what every recorded run used (docs/USAGE.md); fewer
    steps were not measured, and would leave the audit fewer reuses to count. The runs spend
    most of their time starting, not training: see ``gpu_turns``.
    """

    variant: str
    serialized: bool
    layer: str
    flavour: str = "auto"
    fake: bool = True
    ranks: int = 2
    zero: int = 3
    delay_ms: float = 20.0
    dtype: str = "fp32"
    units: int = 6
    hidden: int = 1024
    tokens: int = 2048
    steps: int = 4
    microbatches: int = 2
    seed: int = 1234
    timeout_s: float = 300.0
    protocol: str = DEFAULT_PROTOCOL

    @property
    def name(self) -> str:
        return self.variant + (" serialized" if self.serialized else "")

    @property
    def key(self) -> str:
        """File-name form of :attr:`name`."""
        return self.name.replace(" ", "-")

    @property
    def processes(self) -> int:
        return 1 if self.fake else self.ranks

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GpuRun:
        return cls(**json.loads(text))


@dataclass
class GpuRunResult:
    """What the processes of one run reported, merged over ranks."""

    run: GpuRun
    crashed: bool = True
    timed_out: bool = False
    exception: str | None = None
    traceback: str | None = None
    compared: bool = False  # the grads were compared with the serialized run's
    exact: bool | None = None  # bit-identical to the serialized run (None: not compared)
    steps_compared: int = 0  # fewest steps compared on a rank
    tensors_compared: int = 0  # over steps and ranks
    not_exact_because: list[str] = field(default_factory=list)
    max_abs: float | None = None  # None: not compared, or a difference is not finite
    rel_l2: float | None = None
    reports: int = 0  # rank reports found
    audit_state: str | None = None  # "on", why it was disabled, or None: no rank file
    audit_files: int = 0
    audit_reuses: int | None = None
    audit_unordered: int | None = None
    audit_crashed: bool | None = None
    rs_calls: int = 0
    rs_delayed: int = 0
    delay_cycles: int | None = None
    cycles_per_ms: float | None = None
    release: dict[str, Any] = field(default_factory=dict)
    te_version: str | None = None
    gpu: str | None = None
    hotfix: str | None = None  # mfsdp_hotfix.summary() in the run
    wall_s: float = 0.0  # from the start of the runs to this run's end
    prepare_s: float | None = None  # its start, to the model sharded (slowest rank)
    turn_s: float | None = None  # its turn on the GPU: calibration, training, gradients read
    returncodes: list[int | None] = field(default_factory=list)
    log_tail: str = ""

    def outcome(self) -> str:
        """``crash``, ``wrong``, ``exact``, or ``no truth`` (nothing to compare with)."""
        if self.crashed:
            return "crash"
        if self.run.serialized:
            return "ran"
        if not self.compared or self.exact is None:
            return "no truth"
        return "exact" if self.exact else "wrong"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["outcome"] = self.outcome()
        data["name"] = self.run.name
        return data


def merge(run: GpuRun, reports: list[dict[str, Any] | None],
          audit_files: list[dict[str, Any]], codes: list[int | None], timed_out: bool,
          log_tail: str = "") -> GpuRunResult:
    """One run's result from its rank reports (``None``: a rank wrote none) and audit files."""
    result = GpuRunResult(run=run, timed_out=timed_out, returncodes=list(codes),
                          log_tail=log_tail[-6000:])
    present = [r for r in reports if r is not None]
    result.reports = len(present)
    result.crashed = (timed_out or len(present) < run.processes
                      or any(r.get("crashed", True) for r in present))
    for report in present:
        if report.get("exception") and not result.exception:
            result.exception = str(report["exception"])
            result.traceback = report.get("traceback")
    if result.crashed and not result.exception:
        result.exception = (f"timed out after {run.timeout_s:.0f}s" if timed_out else
                            f"{run.processes - len(present)} rank(s) reported nothing "
                            f"(exit codes {codes})")
    compared = [r for r in present if r.get("compared")]
    result.compared = bool(present) and len(compared) == len(present)
    if result.compared:
        result.exact = all(bool(r["exact"]) for r in compared)
        result.steps_compared = min(int(r.get("steps_compared", 0)) for r in compared)
        result.tensors_compared = sum(int(r.get("tensors_compared", 0)) for r in compared)
        result.not_exact_because = [why for r in compared
                                    for why in r.get("not_exact_because") or []]
        if all(r.get("max_abs") is not None for r in compared):  # None: a difference not finite
            result.max_abs = max(float(r["max_abs"]) for r in compared)
            diff = sum(float(r["diff_sq"]) for r in compared)
            ref = sum(float(r["ref_sq"]) for r in compared)
            result.rel_l2 = (diff ** 0.5) / (ref ** 0.5) if ref > 0 else (
                0.0 if diff == 0 else float("inf"))
    first = present[0] if present else {}
    result.release = dict(first.get("release") or {})
    result.te_version = first.get("te_version")
    result.gpu = first.get("gpu")
    result.hotfix = first.get("hotfix")
    result.cycles_per_ms = first.get("cycles_per_ms")
    result.delay_cycles = first.get("delay_cycles")
    for name in ("prepare_s", "turn_s"):
        times = [float(r[name]) for r in present if r.get(name) is not None]
        setattr(result, name, max(times) if times else None)
    result.rs_calls = sum(int(r.get("rs_calls", 0)) for r in present)
    result.rs_delayed = sum(int(r.get("rs_delayed", 0)) for r in present)
    if audit_files:
        copies = [c for f in audit_files for c in f.get("copies", [])]
        result.audit_files = len(audit_files)
        result.audit_reuses = sum(int(c.get("reuses", 0)) for c in copies)
        result.audit_unordered = sum(int(c.get("unordered", 0)) for c in copies)
        result.audit_crashed = any(bool(c.get("crashed")) for c in copies)
        result.audit_state = "; ".join(sorted({str(f.get("audit")) for f in audit_files}))
    return result

