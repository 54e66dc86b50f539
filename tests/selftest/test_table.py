"""The before/after table of ``mfsdp-hotfix selftest`` (fabricated results, no subprocess)."""

from __future__ import annotations

import io

import pytest

from mfsdp_hotfix.selftest import CaseResult, CaseSpec, format_table


def _result(**fields: object) -> CaseResult:
    return CaseResult(spec=CaseSpec(), **fields)  # type: ignore[arg-type]


def test_verdicts_and_legend() -> None:
    runs = [
        ("without hotfix", _result(crashed=True, exception="AssertionError: No buffer found\nx",
                                   ordering_checks=0, ordering_violations=0, wall_s=3.21)),
        ("unordered", _result(crashed=False, max_abs_grad_error=0.0, ordering_checks=36,
                              ordering_violations=24, wall_s=4.0)),
        ("wrong", _result(crashed=False, max_abs_grad_error=0.5, ordering_checks=1,
                          ordering_violations=0, wall_s=4.0)),
        ("with hotfix", _result(crashed=False, max_abs_grad_error=0.0, ordering_checks=36,
                                ordering_violations=0, wall_s=4.0)),
    ]
    lines = format_table(runs).splitlines()
    assert lines[0].split()[:2] == ["run", "result"]
    assert lines[2].split() == ["without", "hotfix", "CRASH", "yes", "-", "0/0", "3.2"]
    assert lines[3].split() == ["unordered", "UNORDERED", "no", "0.00e+00", "24/36", "4.0"]
    assert lines[4].split()[:2] == ["wrong", "WRONG"]
    assert lines[5].split()[:3] == ["with", "hotfix", "ok"]
    assert "without hotfix: AssertionError: No buffer found" in lines
    for verdict in ("CRASH:", "UNORDERED:", "WRONG GRADS:", "ok:"):
        assert any(line.startswith(verdict) for line in lines), verdict


def test_conclusion_is_one_greppable_line() -> None:
    from mfsdp_hotfix.selftest.selftest import conclusion

    release = {"dist": "megatron-fsdp", "version": "0.4.0"}
    crashed = _result(crashed=True, exception="AssertionError: No buffer found", release=release)
    fine = _result(crashed=False, max_abs_grad_error=0.0, ordering_checks=36,
                   ordering_violations=0, release=release)
    unordered = _result(crashed=False, max_abs_grad_error=0.0, ordering_checks=36,
                        ordering_violations=24, release=release)
    passed, line = conclusion([("without hotfix", crashed), ("with hotfix", fine)])
    assert passed and line.startswith("selftest: PASS: with the hotfix, megatron-fsdp 0.4.0")
    assert line.splitlines()[0].endswith("; without it: CRASH"), line
    assert "0 unordered of 36 gradient-slot reuses" in line
    passed, line = conclusion([("without hotfix", unordered), ("with hotfix", unordered)])
    assert not passed and line.startswith("selftest: FAIL: with the hotfix, megatron-fsdp 0.4.0: "
                                          "UNORDERED")
    first, *details = line.splitlines()
    assert len(first) <= 120 and all(detail.startswith("  ") for detail in details), line


@pytest.mark.parametrize(("flavour", "path", "module", "why"), [
    ("standalone", "/r", "megatron_fsdp", "megatron-fsdp (--flavour standalone) cannot be "
     "imported: megatron-fsdp is not installed and not in --path /r"),
    ("core", None, "megatron.core.distributed.fsdp", "megatron-core's copy of Megatron-FSDP "
     "(--flavour core) cannot be imported: the megatron-core found has no "
     "megatron.core.distributed.fsdp"),
    ("core", None, "einops", "cannot be imported: it needs einops, which is not installed here"),
    ("auto", None, None, "a Megatron-FSDP copy cannot be imported: no copy is importable here"),
])
def test_a_copy_that_cannot_be_imported_as_shipped_cannot_run(
        flavour: str, path: str | None, module: str | None, why: str) -> None:
    from mfsdp_hotfix.selftest.selftest import cannot_run

    missing = {"module": module, "error": "ImportError: x"}
    spec = CaseSpec(flavour=flavour, path=path)
    line = cannot_run([("without hotfix", CaseResult(spec=spec, cannot_import=missing))])
    assert line is not None and line.startswith("selftest: CANNOT RUN: ") and why in line, line
    # importable as shipped, not with the hotfix: the hotfix's failure, not CANNOT RUN
    assert cannot_run([("without hotfix", CaseResult(spec=spec, crashed=False)),
                       ("with hotfix", CaseResult(spec=spec, cannot_import=missing))]) is None


def test_a_wrong_one_rank_run_fails_the_selftest() -> None:
    """The one-rank runs count: PASS needs them ``ok`` with the hotfix, and the line names a
    one-rank failure as such."""
    from mfsdp_hotfix.selftest.selftest import conclusion

    release = {"dist": "megatron-fsdp", "version": "0.6.1"}
    fine = _result(crashed=False, max_abs_grad_error=0.0, ordering_checks=36,
                   ordering_violations=0, release=release)
    wrong = _result(crashed=False, max_abs_grad_error=0.5, ordering_checks=0,
                    ordering_violations=0, release=release)
    passed, line = conclusion([("without hotfix", fine), ("with hotfix", fine),
                               ("without hotfix, one rank", wrong),
                               ("with hotfix, one rank", wrong)])
    assert not passed and line.startswith("selftest: FAIL: with the hotfix, megatron-fsdp 0.6.1 "
                                          "at one rank: WRONG GRADS")
    assert line.splitlines()[-1] == "  without it: ok, at one rank WRONG GRADS", line
    passed, line = conclusion([("without hotfix", fine), ("with hotfix", fine),
                               ("without hotfix, one rank", wrong),
                               ("with hotfix, one rank", fine)])
    assert passed and "and at one rank gradients equal plain PyTorch too" in line


def test_case_labels_are_plain_words() -> None:
    label = CaseSpec(hotfix="off").label()
    assert label == ("the Megatron-FSDP copy importable here, hotfix off (MFSDP_HOTFIX=0), ZeRO-3, "
                     "double buffer, 5 units, 2 microbatch(es), megatron-lm protocol")


def test_one_rank_is_said_in_the_singular() -> None:
    """The one-rank runs' label said '1 ranks'."""
    assert CaseSpec(world=1).label().endswith(", 1 rank")
    assert CaseSpec(world=4).label().endswith(", 4 ranks")


def test_the_selftest_says_its_case_once_and_each_run_in_a_short_line() -> None:
    """Every line of progress fits in one glance: the case is said once, indented."""
    from mfsdp_hotfix.selftest.selftest import run_selftest

    release = {"dist": "megatron-fsdp", "version": "0.4.0"}

    def runner(case: CaseSpec, tick: object) -> CaseResult:
        return CaseResult(spec=case, crashed=False, max_abs_grad_error=0.0, ordering_checks=36,
                          ordering_violations=0, release=release)

    out = io.StringIO()
    run_selftest(path="/some/where", out=out, runner=runner)
    lines = out.getvalue().splitlines()
    assert lines[0] == "selftest: 4 runs on CPU, without and with the hotfix, at 2 ranks and at one"
    assert lines[1].startswith("  the case: the Megatron-FSDP copy importable here from /some/")
    assert all(len(line) <= 120 for line in lines if not line.startswith(" ")), lines


def test_a_pass_names_what_the_release_does_without_the_hotfix_in_one_glance() -> None:
    """Where the one-rank outcome does not fit on the first line, it is told below it."""
    from mfsdp_hotfix.selftest.selftest import conclusion

    release = {"dist": "megatron-fsdp", "version": "0.5.1"}
    fine = _result(crashed=False, max_abs_grad_error=0.0, ordering_checks=36,
                   ordering_violations=0, release=release)
    unordered = _result(crashed=False, max_abs_grad_error=0.0, ordering_checks=36,
                        ordering_violations=24, release=release)
    wrong = _result(crashed=False, max_abs_grad_error=0.5, ordering_checks=0,
                    ordering_violations=0, release=release)
    passed, text = conclusion([("without hotfix", unordered), ("with hotfix", fine),
                               ("without hotfix, one rank", wrong),
                               ("with hotfix, one rank", fine)])
    first, *details = text.splitlines()
    assert passed and first == ("selftest: PASS: with the hotfix, megatron-fsdp 0.5.1 gradients "
                                "equal plain PyTorch; without it: UNORDERED"), text
    assert "  without it: UNORDERED, at one rank WRONG GRADS" in details, text
