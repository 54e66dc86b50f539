"""``run_selftest`` (behind ``mfsdp-hotfix selftest``): before/after on a real release."""

from __future__ import annotations

import io

import pytest
from realcases import describe, release_path, run_cached

from mfsdp_hotfix.selftest import format_table, run_selftest

pytestmark = pytest.mark.slow


def test_before_after_on_an_era_a_release() -> None:
    out = io.StringIO()
    runs = run_selftest(path=release_path("megatron-fsdp", "0.4.0"), flavour="standalone",
                        out=out, runner=run_cached)
    (before_name, before), (after_name, after) = runs
    assert (before_name, after_name) == ("without hotfix", "with hotfix")
    assert before.crashed and "No buffer found" in (before.exception or ""), describe(before)
    assert not after.crashed and after.max_abs_grad_error == 0.0, describe(after)
    assert after.ordering_violations == 0, describe(after)
    text = out.getvalue()
    assert "selftest: running without hotfix" in text and "selftest: running with hotfix" in text
    assert "megatron-fsdp 0.4.0" in text
    table = format_table(runs)
    assert table in text
    lines = table.splitlines()
    assert lines[2].split()[:4] == ["without", "hotfix", "CRASH", "yes"]
    assert lines[3].split()[:4] == ["with", "hotfix", "ok", "no"]


def test_nothing_importable_is_reported_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    out = io.StringIO()
    runs = run_selftest(out=out, progress=False)
    for _, result in runs:
        assert result.crashed
        assert "no Megatron-FSDP copy is importable" in (result.exception or ""), describe(result)
    assert "CRASH" in out.getvalue()
