"""How far two correct runs of one training may differ: the noise floors, per precision.

Megatron-FSDP and Megatron's own DDP order their floating-point sums differently (bucketing,
reduce-scatter against all-reduce, the fused wgrad accumulation), so bit identity is not
expected. A floor is a relative difference ``|candidate - reference| / |reference|`` of a loss or
of the grad norm that two correct runs stay within. It must sit well below the defects the
comparison exists to catch: a lost, doubled or overwritten microbatch share moves the grad norm
by about a quarter with four microbatches, the shipped fused-wgrad defect by 0.5 to 0.6, and the
smallest one measured (``core-linear-accumulate`` left off under ZeRO-1) by 1.6 %.

The first iteration is judged most tightly: both runs start from the same weights and data, so
only reduction order differs. Later iterations start from weights that already differ by the
first update's noise (Adam's first step is about ``lr * sign(g)`` per element, so elements whose
gradient is within noise of zero step apart), and that difference compounds.

This module is the one place these numbers live; ``validation/`` imports ``FLOAT_NOISE``.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOAT_NOISE = 1e-3
"""The fp32 floor of a reported loss or grad norm (and of the GPU validation's verdict).

Reordering a sum of n fp32 terms changes it by at most about n·2^-24 relative to the sum of
magnitudes; the longest sum of the validation's runs is a weight gradient over one iteration's
tokens (4 microbatches × 2 sequences × 512 tokens = 4096 terms), a bound of 4096 · 6e-8 ≈ 2.4e-4,
and a typical difference far below (√n·2^-24 ≈ 4e-6). Measured against Megatron's DDP on one
H100 in fp32 (docs/validation/megatron-lm-ddp-summary.json): at most 1.2e-5 for the TE GPT,
2e-4 for the MoE over 3 iterations, 7e-5 to 9e-5 with two fake ranks. 1e-3 lies 5× above the
largest measurement and 16× below the smallest defect (1.6 %)."""

FP32_LATER = 5e-3
"""fp32 after the first iteration: the first update's noise compounds (see the module's
docstring); 2e-4 was measured by iteration 3. 5e-3 leaves 25× room for longer runs and stays
3× below 1.6 %; a defect present from the start is caught by the first iteration's floor."""


@dataclass(frozen=True)
class Floor:
    """The relative floors of one precision and where they come from."""

    precision: str
    first: float
    later: float
    measured: str | None
    reason: str

    def at(self, first_iteration: bool) -> float:
        return self.first if first_iteration else self.later


_PROVISIONAL = ("provisional until measured on the GPU against Megatron's DDP "
                "(validation/parity_gpu records the measurement that replaces it)")

FLOORS: dict[str, Floor] = {
    "fp32": Floor("fp32", FLOAT_NOISE, FP32_LATER, "docs/validation/megatron-lm-ddp-summary.json",
                  "fp32 sums reordered: at most 2e-4 measured, bound 2.4e-4 for 4096-term sums"),
    "bf16": Floor("bf16", 5e-3, 2e-2, None,
                  "bf16 keeps 8 mantissa bits (unit roundoff 2^-9 = 2e-3 per element) and "
                  "Megatron-FSDP may hold gradients in bf16 where DDP holds fp32; the first "
                  "iteration stays 3× below 1.6 %; " + _PROVISIONAL),
    "fp16": Floor("fp16", 5e-3, 2e-2, None,
                  "fp16 keeps 11 mantissa bits but loss scaling and bf16-like reductions; "
                  "taken as bf16's; " + _PROVISIONAL),
    "fp8": Floor("fp8", 5e-3, 3e-2, None,
                 "the first iteration casts the same weights and data to fp8 on both sides, so "
                 "only the (bf16/fp32) reductions differ, as in bf16; later the amax histories "
                 "part; " + _PROVISIONAL),
}
