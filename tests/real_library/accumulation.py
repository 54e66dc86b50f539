"""Why gradients differ from the reference when microbatches are accumulated (docs/ACCUMULATION.md).

The experiment behind the configuration matrix's control rows, grown into a row for every
gradient claim about accumulation: the real library on CPU (gloo), ``fsdp_double_buffer=False``
(the double buffer is not involved), each case run under both accumulation protocols
(``mfsdp_hotfix.selftest.protocol``) and compared with the plain PyTorch reference (the sum over
microbatches of the mean over ranks, added in the order the release adds), never with a run of
the code under test. Each case varies one thing against a baseline so that the outcome names
its cause:

* ``layout``: the strategy and the ranks (``STRATEGIES``): two ranks, one rank (``-world1``),
  two ranks with an expert layer whose data-parallel group has one rank (``-expert``), HSDP on
  four ranks over ZeRO-1/2/3.
* ``linear``: ``emulated`` is TransformerEngine's fused wgrad accumulation (the weight's
  ``main_grad`` written in backward, overwritten when the release sets
  ``overwrite_main_grad``); ``unfused`` sends the same weights through autograd and the
  release's own accumulation. A fused-only difference is the fused path's.
* ``grad_reduce``: ``scale-then-sum`` (``gradient_reduce_div_fusion=False``),
  ``premul-sum`` (the release's default, NCCL's PREMUL_SUM emulated on gloo) or ``per-token``.
* ``microbatches`` 1 (nothing accumulated: a control) to 4; ``overlap_grad_reduce``.
* the release: every release family (``FAMILIES``) and NVIDIA main (a clone of Megatron-LM,
  ``MFSDP_TEST_MEGATRON_LM``); ``hotfix`` off (the release) and on (its fixes).

``CASES`` is the committed grid (``docs/accumulation.json``, rewritten with
``MFSDP_WRITE_ACCUMULATION=1``); ``CI_CASES`` the few that CI reruns and compares with the record.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
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
SINGLE_RANK = "single-rank-grads-reduced-every-microbatch"
SELF_ADD = "unsharded-shard-added-to-itself"
SHARD_SCALED = "scale-then-sum-scales-the-shard"
OUTER_SKIPPED = "hsdp-outer-reduce-skipped-without-overlap"
# The hotfix's fix for each release cause.
REPAIRED_BY = {ZERO1_OVERWRITE: "zero1-accumulate", REDUCED_TWICE: "reduce-once",
               SINGLE_RANK: "single-rank-reduce"}
# What the hotfix leaves: the release defects it neither repairs nor refuses in these rows
# (docs/ACCUMULATION.md, "What users should do"); a fix or refusal for one of them must take it
# off this list. None is left: SHARD_SCALED is refused when a model is built with
# gradient_reduce_div_fusion=False, and when that option is set on the built model's config, as
# this harness does (selftest/wrapping.py), the step is stopped at its first gradient
# synchronisation; the auto-sync protocol's in-place reduction is stopped too (auto-sync-stop,
# single-rank-reduce).
UNREPAIRED: set[str] = set()
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
    SINGLE_RANK: "release: single-rank-grads-reduced-every-microbatch (a gradient buffer whose "
                 "data-parallel group has one rank, ZeRO-2/3: one rank in all, or the experts "
                 "when expert-parallel equals data-parallel; the buffer is not distributed, so "
                 "each microbatch's reduction works on the accumulated buffer itself: fused "
                 "wgrad overwrites it, and the experts' 1/data-parallel scale is applied to it "
                 "again at every microbatch; fixed upstream by NVIDIA/Megatron-LM #6773)",
    SELF_ADD: "release: unsharded-shard-added-to-itself (megatron-fsdp 0.3.x, megatron-core "
              "0.16: the gradient reduction adds the reduced bucket to the rank's shard "
              "unconditionally; under ZeRO-1 the buffer is not distributed and the shard is "
              "the bucket, so the gradients are doubled, with one microbatch too; a ZeRO-2/3 "
              "buffer of one rank doubles alike, counted as "
              "single-rank-grads-reduced-every-microbatch)",
    OUTER_SKIPPED: "release: hsdp-outer-reduce-skipped-without-overlap (HSDP over ZeRO-1 with "
                   "overlap_grad_reduce=False: finish_grad_sync's synchronous reduction "
                   "reduces over DP-Shard only, and DP-Outer's all-reduce lives in the backward "
                   "hooks' pipeline; where the hooks do not reduce without overlap, as on NVIDIA "
                   "main (#6357) and with reduce-once, DP-Outer is never reduced)",
    SHARD_SCALED: "release: scale-then-sum-scales-the-shard (megatron-fsdp 0.1.0-0.2.3, "
                  "megatron-core 0.14-0.15: with gradient_reduce_div_fusion=False the scale "
                  "1/data-parallel size is applied to the rank's accumulated shard instead of "
                  "the bucket reduced, so gradients come out data-parallel size times too "
                  "large; docs/OLDEST_RELEASES.md)",
}

ZERO = {"zero1": "optim", "zero2": "optim_grads", "zero3": "optim_grads_params"}
# A layout: the strategy and the ranks. "hsdp" is HSDP over ZeRO-3 (DP-Outer 2 x DP-Shard 2),
# "hsdp-zeroN" over another inner strategy; "-world1" one rank (every group has one rank);
# "-expert" two ranks whose last two units are an MoE layer's experts with expert-parallel =
# data-parallel (their data-parallel group has one rank).
STRATEGIES: dict[str, dict[str, Any]] = {
    "no_shard": {"strategy": "no_shard"},
    "zero1": {"strategy": "optim"}, "zero2": {"strategy": "optim_grads"},
    "zero3": {"strategy": "optim_grads_params"},
    "hsdp": {"strategy": "optim_grads_params", "world": 4, "outer": 2},
    "hsdp-zero1": {"strategy": "optim", "world": 4, "outer": 2},
    "hsdp-zero2": {"strategy": "optim_grads", "world": 4, "outer": 2},
    "zero1-world1": {"strategy": "optim", "world": 1},
    "zero2-world1": {"strategy": "optim_grads", "world": 1},
    "zero3-world1": {"strategy": "optim_grads_params", "world": 1},
    "zero1-expert": {"strategy": "optim", "experts": 2},
    "zero2-expert": {"strategy": "optim_grads", "experts": 2},
    "zero3-expert": {"strategy": "optim_grads_params", "experts": 2},
    # HSDP on two ranks: DP-Outer 2 x a DP-Shard group of one rank
    "hsdp1-no_shard": {"strategy": "no_shard", "world": 2, "outer": 2},
    "hsdp1-zero1": {"strategy": "optim", "world": 2, "outer": 2},
    "hsdp1-zero3": {"strategy": "optim_grads_params", "world": 2, "outer": 2},
}


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
    # the model's layout and the double buffer (the grid keeps the defaults; the never-worse
    # search, search.py, draws them): CaseSpec's fields of the same names
    double_buffer: bool = False
    units: int = 6
    norm: str = "pre"
    outside: str = ""
    head: bool = True

    @property
    def id(self) -> str:
        bits = [self.release, self.layout, self.protocol, self.linear, self.grad_reduce,
                f"{self.microbatches}mb"] + ([self.grad_comm_dtype] if self.grad_comm_dtype
                                             else [])
        bits += ([] if self.overlap_grad_reduce else ["no-overlap"])
        bits += (["double-buffer"] if self.double_buffer else []) + (
            [f"{self.units}units"] if self.units != 6 else []) + (
            [f"{self.norm}-norm"] if self.norm != "pre" else []) + (
            [f"outside-{self.outside}"] if self.outside else []) + (
            [] if self.head else ["no-head"])
        bits += [] if self.hotfix == "off" else [f"hotfix-{self.hotfix}"]
        return "/".join(bits)

    def spec(self) -> CaseSpec:
        path = (releases.git_tree(self.release[4:]) if self.release.startswith("git:")
                else releases.unpacked("megatron-fsdp", self.release))
        return CaseSpec(flavour="standalone", path=str(path) if path else None,
                        hotfix=self.hotfix, double_buffer=self.double_buffer, units=self.units,
                        norm=self.norm, outside=self.outside, head=self.head,
                        protocol=self.protocol, linear=self.linear,
                        grad_reduce=self.grad_reduce, microbatches=self.microbatches,
                        grad_comm_dtype=self.grad_comm_dtype,
                        overlap_grad_reduce=self.overlap_grad_reduce, **STRATEGIES[self.layout])


def _grid() -> tuple[Case, ...]:
    cases: list[Case] = []
    both = (MEGATRON_LM, AUTO_SYNC)
    for layout in ("zero1", "zero2", "zero3", "hsdp"):
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
    # Model auto-sync all-reduces no_shard's buffer at every microbatch: a SUM (per-token) adds
    # the microbatches already reduced again, an average gives them back (auto-sync-stop stops
    # the first only; Megatron-LM's protocol: the control).
    for release in ("0.3.1", "0.6.1", "git:main"):
        cases += [Case(release, "no_shard", AUTO_SYNC, "emulated", grad_reduce, hotfix=hotfix)
                  for grad_reduce in ("per-token", "scale-then-sum", "premul-sum")
                  for hotfix in HOTFIX]
        cases.append(Case(release, "no_shard", MEGATRON_LM, "emulated", "per-token"))
    return tuple(cases + _size_one_grid() + _hsdp_grid() + _release_families_grid())


# The release families: every megatron-fsdp release of its own code from 0.2.3 on, and NVIDIA
# main. Each megatron-core release named here vendors the same files as that megatron-fsdp
# release (compared file by file); it is not run again.
FAMILIES = ("0.2.3", "0.3.0", "0.3.1", "0.4.0", "0.5.0", "0.5.1", "0.6.0", "0.6.1", "git:main")
SAME_FILES = {"0.2.3": "megatron-core 0.15.3", "0.3.1": "megatron-core 0.16.1",
              "0.4.0": "megatron-core 0.17.1", "0.5.1": "megatron-core 0.18.2",
              "0.6.1": "megatron-core 0.19.2"}
HOTFIX = ("off", "on")


def _size_one_grid() -> list[Case]:
    """Groups of one rank: one rank in all (``-world1``), or an expert layer's data-parallel
    group (``-expert``). On 0.6.1 every ZeRO stage, 1, 2 and 4 microbatches, fused and plain,
    both protocols; on every other release family ZeRO-1 and ZeRO-3 at one rank, 1 and 2
    microbatches, and ZeRO-3 with experts, 1 and 2 microbatches (megatron-fsdp 0.2.3 has no
    expert mesh option: one row, which cannot run)."""
    cases: list[Case] = []
    for layout in [f"{zero}-{kind}" for kind in ("world1", "expert") for zero in ZERO]:
        for hotfix in HOTFIX:
            cases += [Case("0.6.1", layout, MEGATRON_LM, microbatches=n, hotfix=hotfix)
                      for n in (1, 2, 4)]
            cases += [Case("0.6.1", layout, MEGATRON_LM, "unfused", hotfix=hotfix),
                      Case("0.6.1", layout, AUTO_SYNC, hotfix=hotfix)]
    for release in [release for release in FAMILIES if release != "0.6.1"]:
        for hotfix in HOTFIX:
            cases += [Case(release, layout, MEGATRON_LM, microbatches=n, hotfix=hotfix)
                      for layout in ("zero1-world1", "zero3-world1") for n in (1, 2)]
            if release in ("0.2.3", "0.3.0", "0.3.1"):  # the buffer added to itself: plain too
                cases.append(Case(release, "zero3-world1", MEGATRON_LM, "unfused",
                                  microbatches=1, hotfix=hotfix))
            if release != "0.2.3":
                cases += [Case(release, "zero3-expert", MEGATRON_LM, microbatches=n,
                               hotfix=hotfix) for n in (1, 2)]
            elif hotfix == "off":
                cases.append(Case(release, "zero3-expert", MEGATRON_LM, hotfix=hotfix))
    return cases


def _hsdp_grid() -> list[Case]:
    """HSDP (DP-Outer 2 x DP-Shard 2) over each inner strategy, with the hotfix off and on: on
    0.6.1 ZeRO-1 with overlap_grad_reduce on and off, both protocols, 1 and 2 microbatches,
    fused and plain, ZeRO-2 and ZeRO-3 under both protocols; on 0.3.1, 0.4.0, 0.5.1 and NVIDIA
    main ZeRO-1 plain without overlap, ZeRO-1 and ZeRO-2 fused with overlap (four ranks a case:
    the slowest rows)."""
    cases: list[Case] = []
    for hotfix in HOTFIX:
        for overlap in (True, False):
            cases += [Case("0.6.1", "hsdp-zero1", protocol, linear, microbatches=n,
                           overlap_grad_reduce=overlap, hotfix=hotfix)
                      for protocol, linear, n in ((MEGATRON_LM, "emulated", 1),
                                                  (MEGATRON_LM, "emulated", 2),
                                                  (AUTO_SYNC, "emulated", 2),
                                                  (MEGATRON_LM, "unfused", 1))]
        cases += [Case("0.6.1", layout, protocol, microbatches=n, hotfix=hotfix)
                  for layout in ("hsdp-zero2", "hsdp")
                  for protocol, n in ((MEGATRON_LM, 1), (MEGATRON_LM, 2), (AUTO_SYNC, 2))
                  if (layout, hotfix) != ("hsdp", "off")]  # those are in the grid above
        for release in ("0.3.1", "0.4.0", "0.5.1", "git:main"):
            cases += [Case(release, "hsdp-zero1", MEGATRON_LM, "unfused", microbatches=1,
                           overlap_grad_reduce=False, hotfix=hotfix),
                      Case(release, "hsdp-zero1", MEGATRON_LM, hotfix=hotfix),
                      Case(release, "hsdp-zero2", MEGATRON_LM, hotfix=hotfix)]
    return cases


def _release_families_grid() -> list[Case]:
    """Two ranks, hotfix off and on: 0.2.3's scale-then-sum reduction (its per-token control),
    ZeRO-1 with one microbatch on 0.2.3 to 0.4.0 (0.3.x adds its unsharded buffer to itself)."""
    cases: list[Case] = []
    for hotfix in HOTFIX:
        cases += [Case("0.2.3", "zero3", MEGATRON_LM, grad_reduce=grad_reduce, microbatches=n,
                       hotfix=hotfix)
                  for grad_reduce in ("scale-then-sum", "per-token") for n in (1, 2)]
        cases.append(Case("0.2.3", "zero1", MEGATRON_LM, grad_reduce="per-token",
                          microbatches=1, hotfix=hotfix))
        cases += [Case(release, "zero1", MEGATRON_LM, linear, microbatches=1, hotfix=hotfix)
                  for release in ("0.3.0", "0.3.1", "0.4.0") for linear in ("emulated", "unfused")]
    return cases


CASES = _grid()
# What CI reruns (a few minutes on 2 cores): each cause and its control, on 0.6.1 and main, and
# the size-one defect at one rank and in an expert layer.
CI_CASES = tuple(
    Case(release, layout, protocol, linear)
    for release, layout, protocol, linear in (
        ("0.6.1", "zero1", MEGATRON_LM, "emulated"), ("0.6.1", "zero1", MEGATRON_LM, "unfused"),
        ("0.6.1", "zero1", AUTO_SYNC, "unfused"), ("0.6.1", "hsdp", MEGATRON_LM, "emulated"),
        ("0.6.1", "hsdp", AUTO_SYNC, "emulated"), ("git:main", "zero1", MEGATRON_LM, "emulated"),
        ("0.6.1", "zero3-world1", MEGATRON_LM, "emulated"),
        ("0.6.1", "zero3-expert", MEGATRON_LM, "emulated")))

# Four ranks (or HSDP): the reductions add the terms in another order than the reference.
FOUR_RANKS = 1e-6
# Experts: each rank's expert weight gradient is one product over every rank's tokens, the
# reference's a sum of one product per rank. A parameter used twice: the same bound.
EXPERTS = 1e-6
# Model auto-sync all-reduces no_shard's buffer at every microbatch: averaging again what every
# rank holds as the same average gives it back, rounded once more.
RE_AVERAGED = 1e-6
BF16_RELATIVE = 2.0 ** -6  # as in configurations.py


def equal(case: Case, run: dict[str, Any]) -> bool:
    if run["crashed"] or run["max_abs_grad_error"] is None:
        return False
    if case.grad_comm_dtype:
        return bool(run["max_rel_grad_error"] <= BF16_RELATIVE)
    layout = STRATEGIES[case.layout]
    tolerance = (FOUR_RANKS if layout.get("world", 2) == 4 or layout.get("outer", 1) > 1
                 else EXPERTS if layout.get("experts") or _used_twice(case)
                 else RE_AVERAGED if _re_averaged(case) else 0.0)
    return bool(run["max_abs_grad_error"] <= tolerance)


def _re_averaged(case: Case) -> bool:
    """Model auto-sync averages no_shard's buffer again at every microbatch: right, but for
    rounding (no ``AUTO_SYNC_ACCUMULATION``; the bound ``RE_AVERAGED``)."""
    return (case.protocol == AUTO_SYNC and case.microbatches > 1
            and STRATEGIES[case.layout]["strategy"] == "no_shard"
            and case.grad_reduce != "per-token")


def _used_twice(case: Case) -> bool:
    """The root's gain is used before and after the units: autograd adds its two
    contributions in an order the reference's (a loss summed over ranks) need not share."""
    return {"root-before", "root-after"} <= set(case.outside.split("+"))


def _release(case: Case) -> tuple[int, ...]:
    """A release's place in time; NVIDIA main after every release."""
    return (99,) if case.release.startswith("git:") else tuple(
        int(part) for part in case.release.split("."))


def present(case: Case) -> list[str]:
    """The defects (and harness causes) this configuration has on its release, whether or not
    the hotfix repairs them. The rule is the finding; ``test_accumulation`` checks it against
    the controls (the unfused twin, one microbatch, NVIDIA main, the other protocol, the hotfix).
    """
    layout = STRATEGIES[case.layout]
    strategy, world = layout["strategy"], layout.get("world", 2)
    size_one = world == 1 or bool(layout.get("experts"))
    release = _release(case)
    released = not case.release.startswith("git:")
    several = case.microbatches > 1
    found = []
    if (released and release >= (0, 2, 0) and strategy == "optim" and case.linear == "emulated"
            and several):
        found.append(ZERO1_OVERWRITE)
    if released and world > 1 and not case.overlap_grad_reduce and (
            (strategy == "optim" and release >= (0, 3, 0))
            or (strategy == "no_shard" and release >= (0, 5, 0)
                and case.grad_reduce == "per-token")):  # a second average changes nothing
        found.append(REDUCED_TWICE)
    if (case.protocol == AUTO_SYNC and several and world > 1 and not _re_averaged(case)
            and (strategy in ("optim", "no_shard") or world == 4 or layout.get("experts"))):
        found.append(AUTO_SYNC_ACCUMULATION)  # an unsharded buffer reduced (scaled) in place
    doubles = (0, 3, 0) <= release < (0, 4, 0)  # adds the reduced bucket onto itself
    if size_one and strategy != "optim" and (
            doubles or (several and (case.linear == "emulated" or layout.get("experts")))):
        found.append(SINGLE_RANK)
    if doubles and strategy == "optim":
        found.append(SELF_ADD)
    if release < (0, 3, 0) and case.grad_reduce == "scale-then-sum" and world > 1:
        found.append(SHARD_SCALED)
    return found


def causes(case: Case, grads_equal: bool, applied: list[str] | None = None) -> list[str]:
    """What a run whose gradients differ from the reference is explained by (empty when they
    are equal): its defects (:func:`present`) but those whose fix the hotfix applied in that run
    (``applied``, ``REPAIRED_BY``)."""
    if grads_equal:
        return []
    found = [cause for cause in present(case) if REPAIRED_BY.get(cause) not in (applied or [])]
    layout = STRATEGIES[case.layout]
    if (layout["strategy"] == "optim" and layout.get("outer", 1) > 1
            and not case.overlap_grad_reduce
            and (case.release.startswith("git:") or "reduce-once" in (applied or []))):
        found.append(OUTER_SKIPPED)
    return found


def applied_fixes(result: Any) -> list[str]:
    """The fixes the hotfix reports as applied in a run (none with the hotfix off)."""
    status = result.hotfix_status if isinstance(result.hotfix_status, dict) else {}
    return sorted({fix for copy in status.get("copies") or []
                   for fix, state in (copy.get("fixes") or {}).items()
                   if state.get("state") == "applied"})


def significant(value: float | None, digits: int = 3) -> float | None:
    """An error magnitude as recorded: 3 significant digits (the last digits of a wrong
    gradient vary between machines; whether it is wrong does not)."""
    return None if value is None else float(f"{value:.{digits}g}")


# How a row ends: the gradients equal the reference, or differ (each with its causes); or it
# never trained: the hotfix refused the configuration before training (its message recorded),
# or the release lacks an option the configuration needs (the harness names it).
EXACT, WRONG, REFUSED, CANNOT_RUN = "exact", "wrong", "refused", "cannot-run"
REFUSAL = "UnsupportedConfiguration: "
NO_OPTION = "TypeError: this release's fully_shard_model has no option "


def outcome(run: dict[str, Any]) -> str:
    if not run["crashed"]:
        return EXACT if run["grads_equal"] else WRONG
    message = run["exception"] or ""
    if message.startswith(REFUSAL):
        return REFUSED
    if message.startswith(NO_OPTION):
        return CANNOT_RUN
    return "crashed"


def without_cache(text: str) -> str:
    """``text`` with this machine's release cache named ``<cache>``: a record is the same
    wherever it was measured."""
    return text.replace(str(releases.CACHE), "<cache>")


def measure(case: Case, timeout_s: float | None = None) -> dict[str, Any]:
    """One run of ``case`` as recorded (``timeout_s``: a case's limit other than the spec's)."""
    spec = case.spec()
    result = run_case(spec if timeout_s is None else replace(spec, timeout_s=timeout_s))
    fused = [name for name in result.worst_grads if ".fc" in name]
    run = {"crashed": result.crashed, "exception": without_cache((result.exception or "")[:600])
           or None,
           "max_abs_grad_error": significant(result.max_abs_grad_error),
           "max_rel_grad_error": significant(result.max_rel_grad_error),
           "worst_is_fused_weight": bool(fused) and fused[0] == next(iter(result.worst_grads))}
    run["grads_equal"] = equal(case, {**run, "max_abs_grad_error": result.max_abs_grad_error,
                                      "max_rel_grad_error": result.max_rel_grad_error})
    run["outcome"] = outcome(run)
    run["fixes_applied"] = applied_fixes(result)
    run["cause"] = (causes(case, run["grads_equal"], run["fixes_applied"])
                    if run["outcome"] == WRONG else [])
    return {"case": asdict(case), **run}


def load_record() -> dict[str, Any]:
    return dict(json.loads(RECORD.read_text())) if RECORD.exists() else {}
