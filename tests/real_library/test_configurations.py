"""The configuration matrix on the real library (see ``configurations.py``): for every
double-buffer configuration, the hotfix's result is right or it refuses the copy, the audit
watches it (its counts equal the stand-in's) or says it checked nothing, and the measurement is
the one recorded in docs/configurations.json, which docs/CONFIGURATIONS.md shows."""

from __future__ import annotations

import json
import os
from typing import Any

import configurations as matrix
import pytest
from configurations import CONFIGURATIONS, Configuration

WRITE = os.environ.get("MFSDP_WRITE_CONFIGURATIONS", "") not in ("", "0")


def _check(row: Configuration, got: dict[str, Any]) -> None:
    runs = got["runs"]
    # every row accumulates microbatches, but the documented single-microbatch control
    assert got["microbatches"] >= 2 or got["what"].startswith("control:"), row.id
    assert got["protocol"] == row.spec("on").protocol, row.id
    for mode, run in runs.items():
        where = f"{row.id}, hotfix {mode}: {json.dumps(run)}"
        assert not run["crashed"] or (mode == "on" and matrix.stopped_by_design(run)), where
        # no WRONG without a cause, and a cause only where the gradients differ
        assert (run["cause"] is None) == run["grads_equal"], where
        # the audit saw what the stand-in's own clocks saw
        assert (run["audit_unordered"], run["audit_reuses"]) == (
            run["unordered"], run["reuses"]), where
    on = runs["on"]
    where = f"{row.id}: {json.dumps(runs)}"
    if row.expect != matrix.REFUSED:
        assert on["refusal"] is None, where
    if row.expect == matrix.FIXED:
        assert runs["off"]["unordered"] > 0 and runs["off"]["audit_verdict"] == "UNORDERED", \
            where  # the race is there as shipped
        assert on["unordered"] == 0 and on["reuses"] > 0, where
        assert on["audit_verdict"] == "ordered" and "ordered-drain" in on["fixes"], where
        fallback = row.fields.get("options", {}).get("fsdp_db_use_persist_buf_on_alloc_fail")
        if row.fields.get("wide_units") and "maxpool_double_buffer" not in row.fields.get(
                "options", {}):  # the wide unit's bucket reuses were judged too
            kind = "persistent" if fallback else "fallback"
            for run in runs.values():
                assert run["grad_pools"][f"fsdp_grads (FixedPoolAllocator, {kind})"] > 0, where
        if row.fields.get("grad_comm_dtype") and row.fields.get("outer", 1) > 1:
            for run in runs.values():  # HSDP's own gradient pool was used and judged
                assert run["grad_pools"]["hsdp_grad_comm (FixedPoolAllocator)"] > 0, where
    elif row.expect == matrix.REFUSED:
        assert on["era"] == "refused" and on["note"].startswith("refused by the hotfix: "), where
        # the warning every rank logs says why, and what to do
        assert on["refusal"].startswith("unrecognised code shape in "), where
        assert "run with fsdp_double_buffer=False" in on["refusal"], where
        # no double-buffer fix; those that rest on none of the refused code still apply
        assert not {"getter-guard", "ordered-drain"} & set(on["fixes"]), where
        assert on["grads_equal"], where
        assert on["unordered"] > 0 and on["audit_verdict"] == "UNORDERED", where
    elif row.expect == matrix.NOT_CHECKED:
        for run in runs.values():
            assert run["reuses"] == 0 and run["audit_verdict"] == "NOT CHECKED", where
            assert run["grad_pools"], where  # a pool, never reused
    else:
        assert row.expect == matrix.CONTROL
        assert on["grad_pools"] == {}, where
        assert on["audit_verdict"] == "NOT CHECKED", where


# The rows CI reruns: one of each allocator, the wide unit, ZeRO-1, HSDP, an N-slot pool and the
# controls whose outcome the hotfix changes; every row is rerun by the long set (pytest -m long),
# and every recorded row is checked against its expectation below.
IN_CI = {"fixedpool-zero3", "maxpool-zero2", "fixedpool-wide-fallback", "zero1", "hsdp",
         "pr6316-rebuilt-fixedpool-count3", "control-zero1-2mb-auto-sync",
         "control-no_shard-2mb-no-overlap-sum"}


@pytest.mark.slow
@pytest.mark.parametrize("row", [
    pytest.param(row, id=row.id, marks=() if row.id in IN_CI else pytest.mark.long)
    for row in CONFIGURATIONS])
def test_configuration(row: Configuration) -> None:
    if matrix.path_of(row.source) is None:
        pytest.skip(f"{row.source}: no Megatron-LM clone with that ref "
                    "(set MFSDP_TEST_MEGATRON_LM to a git dir that has it)")
    got = matrix.measure(row)
    _check(row, got)
    if WRITE:
        record = matrix.load_record() if matrix.RECORD.exists() else {}
        record[row.id] = got
        matrix.RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    assert got == matrix.load_record()[row.id], "measured now vs docs/configurations.json"


def test_the_record_meets_every_rows_expectation() -> None:
    record = matrix.load_record()
    assert sorted(record) == sorted(row.id for row in CONFIGURATIONS)
    for row in CONFIGURATIONS:
        _check(row, record[row.id])


def test_the_doc_shows_the_record() -> None:
    assert matrix.doc_table() == matrix.table(matrix.load_record())
