"""A parity verdict in words, by the package's one rule for a verdict's text
(:mod:`mfsdp_hotfix.verdict_text`): a first line that says the verdict and the one thing to do,
then details indented below; and the same as data for ``--json`` (every field of the comparison
kept)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from .. import verdict_text
from ..verdict_text import block
from . import comparison as c
from .comparison import Comparison, Row, Verdict

STATUS = "`mfsdp-hotfix status --verbose`"
WORKAROUNDS = "the workarounds in docs/USAGE.md"
# The one thing to do when runs cannot be compared, by the kind of the first problem.
FIXES = {
    c.NO_ITERATIONS: "see that run's output: it crashed or printed no iteration line",
    c.DIFFERENT_ITERATIONS: "run both from the same start (the same --load, or none)",
    c.MISSING_ITERATIONS: "see the shorter run's output: it stopped early",
    c.TOO_COARSE: "compare with the capture (mfsdp-hotfix parity adds it; see its warning)",
    c.MISSING: "give both runs the same model and loss options",
    c.REFERENCE_NOT_FINITE: "the reference diverged: lower the learning rate or check the data",
    c.NOTHING_SHARED: "print the losses and grad norm in the documented line format",
    c.NO_FLOOR: "compare in a precision with a known floor",
    c.UNREADABLE: "check the path",
}


def _number(value: float | None) -> str:
    return "none" if value is None else f"{value:.7g}"


def _percent(relative: float | None) -> str:
    if relative is None or not math.isfinite(relative):
        return "not finite"
    if relative == 0.0:
        return "0"
    return f"{relative * 100:.2g} %" if relative >= 1e-3 else f"{relative:.1e}"


def _source(row: Row) -> str:
    return "the capture" if row.source == "capture" else "the printed lines"


def _iterations(comparison: Comparison) -> str:
    numbers = sorted({row.iteration for row in comparison.rows})
    if not numbers:
        return "no iteration"
    return f"iteration {numbers[0]}" if len(numbers) == 1 else \
        f"iterations {numbers[0]}-{numbers[-1]}"


def first_line(comparison: Comparison) -> str:
    """The verdict and the one thing to do, in at most ``verdict_text.FIRST_LINE_MAX``
    characters (the details keep the whole)."""
    if comparison.verdict is Verdict.MATCH:
        return verdict_text.first_line(
            f"MATCH: losses and grad norm within {comparison.precision} noise of the reference "
            f"over {_iterations(comparison)}", "nothing to do")
    if comparison.verdict is Verdict.MISMATCH:
        row = comparison.first_difference
        assert row is not None
        return verdict_text.first_line(
            f"MISMATCH at iteration {row.iteration}: {row.metric} {_percent(row.relative)} off "
            "the reference", f"run {STATUS}")
    problem = comparison.problems[0]
    return verdict_text.first_line(f"CANNOT COMPARE: {problem.text}",
                                   FIXES.get(problem.kind, "see below"))


def _floor_line(comparison: Comparison) -> str | None:
    floor = comparison.floor
    if floor is None:
        return None
    origin = f"measured: {floor.measured}" if floor.measured else "provisional"
    return (f"noise floor ({floor.precision}): {floor.first:.0e} relative at the first "
            f"iteration, {floor.later:.0e} after ({origin})")


def _worst_lines(comparison: Comparison) -> list[str]:
    """Per metric, the largest difference seen and the source it rests on."""
    worst: dict[str, Row] = {}
    for row in comparison.rows:
        if row.relative is None or row.state not in (c.MATCHES, c.DIFFERS):
            continue
        if row.metric not in worst or row.relative > (worst[row.metric].relative or 0.0):
            worst[row.metric] = row
    return [f"{metric}: at most {_percent(row.relative)} apart (iteration {row.iteration}, "
            f"from {_source(row)})" for metric, row in sorted(worst.items())]


def details(comparison: Comparison, runs_info: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The lines under the first one (without their indent)."""
    lines: list[str] = []
    row = comparison.first_difference
    if row is not None:
        lines.append(f"first difference: iteration {row.iteration}, {row.metric}: reference "
                     f"{_number(row.reference)}, candidate {_number(row.candidate)} "
                     f"({_percent(row.relative)} apart, floor {row.floor:.0e}, from "
                     f"{_source(row)})")
        lines.append(f"what to try: {STATUS} (is every fix applied to the copy this job "
                     f"imports?), then {WORKAROUNDS}")
    lines += [f"cannot compare: {text}" for text in comparison.reasons]
    floor = _floor_line(comparison)
    lines += _worst_lines(comparison) + ([floor] if floor else [])
    for name, info in runs_info.items():
        facts = ", ".join(f"{key}: {value}" for key, value in info.items() if value is not None)
        lines.append(f"{name}: {facts}" if facts else name)
    return lines


def render(comparison: Comparison, runs_info: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The verdict as lines: the first line, then the details indented."""
    return block(first_line(comparison), details(comparison, runs_info)).splitlines()


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it (a non-finite float as its name)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def as_json(comparison: Comparison, runs_info: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Every field of the comparison, the first line and the runs, as plain data."""
    data = dataclasses.asdict(comparison)
    data["verdict"] = comparison.verdict.value
    data["reasons"] = comparison.reasons
    data["sources"] = comparison.sources
    data["first_line"] = first_line(comparison)
    data["runs"] = {name: dict(info) for name, info in runs_info.items()}
    return dict(_plain(data))
