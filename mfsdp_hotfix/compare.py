"""The one comparison of a run with its serialized truth: exact means bit-identical.

A run is a list of steps, each a mapping from a tensor's name to the tensor observed at that step
(gradients, losses, final parameters). ``exact`` needs all of: the same number of steps, at least
one step and one element compared, the same names at every step, the same shape and dtype, the
same bits (so ``-0.0`` differs from ``0.0``), and no NaN or Inf on either side (identical NaN bits
do not make a NaN right). Anything else is ``wrong`` with the reasons in ``why``. Used by the
selftest (CPU and GPU) and by ``validation/``; torch is imported only when tensors are compared.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_REASONS = 8


@dataclass
class Comparison:
    """What was compared and how it came out. ``max_abs`` and ``rel_l2`` cover the pairs of the
    same shape and are None when none was compared or a difference is not finite."""

    steps: int = 0  # steps present in both runs
    tensors: int = 0  # name pairs compared, over all steps
    elements: int = 0
    max_abs: float | None = None
    rel_l2: float | None = None
    diff_sq: float | None = None  # squared L2 norms (float64) behind rel_l2, for sums over ranks
    ref_sq: float | None = None
    first_bad_step: int | None = None
    differing: list[str] = field(default_factory=list)  # names not bit-identical at some step
    why: list[str] = field(default_factory=list)  # empty when exact
    more_reasons: int = 0  # reasons beyond the first MAX_REASONS

    @property
    def exact(self) -> bool:
        return not self.why

    @property
    def outcome(self) -> str:
        return "exact" if self.exact else "wrong"

    def to_dict(self) -> dict[str, Any]:
        """The record form (the keys ``validation/`` has always written, plus the counts)."""
        return {"outcome": self.outcome, "steps_compared": self.steps,
                "tensors_compared": self.tensors, "elements_compared": self.elements,
                "max_abs_diff": self.max_abs, "rel_l2": self.rel_l2,
                "first_bad_step": self.first_bad_step, "differing": list(self.differing),
                "not_exact_because": list(self.why) + (
                    [f"... and {self.more_reasons} more"] if self.more_reasons else [])}

    def _fail(self, step: int | None, reason: str, name: str | None = None) -> None:
        if step is not None and (self.first_bad_step is None or step < self.first_bad_step):
            self.first_bad_step = step
        if name is not None and name not in self.differing:
            self.differing.append(name)
        if len(self.why) < MAX_REASONS:
            self.why.append(reason)
        else:
            self.more_reasons += 1


def compare(got: Sequence[Mapping[str, Any]], want: Sequence[Mapping[str, Any]]) -> Comparison:
    """Compare ``got`` (the run) with ``want`` (its serialized truth), step by step."""
    result = Comparison(steps=min(len(got), len(want)))
    if len(got) != len(want):
        result._fail(result.steps, f"the run has {len(got)} steps, its truth {len(want)}")
    diff_sq, ref_sq, finite = 0.0, 0.0, True
    for step, (run_step, truth_step) in enumerate(zip(got, want, strict=False)):
        for name in sorted(set(run_step) | set(truth_step)):
            if name not in truth_step:
                result._fail(step, f"step {step}: {name} is not in the truth", name)
                continue
            if name not in run_step:
                result._fail(step, f"step {step}: {name} is missing from the run", name)
                continue
            pair = _compare_tensors(run_step[name], truth_step[name])
            result.tensors += 1
            if pair.numel is not None:
                result.elements += pair.numel
                if pair.max_abs is None:
                    finite = False
                else:
                    result.max_abs = max(result.max_abs or 0.0, pair.max_abs)
                    diff_sq += pair.diff_sq
                    ref_sq += pair.ref_sq
            for reason in pair.why:
                result._fail(step, f"step {step}: {name}: {reason}", name)
    if not result.steps:
        result._fail(None, "no step compared")
    elif not result.elements and not result.why:
        result._fail(None, "no element compared")
    if not finite or result.max_abs is None:
        result.max_abs = None
        return result
    result.diff_sq, result.ref_sq = diff_sq, ref_sq
    if ref_sq > 0:
        result.rel_l2 = (diff_sq ** 0.5) / (ref_sq ** 0.5)
    elif diff_sq == 0:
        result.rel_l2 = 0.0
    return result


@dataclass
class _Pair:
    why: list[str]
    numel: int | None = None  # None: shapes differ, no elementwise difference
    max_abs: float | None = None  # None: a difference is not finite
    diff_sq: float = 0.0
    ref_sq: float = 0.0


def _compare_tensors(got: Any, want: Any) -> _Pair:
    import torch

    pair = _Pair(why=[])
    if tuple(got.shape) != tuple(want.shape):
        pair.why.append(f"shape {tuple(got.shape)} vs {tuple(want.shape)} in the truth")
        return pair
    if got.dtype != want.dtype:
        pair.why.append(f"dtype {got.dtype} vs {want.dtype} in the truth")
    got = got.detach().reshape(-1).cpu()
    want = want.detach().reshape(-1).cpu()
    for side, tensor in (("run", got), ("truth", want)):
        if tensor.is_floating_point() or tensor.is_complex():
            nans = int(torch.isnan(tensor).sum())
            infs = int(torch.isinf(tensor).sum())
            if nans:
                pair.why.append(f"{nans} NaN in the {side}")
            if infs:
                pair.why.append(f"{infs} Inf in the {side}")
    if got.dtype == want.dtype:
        differ = int((_bytes(got) != _bytes(want)).any(dim=1).sum())
        if differ:
            pair.why.append(f"{differ} of {got.numel()} elements differ in their bits")
    pair.numel = int(got.numel())
    diff = got.double() - want.double()
    if pair.numel:
        worst = float(diff.abs().max())
        if worst == worst and worst != float("inf"):
            pair.max_abs = worst
            pair.diff_sq = float(diff.square().sum())
            pair.ref_sq = float(want.double().square().sum())
    else:
        pair.max_abs = 0.0
    return pair


def _bytes(t: Any) -> Any:
    """One row of raw bytes per element."""
    import torch

    return t.contiguous().view(torch.uint8).reshape(t.numel(), t.element_size())
