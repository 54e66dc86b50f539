"""The verdict rule (docs/CLI.md, "Verdicts"): every first line fits in one glance, whatever the
release, the process state and the copy's problems; refusals sit on lines of their own."""

from __future__ import annotations

from typing import Any

import pytest
import releases

from mfsdp_hotfix import reporting, tree
from mfsdp_hotfix.verdict_text import FIRST_LINE_MAX, INDENT, block, first_line


def test_a_line_that_fits_is_left_alone() -> None:
    assert first_line("ordered", "nothing to do") == "ordered; nothing to do"
    assert block("state", ["why", "what"]) == f"state\n{INDENT}why\n{INDENT}what"


def test_a_long_line_loses_the_parenthesis_then_the_clauses_of_the_thing_to_do() -> None:
    state = "s" * 60
    todo = "use this and-that, on every-release later (with-words " + "x" * 60 + ")"
    assert first_line(state, todo) == f"{state}; use this and-that, on every-release later"
    assert first_line(state, "use this, " + "y" * 80) == f"{state}; use this"


def test_the_shorter_forms_come_before_a_cut() -> None:
    long = "affected: " + "a, " * 60 + "— NOT protected"
    assert first_line(long, "do it", ("affected: 2 copies — NOT protected",)) == (
        "affected: 2 copies — NOT protected; do it")
    cut = first_line(long, "do it")
    assert len(cut) <= FIRST_LINE_MAX and cut.endswith("…; do it"), cut


def _judged(dist: str, version: str) -> dict[str, Any]:
    return tree.judge(str(releases.unpacked(dist, version)))


@pytest.mark.parametrize("dist, version", [
    *(("megatron-fsdp", v) for v in releases.MEGATRON_FSDP),
    *(("megatron-core", v) for v in releases.MEGATRON_CORE if v not in ("0.13.0", "0.13.1"))])
def test_every_release_gets_a_first_line_of_one_glance(dist: str, version: str) -> None:
    """status's first line for each release, in every process state (and read from disk), is
    at most FIRST_LINE_MAX characters, and never says 'refuse' inside a verdict: refusals get
    their own line."""
    data = _judged(dist, version)
    for hotfix in (None, "armed", "active", "off", "not loaded", "uninstalled"):
        found = reporting.verdict(data, hotfix)
        assert len(found["line"]) <= FIRST_LINE_MAX, (hotfix, found["line"])
        assert "refus" not in found["line"], found["line"]
        assert not found["line"].endswith("…"), found["line"]
        refusals = [d for d in found["details"] if "refus" in d and not d.startswith("why:")]
        assert all(d.startswith("refused at model construction, if you build: ")
                   for d in refusals), refusals
