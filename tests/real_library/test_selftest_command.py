"""``run_selftest`` (behind ``mfsdp-hotfix selftest``): before/after on a real release."""

from __future__ import annotations

import io

import pytest
from conftest import verdict_line
from realcases import describe, release_path, run_cached

from mfsdp_hotfix.selftest import format_table, run_selftest

pytestmark = pytest.mark.slow


def test_before_after_on_an_era_a_release() -> None:
    out = io.StringIO()
    runs = run_selftest(path=release_path("megatron-fsdp", "0.4.0"), flavour="standalone",
                        out=out, runner=run_cached)
    (before_name, before), (after_name, after) = runs[:2]
    assert (before_name, after_name) == ("without hotfix", "with hotfix")
    assert before.crashed and "No buffer found" in (before.exception or ""), describe(before)
    assert not after.crashed and after.max_abs_grad_error == 0.0, describe(after)
    assert after.grads_compared > 0, describe(after)  # a match means something was compared
    assert after.ordering_violations == 0, describe(after)
    text = out.getvalue()
    assert "selftest: running without hotfix" in text and "selftest: running with hotfix" in text
    assert "megatron-fsdp 0.4.0" in text
    table = format_table(runs)
    assert table in text
    lines = table.splitlines()
    assert lines[2].split()[:4] == ["without", "hotfix", "CRASH", "yes"]
    assert lines[3].split()[:4] == ["with", "hotfix", "ok", "no"]
    assert verdict_line(text).startswith("selftest: PASS: with the hotfix, megatron-fsdp 0.4.0")


def test_the_selftest_runs_one_rank_too() -> None:
    """A group of one rank (every one-GPU job) has defects two ranks never show: the selftest
    runs the same case at one rank, without and with the hotfix, and PASS needs the one-rank run
    with the hotfix to equal plain PyTorch (megatron-fsdp 0.6.1 as shipped: wrong)."""
    out = io.StringIO()
    runs = dict(run_selftest(path=release_path("megatron-fsdp", "0.6.1"), flavour="standalone",
                             out=out, runner=run_cached, progress=False))
    alone, alone_after = runs["without hotfix, one rank"], runs["with hotfix, one rank"]
    assert alone.spec.world == alone_after.spec.world == 1
    assert not alone.crashed and alone.max_abs_grad_error, describe(alone)
    assert alone_after.grads_match(1e-5), describe(alone_after)
    assert verdict_line(out.getvalue()).startswith("selftest: PASS: "), out.getvalue()[-2000:]


def test_nothing_importable_is_reported_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    out = io.StringIO()
    runs = run_selftest(out=out, progress=False)
    (name, result), = runs  # the run with the hotfix would find nothing either
    assert name == "without hotfix" and result.crashed
    assert "no Megatron-FSDP copy is importable" in (result.exception or ""), describe(result)
    assert verdict_line(out.getvalue()) == (
        "selftest: CANNOT RUN: no copy is importable here; install megatron-fsdp or "
        "megatron-core"), out.getvalue()
    assert ("  a Megatron-FSDP copy cannot be imported: no copy is importable here (ImportError: "
            "no Megatron-FSDP copy is importable (neither megatron_fsdp nor megatron-core))"
            ) in out.getvalue().splitlines(), out.getvalue()


def test_cli_exit_status_and_json_verdict(tmp_path) -> None:
    """``mfsdp-hotfix selftest --json``: the JSON on stdout carries the verdict, the last line of
    stderr is the PASS/FAIL line, and the exit status matches it."""
    import json

    from conftest import run_python

    proc = run_python("", release_path("megatron-fsdp", "0.5.1"),
                      args=("-m", "mfsdp_hotfix", "selftest", "--json"), timeout=600)
    data = json.loads(proc.stdout)
    last = verdict_line(proc.stderr)
    assert data["verdict"] == "PASS" and last == data["conclusion"], proc.stderr[-3000:]
    assert last.startswith("selftest: PASS: ") and proc.returncode == 0
    assert {data[name]["grad_reduce"] for name in RUNS} == {"scale-then-sum"}


RUNS = ("without hotfix", "with hotfix", "without hotfix, one rank", "with hotfix, one rank")


def test_a_copy_whose_scale_then_sum_is_wrong_is_tested_per_token() -> None:
    """megatron-fsdp 0.2.3 scales the wrong shard before its SUM (sharded-grads-summed-unscaled,
    refused with the hotfix): the selftest's workers see it in the copy's code and reduce
    per-token instead, so what it shows is the double buffer's crash as shipped and its repair."""
    import json

    from conftest import run_python

    proc = run_python("", release_path("megatron-fsdp", "0.2.3"),
                      args=("-m", "mfsdp_hotfix", "selftest", "--json"), timeout=600)
    data = json.loads(proc.stdout)
    assert data["verdict"] == "PASS" and proc.returncode == 0, proc.stderr[-3000:]
    assert {data[name]["grad_reduce"] for name in RUNS} == {"per-token"}
    assert data["without hotfix"]["crashed"] and "No buffer found" in data["without hotfix"][
        "exception"]
    assert ("gradients reduced per-token (calculate_per_token_loss=True): this copy has "
            "sharded-grads-summed-unscaled") in proc.stderr


def test_audit_with_the_default_flavour_agrees() -> None:
    """``mfsdp-hotfix selftest --audit`` with no other flag (``--flavour auto`` looks the copy
    up, which arms the audit: the worker installs the torch.cuda stand-in before that)."""
    from conftest import run_python

    proc = run_python("", release_path("megatron-fsdp", "0.5.1"),
                      args=("-m", "mfsdp_hotfix", "selftest", "--audit"), timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "audit, without hotfix: 24 unordered of 36 gradient-slot reuses (stand-in: 24 of " \
           "36); audit on: " \
           "agrees" in lines, proc.stdout[-3000:]
    assert verdict_line(proc.stdout).startswith("selftest: PASS: ") and lines[-1] == (
        "  the audit's counts equal the stand-in's"), lines[-1]
