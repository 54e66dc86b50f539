"""parity/verdict_text and compare_logs: each verdict's first line (verdict_text's rule, the
verdict and the one thing to do), its details, and the JSON that keeps every field."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from training_lines import megatron_line

from mfsdp_hotfix.parity import comparison as c
from mfsdp_hotfix.parity.comparison import Verdict, compare, compare_logs
from mfsdp_hotfix.parity.log_lines import read_log
from mfsdp_hotfix.parity.verdict_text import FIXES, as_json, first_line, render
from mfsdp_hotfix.verdict_text import FIRST_LINE_MAX

FIXTURES = Path(__file__).parent / "fixtures"
HOTFIX = str(FIXTURES / "core-0.19.2-zero1-hotfix.log")
SHIPPED = str(FIXTURES / "core-0.19.2-zero1-shipped.log")
RUNS = {"reference": {"output": "/parity/reference", "hotfix": "off"},
        "candidate": {"output": "/parity/candidate", "hotfix": None}}


def test_match() -> None:
    got = compare_logs(HOTFIX, str(FIXTURES / "core-0.18.2-zero1-hotfix.log"), "fp32")
    lines = render(got, RUNS)
    assert lines[0] == ("MATCH: losses and grad norm within fp32 noise of the reference over "
                        "iterations 1-3; nothing to do")
    assert "  grad norm: at most 0 apart (iteration 1, from the printed lines)" in lines
    assert ("  noise floor (fp32): 1e-03 relative at the first iteration, 5e-03 after "
            "(measured: docs/validation/megatron-lm-ddp-summary.json)") in lines
    assert lines[-2:] == ["  reference: output: /parity/reference, hotfix: off",
                          "  candidate: output: /parity/candidate"]


def test_mismatch_says_where_by_how_much_and_what_to_try() -> None:
    got = compare_logs(HOTFIX, SHIPPED, "fp32")
    lines = render(got, {})
    assert lines[0] == ("MISMATCH at iteration 1: grad norm 49 % off the reference; run "
                        "`mfsdp-hotfix status --verbose`")
    assert lines[1] == ("  first difference: iteration 1, grad norm: reference 2.24, candidate "
                        "1.137 (49 % apart, floor 1e-03, from the printed lines)")
    assert "docs/USAGE.md" in lines[2] and lines[2].startswith("  what to try: ")
    assert all(line.startswith("  ") for line in lines[1:])


@pytest.mark.parametrize("reference, candidate, kind", [
    ("", megatron_line(1, {"lm loss": 9.0}, 2.24), c.NO_ITERATIONS),
    (megatron_line(1, {"lm loss": 9.0}, 0.011), megatron_line(1, {"lm loss": 9.0}, 0.011),
     c.TOO_COARSE),
    (megatron_line(1, {"lm loss": 9.0}, 2.24), megatron_line(7, {"lm loss": 9.0}, 2.24),
     c.DIFFERENT_ITERATIONS),
    (megatron_line(1, {"lm loss": 9.0}, math.inf), megatron_line(1, {"lm loss": 9.0}, 2.24),
     c.REFERENCE_NOT_FINITE),
])
def test_cannot_compare_gives_the_reason_and_the_fix(reference: str, candidate: str,
                                                    kind: str) -> None:
    got = compare(read_log(reference), read_log(candidate), "fp32")
    assert got.verdict is Verdict.CANNOT_COMPARE and got.problems[0].kind == kind
    line = first_line(got)
    state, todo = line.rsplit("; ", 1)
    assert f"CANNOT COMPARE: {got.problems[0].text}".startswith(state.removesuffix("…"))
    assert len(line) <= FIRST_LINE_MAX and FIXES[kind].startswith(todo.removesuffix("…"))
    assert f"  cannot compare: {got.problems[0].text}" in render(got, {})


def test_every_problem_kind_has_a_fix() -> None:
    kinds = {getattr(c, name) for name in ("NO_ITERATIONS", "DIFFERENT_ITERATIONS",
                                           "MISSING_ITERATIONS", "TOO_COARSE", "MISSING",
                                           "REFERENCE_NOT_FINITE", "NOTHING_SHARED", "NO_FLOOR",
                                           "UNREADABLE")}
    assert kinds == set(FIXES)


def test_a_long_reason_is_cut_at_a_word_and_keeps_the_thing_to_do() -> None:
    numbers = list(range(2, 60))
    ref = read_log("\n".join(megatron_line(n, {"lm loss": 9.0}, 2.24) for n in [1] + numbers))
    cand = read_log(megatron_line(1, {"lm loss": 9.0}, 2.24))
    got = compare(ref, cand, "fp32")
    line = first_line(got)
    assert len(line) <= FIRST_LINE_MAX
    assert line.endswith(f"…; {FIXES[got.problems[0].kind]}"), line
    assert f"  cannot compare: {got.problems[0].text}" in render(got, {})


def test_an_unreadable_log(tmp_path: Path) -> None:
    got = compare_logs(str(tmp_path / "absent.log"), HOTFIX, "bf16")
    assert got.verdict is Verdict.CANNOT_COMPARE and got.problems[0].kind == c.UNREADABLE
    assert got.reasons == [f"cannot read {tmp_path / 'absent.log'}: No such file or directory"]
    assert first_line(compare_logs("no/such.log", HOTFIX, "bf16")) == (
        "CANNOT COMPARE: cannot read no/such.log: No such file or directory; check the path")


def test_json_keeps_every_field_and_is_strict_json() -> None:
    nan_run = read_log(megatron_line(1, {"lm loss": 9.0}, math.nan, nan=1))
    got = compare(read_log(megatron_line(1, {"lm loss": 9.0}, 2.24)), nan_run, "bf16")
    data = as_json(got, RUNS)
    json.dumps(data, allow_nan=False)
    assert data["verdict"] == "MISMATCH" and data["first_line"] == first_line(got)
    assert data["first_difference"]["candidate"] == "nan"
    assert data["floor"]["precision"] == "bf16" and data["floor"]["measured"] is None
    assert {row["metric"] for row in data["rows"]} == {
        "grad norm", "lm loss", "number of skipped iterations", "number of nan iterations"}
    assert set(data) >= {"verdict", "precision", "floor", "rows", "first_difference",
                         "problems", "reasons", "sources", "first_line", "runs"}
    assert data["runs"] == RUNS
