"""Two runs of one training compared iteration by iteration: MATCH, MISMATCH or CANNOT COMPARE.

Every loss both runs report and the grad norm are compared at every iteration both report,
against the floor of the run's precision (``floors``): most tightly at the first iteration,
where both runs hold the same weights and data. A printed value is rounded: the true value lies
within half a unit of its last digit, so a metric is decided only when every value inside those
bounds falls on one side of the floor. Where the print cannot decide (a grad norm of 0.011 printed
to 3 decimals cannot show a 1e-3 difference), that metric is undecided and the verdict is CANNOT
COMPARE unless another metric already differs: never MATCH on a value too coarse to show the
floor. Each row says whether it rests on the capture's full-precision values or on the print.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .floors import FLOORS, Floor
from .log_lines import GRAD_NORM, NAN, SKIPPED, Iteration, RunLog, read_log


class Verdict(enum.Enum):
    MATCH = "MATCH"
    MISMATCH = "MISMATCH"
    CANNOT_COMPARE = "CANNOT COMPARE"


# A row's state: decided within or beyond the floor, or why it cannot be decided.
MATCHES = "match"
DIFFERS = "differs"
TOO_COARSE = "too coarse"
MISSING = "missing"
REFERENCE_NOT_FINITE = "reference not finite"
# Why runs cannot be compared, besides a row's state.
NO_ITERATIONS = "no iterations"
DIFFERENT_ITERATIONS = "different iterations"
MISSING_ITERATIONS = "missing iterations"
NOTHING_SHARED = "nothing shared"
NO_FLOOR = "no floor"
UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Problem:
    """Why (part of) the runs cannot be compared: its kind (what to do follows from it) and the
    words for the user."""

    kind: str
    text: str


@dataclass(frozen=True)
class Row:
    """One metric at one iteration."""

    iteration: int
    metric: str
    reference: float | None
    candidate: float | None
    relative: float | None
    floor: float
    state: str
    source: str
    note: str = ""


@dataclass(frozen=True)
class Comparison:
    verdict: Verdict
    precision: str
    floor: Floor | None
    rows: list[Row]
    first_difference: Row | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def reasons(self) -> list[str]:
        return [problem.text for problem in self.problems]

    @property
    def sources(self) -> list[str]:
        """The sources the decided rows rest on ("capture", "log")."""
        return sorted({row.source for row in self.rows if row.state in (MATCHES, DIFFERS)})


def precision_of(argv: Sequence[str]) -> str:
    """The precision a run trains in, from its command line: Megatron-LM's flags (fp8 by
    ``--fp8-format``, which rides on ``--bf16`` or ``--fp16``; fp4 by ``--fp4-format``) or a
    Megatron-Bridge override ``...mixed_precision=<recipe>`` (``bf16_with_fp8_..._mixed`` is fp8);
    else fp32."""
    flags = {arg.split("=", 1)[0] for arg in argv}
    for flag, precision in (("--fp4-format", "fp4"), ("--fp8-format", "fp8"),
                            ("--bf16", "bf16"), ("--fp16", "fp16")):
        if flag in flags:
            return precision
    recipes = [arg.split("=", 1)[1].lower() for arg in argv
               if "=" in arg and arg.split("=", 1)[0].lstrip("-+").endswith("mixed_precision")]
    for recipe in recipes:
        for precision in ("fp4", "fp8", "bf16", "fp16"):
            if precision in recipe:
                return precision
    return "fp32"


def relative(reference: float, candidate: float) -> float:
    """|candidate - reference| / |reference|; inf where the reference is 0 and they differ."""
    if candidate == reference:
        return 0.0
    return abs(candidate - reference) / abs(reference) if reference else math.inf


def judge_value(reference: float, ref_half: float, candidate: float, cand_half: float,
                floor: float) -> str:
    """MATCHES, DIFFERS or TOO_COARSE for two values, each known to ± its half unit."""
    if not math.isfinite(reference):
        return REFERENCE_NOT_FINITE
    if not math.isfinite(candidate):
        return DIFFERS
    slack = ref_half + cand_half
    distance = abs(candidate - reference)
    smallest_reference = abs(reference) - ref_half
    if distance + slack == 0.0:
        return MATCHES
    if smallest_reference > 0 and (distance + slack) / smallest_reference <= floor:
        return MATCHES
    surely_apart = max(0.0, distance - slack)
    largest_reference = abs(reference) + ref_half
    if surely_apart > floor * largest_reference:  # a zero reference: any sure distance
        return DIFFERS
    return TOO_COARSE


def _value_row(number: int, metric: str, ref: Iteration, cand: Iteration, floor: float,
               ref_value: float | None, cand_value: float | None) -> Row:
    if ref_value is None or cand_value is None:
        side = "the candidate" if ref_value is not None else "the reference"
        return Row(number, metric, ref_value, cand_value, None, floor, MISSING, "log",
                   f"{side} did not report it")
    ref_half, cand_half = ref.resolution.get(metric, 0.0), cand.resolution.get(metric, 0.0)
    state = judge_value(ref_value, ref_half, cand_value, cand_half, floor)
    source = "capture" if ref_half == cand_half == 0.0 else "log"
    note = ""
    if state == TOO_COARSE:
        note = (f"printed to ±{max(ref_half, cand_half):.1g}, too coarse to show a "
                f"{floor:.0e} difference")
    rel = relative(ref_value, cand_value) if math.isfinite(ref_value) else None
    return Row(number, metric, ref_value, cand_value, rel, floor, state, source, note)


def _count_row(number: int, metric: str, ref_count: int | None,
               cand_count: int | None) -> Row | None:
    if ref_count is None or cand_count is None:
        return None  # a count only the print has: nothing to compare
    state = MATCHES if ref_count == cand_count else DIFFERS
    return Row(number, metric, float(ref_count), float(cand_count), None, 0.0, state, "log")


def compare_iteration(ref: Iteration, cand: Iteration, floor: float) -> list[Row]:
    """Every metric of one iteration: the grad norm, each loss, the skipped and nan counts."""
    rows = [_value_row(ref.number, GRAD_NORM, ref, cand, floor, ref.grad_norm,
                       cand.grad_norm)] if (ref.grad_norm, cand.grad_norm) != (None, None) else []
    for name in sorted(set(ref.losses) | set(cand.losses)):
        rows.append(_value_row(ref.number, name, ref, cand, floor, ref.losses.get(name),
                               cand.losses.get(name)))
    for metric, ref_count, cand_count in ((SKIPPED, ref.skipped, cand.skipped),
                                          (NAN, ref.nan, cand.nan)):
        row = _count_row(ref.number, metric, ref_count, cand_count)
        if row is not None:
            rows.append(row)
    return rows


def _span(numbers: Sequence[int]) -> str:
    return f"{numbers[0]}-{numbers[-1]}" if len(numbers) > 1 else str(numbers[0])


def _alignment(ref: RunLog, cand: RunLog) -> tuple[list[int], list[Problem]]:
    """The iteration numbers both runs report, and why the rest cannot be compared."""
    ref_numbers = [it.number for it in ref.iterations]
    cand_numbers = [it.number for it in cand.iterations]
    for name, numbers in (("reference", ref_numbers), ("candidate", cand_numbers)):
        if not numbers:
            return [], [Problem(NO_ITERATIONS, f"the {name} printed no iteration line")]
    common = sorted(set(ref_numbers) & set(cand_numbers))
    if not common:
        return [], [Problem(DIFFERENT_ITERATIONS, "the runs report different iterations: the "
                            f"reference {_span(ref_numbers)}, the candidate {_span(cand_numbers)}")]
    problems = []
    for name, numbers in (("candidate", sorted(set(ref_numbers) - set(common))),
                          ("reference", sorted(set(cand_numbers) - set(common)))):
        if numbers:
            problems.append(Problem(MISSING_ITERATIONS, f"iterations {', '.join(map(str, numbers))}"
                                    f" missing from the {name}"))
    return common, problems


def compare(reference: RunLog, candidate: RunLog, precision: str) -> Comparison:
    """The verdict on ``candidate`` against ``reference`` at ``precision``'s floor."""
    floor = FLOORS.get(precision)
    if floor is None:
        return Comparison(Verdict.CANNOT_COMPARE, precision, None, [], None,
                          [Problem(NO_FLOOR, f"no noise floor is known for {precision}; compare "
                                             f"in {' or '.join(FLOORS)}")])
    common, problems = _alignment(reference, candidate)
    ref_by, cand_by = ({it.number: it for it in run.iterations} for run in (reference, candidate))
    first = min(common, default=None)
    tight = first is not None and first == reference.iterations[0].number == \
        candidate.iterations[0].number
    rows: list[Row] = []
    for number in common:
        rows += compare_iteration(ref_by[number], cand_by[number],
                                  floor.at(tight and number == first))
    differing = [row for row in rows if row.state == DIFFERS]
    if common and not any(row.state != MISSING for row in rows
                          if row.metric not in (SKIPPED, NAN)):
        problems.append(Problem(NOTHING_SHARED,
                                "neither run reported a loss or a grad norm both share"))
    for row in rows:
        if row.state not in (MATCHES, DIFFERS):
            problems.append(Problem(row.state, f"iteration {row.iteration}, {row.metric}: "
                                    f"{row.state}" + (f" ({row.note})" if row.note else "")))
    if differing:
        return Comparison(Verdict.MISMATCH, precision, floor, rows, differing[0], problems)
    verdict = Verdict.CANNOT_COMPARE if problems else Verdict.MATCH
    return Comparison(verdict, precision, floor, rows, None, problems)


def compare_logs(path_a: str, path_b: str, precision: str) -> Comparison:
    """``parity --compare LOG_A LOG_B``: two finished logs (A the reference) in Megatron-LM's
    line format (docs/PARITY.md, "Line format"), compared as two runs are."""
    runs = []
    for path in (path_a, path_b):
        try:
            runs.append(read_log(Path(path).read_text(errors="replace")))
        except OSError as exc:
            return Comparison(Verdict.CANNOT_COMPARE, precision, FLOORS.get(precision), [], None,
                              [Problem(UNREADABLE, f"cannot read {path}: {exc.strerror or exc}")])
    return compare(runs[0], runs[1], precision)
