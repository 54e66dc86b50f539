"""Why gradients differ from the reference when microbatches are accumulated (docs/ACCUMULATION.md).

The experiment behind the configuration matrix's control rows: the real library on CPU (gloo,
2 ranks; 4 for HSDP), ``fsdp_double_buffer=False`` (the double buffer is not involved), the
hotfix off, each case run under both accumulation protocols (``mfsdp_hotfix.selftest.protocol``)
and compared with the plain PyTorch reference (the sum over microbatches of the mean over ranks,
added in the order the release adds). Each case varies one thing against a baseline so that the
outcome names its cause:

* ``linear``: ``emulated`` is TransformerEngine's fused wgrad accumulation (the weight's
  ``main_grad`` written in backward, overwritten when the release sets
  ``overwrite_main_grad``); ``unfused`` sends the same weights through autograd and the
  release's own accumulation. A fused-only difference is the fused path's.
* ``grad_reduce``: ``scale-then-sum`` (``gradient_reduce_div_fusion=False``) or
  ``premul-sum`` (the release's default, NCCL's PREMUL_SUM emulated on gloo).
* ``microbatches`` 1 (nothing accumulated: a control) to 4.
* the release: one per era (megatron-fsdp 0.4.0, 0.5.1, 0.6.1; megatron-core 0.19.2 ships
  0.6.1's files) and NVIDIA main (a clone of Megatron-LM, ``MFSDP_TEST_MEGATRON_LM``).

``CASES`` is the committed grid (``docs/accumulation.json``, rewritten with
``MFSDP_WRITE_ACCUMULATION=1``); ``CI_CASES`` the few that CI reruns and compares with the record.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import releases

from mfsdp_hotfix.selftest.protocol import AUTO_SYNC, MEGATRON_LM
from mfsdp_hotfix.selftest.runner import run_case
from mfsdp_hotfix.selftest.spec import CaseSpec

RECORD = releases.REPO / "docs" / "accumulation.json"

# Names of what was found (docs/ACCUMULATION.md), used by the configuration matrix too.
ZERO1_OVERWRITE = "zero1-fused-wgrad-overwrite"
REDUCED_TWICE = "unsharded-grads-reduced-twice"
AUTO_SYNC_ACCUMULATION = "auto-sync-accumulation"
# The hotfix's fix for each release cause.
REPAIRED_BY = {ZERO1_OVERWRITE: "zero1-accumulate", REDUCED_TWICE: "reduce-once"}
CAUSES = {
    ZERO1_OVERWRITE: "release: zero1-fused-wgrad-overwrite (megatron-fsdp sets "
                     "overwrite_main_grad for ZeRO-1 too, so each microbatch's fused wgrad "
                     "overwrites the accumulated gradient; fixed upstream by "
                     "NVIDIA/Megatron-LM #6357)",
    REDUCED_TWICE: "release: unsharded-grads-reduced-twice (with overlap_grad_reduce=False the "
                   "backward hooks reduce ZeRO-1's / no_shard's buffer on the last microbatch "
                   "and finish_grad_sync reduces it again; fixed upstream by NVIDIA/Megatron-LM "
                   "#6357)",
    AUTO_SYNC_ACCUMULATION: "harness: auto-sync-accumulation (sync_model_each_microbatch=True "
                            "reduces ZeRO-1's buffer / HSDP's DP-Outer after every microbatch "
                            "in place; the release warns that the buffer must then be zeroed "
                            "every microbatch: it does not accumulate; Megatron-LM's protocol "
                            "does not do this)",
}

STRATEGIES = {"no_shard": {"strategy": "no_shard"},
              "zero1": {"strategy": "optim"}, "zero2": {"strategy": "optim_grads"},
              "zero3": {"strategy": "optim_grads_params"},
              "hsdp": {"strategy": "optim_grads_params", "world": 4, "outer": 2}}


@dataclass(frozen=True)
class Case:
    release: str  # "0.6.1" (a megatron-fsdp wheel) or "git:main"
    layout: str  # a key of STRATEGIES
    protocol: str
    linear: str = "emulated"
    grad_reduce: str = "scale-then-sum"
    microbatches: int = 2
    grad_comm_dtype: str | None = None
    overlap_grad_reduce: bool = True
    hotfix: str = "off"

    @property
    def id(self) -> str:
        bits = [self.release, self.layout, self.protocol, self.linear, self.grad_reduce,
                f"{self.microbatches}mb"] + ([self.grad_comm_dtype] if self.grad_comm_dtype
                                             else [])
        bits += ([] if self.overlap_grad_reduce else ["no-overlap"]) + (
            [] if self.hotfix == "off" else [f"hotfix-{self.hotfix}"])
        return "/".join(bits)

    def spec(self) -> CaseSpec:
        path = (releases.git_tree(self.release[4:]) if self.release.startswith("git:")
                else releases.unpacked("megatron-fsdp", self.release))
        return CaseSpec(flavour="standalone", path=str(path) if path else None,
                        hotfix=self.hotfix, double_buffer=False, units=6,
                        protocol=self.protocol, linear=self.linear,
                        grad_reduce=self.grad_reduce, microbatches=self.microbatches,
                        grad_comm_dtype=self.grad_comm_dtype,
                        overlap_grad_reduce=self.overlap_grad_reduce, **STRATEGIES[self.layout])


def _grid() -> tuple[Case, ...]:
    cases: list[Case] = []
    both = (MEGATRON_LM, AUTO_SYNC)
    for layout in [layout for layout in STRATEGIES if layout != "no_shard"]:
        linears = ("emulated", "unfused") if layout in ("zero1", "hsdp") else ("emulated",)
        for protocol in both:
            for linear in linears:
                for grad_reduce in ("scale-then-sum", "premul-sum"):
                    cases.append(Case("0.6.1", layout, protocol, linear, grad_reduce))
    for layout in ("zero1", "hsdp"):  # how it grows with the number of microbatches
        for protocol in both:
            cases += [Case("0.6.1", layout, protocol, microbatches=n) for n in (1, 3, 4)]
    for layout in ("zero1", "hsdp", "zero3"):  # reduced in bfloat16
        for protocol in both:
            cases.append(Case("0.6.1", layout, protocol, grad_comm_dtype="bfloat16"))
    for release in ("0.4.0", "0.5.1", "git:main"):  # one release per era, and NVIDIA main
        for layout in ("zero1", "hsdp", "zero3"):
            for protocol in both:
                cases.append(Case(release, layout, protocol))
        cases.append(Case(release, "zero1", MEGATRON_LM, "unfused"))
    # Unsharded gradients without overlap_grad_reduce, as shipped (NVIDIA main: the control;
    # no_shard with the SUM reduction of calculate_per_token_loss, "per-token", and averaging)
    for release in ("0.3.1", "0.4.0", "0.6.1", "git:main"):
        cases += [Case(release, "zero1", MEGATRON_LM, linear, microbatches=n,
                       overlap_grad_reduce=False)
                  for linear in ("emulated", "unfused") for n in (1, 2)
                  if release == "0.6.1" or (linear, n) == ("emulated", 2)]
        cases += [Case(release, "no_shard", MEGATRON_LM, grad_reduce=grad_reduce,
                       overlap_grad_reduce=False)
                  for grad_reduce in ("per-token", "scale-then-sum")
                  if release == "0.6.1" or grad_reduce == "per-token"]
    # ... and with the hotfix: ZeRO-1 and no_shard (SUM), overlap on and off, 1 and 2
    # microbatches, fused and plain, both protocols, on 0.6.1; overlap off on 0.3.1, 0.4.0 and
    # 0.5.1 (megatron-core 0.16-0.18 ship the same files).
    for layout, grad_reduce in (("zero1", "scale-then-sum"), ("no_shard", "per-token")):
        for overlap in (True, False):
            cases += [Case("0.6.1", layout, protocol, linear, grad_reduce, n,
                           overlap_grad_reduce=overlap, hotfix="on")
                      for protocol, linear, n in ((MEGATRON_LM, "emulated", 1),
                                                  (MEGATRON_LM, "emulated", 2),
                                                  (MEGATRON_LM, "unfused", 1),
                                                  (MEGATRON_LM, "unfused", 2),
                                                  (AUTO_SYNC, "emulated", 1),
                                                  (AUTO_SYNC, "unfused", 1))]
            cases += [Case(release, layout, MEGATRON_LM, "emulated", grad_reduce,
                           overlap_grad_reduce=False, hotfix="on")
                      for release in ("0.3.1", "0.4.0", "0.5.1") if not overlap]
    return tuple(cases)


CASES = _grid()
# What CI reruns (a few minutes on 2 cores): each cause and its control, on 0.6.1 and main.
CI_CASES = tuple(
    Case(release, layout, protocol, linear)
    for release, layout, protocol, linear in (
        ("0.6.1", "zero1", MEGATRON_LM, "emulated"), ("0.6.1", "zero1", MEGATRON_LM, "unfused"),
        ("0.6.1", "zero1", AUTO_SYNC, "unfused"), ("0.6.1", "hsdp", MEGATRON_LM, "emulated"),
        ("0.6.1", "hsdp", AUTO_SYNC, "emulated"), ("git:main", "zero1", MEGATRON_LM, "emulated")))

# Four ranks: the reduce-scatter adds four terms in another order than the reference.
FOUR_RANKS = 1e-6
BF16_RELATIVE = 2.0 ** -6  # as in configurations.py


def equal(case: Case, run: dict[str, Any]) -> bool:
    if run["crashed"] or run["max_abs_grad_error"] is None:
        return False
    if case.grad_comm_dtype:
        return bool(run["max_rel_grad_error"] <= BF16_RELATIVE)
    tolerance = 0.0 if STRATEGIES[case.layout].get("world", 2) == 2 else FOUR_RANKS
    return bool(run["max_abs_grad_error"] <= tolerance)


def causes(case: Case, grads_equal: bool) -> list[str]:
    """What a run whose gradients differ from the reference is explained by (empty when they
    are equal). The rule is the finding; ``test_accumulation`` checks it against the controls
    (the unfused twin, one microbatch, NVIDIA main, the other protocol)."""
    if grads_equal:
        return []
    found = []
    shipped = case.release != "git:main" and case.hotfix == "off"
    if (shipped and case.layout == "zero1" and case.linear == "emulated"
            and case.microbatches > 1):
        found.append(ZERO1_OVERWRITE)
    if shipped and case.layout in ("zero1", "no_shard") and not case.overlap_grad_reduce:
        found.append(REDUCED_TWICE)
    if (case.protocol == AUTO_SYNC and case.layout in ("zero1", "no_shard", "hsdp")
            and case.microbatches > 1):
        found.append(AUTO_SYNC_ACCUMULATION)
    return found


def significant(value: float | None, digits: int = 3) -> float | None:
    """An error magnitude as recorded: 3 significant digits (the last digits of a wrong
    gradient vary between machines; whether it is wrong does not)."""
    return None if value is None else float(f"{value:.{digits}g}")


def measure(case: Case) -> dict[str, Any]:
    result = run_case(case.spec())
    fused = [name for name in result.worst_grads if ".fc" in name]
    run = {"crashed": result.crashed, "exception": (result.exception or "")[:200] or None,
           "max_abs_grad_error": significant(result.max_abs_grad_error),
           "max_rel_grad_error": significant(result.max_rel_grad_error),
           "worst_is_fused_weight": bool(fused) and fused[0] == next(iter(result.worst_grads))}
    run["grads_equal"] = equal(case, {**run, "max_abs_grad_error": result.max_abs_grad_error,
                                      "max_rel_grad_error": result.max_rel_grad_error})
    run["cause"] = causes(case, run["grads_equal"])
    return {"case": asdict(case), **run}


def load_record() -> dict[str, Any]:
    return dict(json.loads(RECORD.read_text())) if RECORD.exists() else {}
