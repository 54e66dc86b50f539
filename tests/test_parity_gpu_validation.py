"""The CPU side of validation/parity_gpu/ (``mfsdp-hotfix parity`` on Megatron-LM's
pretrain_gpt.py, one GPU): the plan covers the matrix the command must be proved on, each case's
command line is the user's launch behind ``mfsdp-hotfix parity --json``, a case's JSON is read
into its record, a failing case never costs the others theirs, and docs/PARITY.md's generated
table is the report of the committed records (a synthetic record here; no GPU record is made up).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "validation"))
from megatron_lm.arguments import OP_FUSER_FLAGS  # noqa: E402
from megatron_lm.plan import MICROBATCHES  # noqa: E402
from parity_gpu import driver as driver_module  # noqa: E402
from parity_gpu.command import command  # noqa: E402
from parity_gpu.driver import Driver  # noqa: E402
from parity_gpu.plan import (  # noqa: E402
    DISABLED_FIX,
    RELEASES,
    RUN_S,
    case,
    plan,
    selected,
)
from parity_gpu.reading import case_result, differences, parsed_json  # noqa: E402
from parity_gpu.tables import floor_violations, joined, report  # noqa: E402

RECORDS = sorted((REPO / "docs" / "validation").glob("parity-gpu-*.json.gz"))


def ids(**filters: Any) -> set[str]:
    return {c["id"] for c in plan() if all(c.get(k) == v for k, v in filters.items())}


def test_the_plan_covers_the_matrix_the_command_is_proved_on() -> None:
    cases = plan()
    for rel in RELEASES:
        mine = [c for c in cases if c["release"] == rel]
        for zero in (1, 2, 3):
            for impl in ("te", "local"):
                for dtype in ("fp32", "bf16"):
                    found = [c for c in mine if (c["zero"], c["impl"], c["dtype"], c["model"],
                                                 c["dp"], c["wgrad"], c["variant"]) ==
                             (zero, impl, dtype, "gpt", 1, "fused", "hotfix")]
                    assert len(found) == 1 and found[0]["expected"] == "MATCH", \
                        (rel, zero, impl, dtype)
        shipped = [c for c in mine if c["shipped"]]
        assert {(c["zero"], c["impl"], c["dtype"]) for c in shipped} == \
            {(1, "te", "fp32"), (3, "te", "fp32")}
        assert all(c["expected_shipped"] == "MISMATCH" for c in shipped)
        disabled = [c for c in mine if c["disabled"]]
        assert disabled and all(c["zero"] == 1 and c["disabled"] == [DISABLED_FIX]
                                and c["expected"] == "MISMATCH" for c in disabled)
        assert {c["zero"] for c in mine if c["dp"] == 2} == {1, 3}
        assert {c["zero"] for c in mine if c["model"] == "moe"} == {1, 3}
        assert all(c["wgrad"] == "fused" for c in mine if c["group"] != "apart")
    # the op fuser's flags exist in 0.19 only; its verdict is recorded, whatever it is
    opfuser = [c for c in cases if c["model"] == "moe-opfuser"]
    assert {c["release"] for c in opfuser} == {"core-0.19.2"} and \
        {c["zero"] for c in opfuser} == {1, 3} and all(not c["expected"] for c in opfuser)
    assert [c["id"] for c in selected(("core-0.18.2",), ("fake",), "zero3")] == \
        ["core-0.18.2|dp2|zero3|te|fused|fp32|gpt|hotfix"]
    with pytest.raises(ValueError):
        plan(groups=("nope",))


def test_each_case_is_the_users_launch_behind_the_parity_command() -> None:
    c = case("dp1", "core-0.19.2", zero=3, shipped=True, expected_shipped="MISMATCH")
    argv, env, added = command(c, "/src/pretrain_gpt.py", "/rel", "/cases/x/parity")
    parity = argv.index("parity")
    assert argv[parity:parity + 6] == ["parity", "--json", "--out", "/cases/x/parity",
                                       "--iters", "3"]
    assert "--with-shipped" in argv[:argv.index("--")]
    job = argv[argv.index("--") + 1:]
    assert "--nproc-per-node" in job and job[job.index("--nproc-per-node") + 1] == "1"
    script = job.index("/src/pretrain_gpt.py")
    args = job[script + 1:]
    for flag in ("--use-megatron-fsdp", "--fsdp-double-buffer", "--overlap-grad-reduce",
                 "--overlap-param-gather", "--use-distributed-optimizer", "--mock-data"):
        assert flag in args
    assert args[args.index("--data-parallel-sharding-strategy") + 1] == "optim_grads_params"
    assert int(args[args.index("--global-batch-size") + 1]) == \
        MICROBATCHES * int(args[args.index("--micro-batch-size") + 1])
    # fused wgrad as Megatron-LM's default; determinism is the command's to add
    assert "--no-gradient-accumulation-fusion" not in args and "--deterministic-mode" not in args
    assert env["MFSDP_VAL_MLM_INJECT"] == "1" and "MFSDP_HOTFIX" not in env
    assert added["PYTHONPATH"].split(":")[:2] == [str(REPO / "validation" / "mlm_inject"),
                                                  "/rel"]
    local = command(case("dp1", "core-0.18.2", zero=1, impl="local"), "/s/pretrain_gpt.py",
                    "/rel", "/o")[0]
    assert "--no-gradient-accumulation-fusion" not in local  # fused with local layers too
    assert local[local.index("--transformer-impl") + 1] == "local"


def test_two_ranks_the_disabled_fix_and_the_op_fuser_are_what_they_say() -> None:
    argv, env, _ = command(case("fake", "core-0.19.2", zero=1, dp=2), "/s/pretrain_gpt.py",
                           "/rel", "/o")
    job = argv[argv.index("--") + 1:]
    assert job[:2] == ["python3", "/s/pretrain_gpt.py"] and "--fake-process-group" in job
    assert env["WORLD_SIZE"] == "2" and env["MFSDP_VAL_MLM_FAKE_NCCL"] == "1"
    assert env["MFSDP_HOTFIX_CROSS_RANK_CHECK"] == "off"
    assert "--global-batch-size" in job and \
        int(job[job.index("--global-batch-size") + 1]) == MICROBATCHES * 2 * 2
    _, env, _ = command(case("disabled", "core-0.19.2", zero=1, disabled=(DISABLED_FIX,),
                             expected="MISMATCH"), "/s/pretrain_gpt.py", "/rel", "/o")
    assert env["MFSDP_HOTFIX_DISABLED_FIXES"] == DISABLED_FIX
    argv = command(case("opfuser", "core-0.19.2", zero=3, model="moe-opfuser", expected=""),
                   "/s/pretrain_gpt.py", "/rel", "/o")[0]
    assert all(argv.count(flag) == 1 for flag in OP_FUSER_FLAGS + ("--moe-grouped-gemm",))
    assert argv[argv.index("--num-experts") + 1] == "4"


def comparison_doc(verdict: str, grad: list[tuple[float, float]], loss: float = 9.0
                   ) -> dict[str, Any]:
    """A comparison as the command's JSON holds it (synthetic: the test's own numbers)."""
    rows = []
    for i, (ref, cand) in enumerate(grad, start=1):
        rows.append(dict(iteration=i, metric="grad norm", reference=ref, candidate=cand,
                         relative=abs(cand - ref) / ref))
        rows.append(dict(iteration=i, metric="lm loss", reference=loss, candidate=loss,
                         relative=0.0))
    return {"verdict": verdict, "rows": rows}


def write_run(folder: Path, name: str, grad: list[float], hotfix: str,
              disabled: list[str] = ()) -> dict[str, Any]:
    """A run's output and capture as the command leaves them (synthetic: the test's numbers),
    and its entry in the JSON's ``runs``."""
    from parity.training_lines import megatron_line

    run = folder / name
    (run / "capture").mkdir(parents=True)
    log = run / "output.log"
    log.write_text("\n".join(megatron_line(i, {"lm loss": 9.0}, g)
                             for i, g in enumerate(grad, start=1)) + "\n")
    records = [dict(kind="process", rank=0, hotfix=hotfix, fixes_applied=["reduce-once"],
                    disabled_fixes=list(disabled))]
    records += [dict(kind="iteration", iteration=i, grad_norm=g, losses={"lm loss": 9.0},
                     skipped=0) for i, g in enumerate(grad, start=1)]
    (run / "capture" / "training_log-rank0.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records))
    return {"what": name, "exit status": 0, "seconds": 40.0, "output": str(log)}


def test_a_cases_json_becomes_its_record(tmp_path: Path) -> None:
    out = tmp_path / "parity"
    runs = {"reference": write_run(out, "reference", [2.0, 2.5], "off"),
            "candidate": write_run(out, "candidate", [2.0 * (1 + 4e-6), 2.5 * (1 + 3e-5)],
                                   "active"),
            "shipped": write_run(out, "shipped", [1.2, 1.0], "off")}
    doc = dict(comparison_doc("MATCH", [(2.0, 2.0 * (1 + 4e-6)), (2.5, 2.5 * (1 + 3e-5))]),
               runs=dict(runs, check={"iterations": "1-2", "folder": str(out)}),
               shipped=comparison_doc("MISMATCH", [(2.0, 1.2), (2.5, 1.0)]))
    assert parsed_json(json.dumps(doc, indent=1)) == doc
    c = dict(case("dp1", "core-0.19.2", zero=3, shipped=True, expected_shipped="MISMATCH"),
             rc=0, wall_s=120.0, cwd=str(tmp_path))
    r = case_result(c, json.dumps(doc, indent=1), "")
    assert r["verdict"] == "MATCH" and r["shipped_verdict"] == "MISMATCH" and r["as_expected"]
    assert r["rc_as_documented"] and not r["harness_problem"]
    assert r["first_grad_norm_rel"] == pytest.approx(4e-6)
    assert r["later"]["grad norm"] == pytest.approx(3e-5)
    assert r["shipped_differences"]["first_grad_norm_rel"] == pytest.approx(0.4)
    assert r["hotfix"] == {"reference": "off", "candidate": "active", "shipped": "off"}
    candidate = r["runs_read"]["candidate"]
    assert candidate["first"] == {"grad_norm": pytest.approx(2.0 * (1 + 4e-6)),
                                  "losses": {"lm loss": 9.0}, "source": "log+capture"}
    assert candidate["iterations"] == [1, 2] and candidate["fixes"]["disabled_fixes"] == []
    assert r["reference_first"] == {"grad norm": 2.0, "lm loss": 9.0}
    assert "stdout_tail" not in r  # as expected: no tails
    (out / "candidate" / "output.log").write_text("x" * 10_000 + "Traceback: boom")
    bad = case_result(dict(c, rc=2), "not json", "error: the reference did not start")
    assert bad["verdict"] is None and bad["outcome"] == "no verdict" and not bad["as_expected"]
    assert bad["stderr_tail"].endswith("did not start")
    assert bad["run_tails"]["candidate/output.log"].endswith("boom")
    assert len(bad["run_tails"]["candidate/output.log"]) < 10_000
    wrong_status = case_result(dict(c, rc=4), json.dumps(doc), "")
    assert not wrong_status["rc_as_documented"]


def test_a_run_whose_hotfix_is_not_its_roles_is_the_harnesss_failure(tmp_path: Path) -> None:
    runs = {"reference": write_run(tmp_path, "reference", [2.0], "off"),
            "candidate": write_run(tmp_path, "candidate", [2.0], "off")}
    c = dict(case("dp1", "core-0.19.2", zero=1), rc=0, wall_s=90.0, cwd=str(tmp_path))
    r = case_result(c, json.dumps(dict(comparison_doc("MATCH", [(2.0, 2.0)]), runs=runs)), "")
    assert r["harness_problem"] == "hotfix unlike the run's role (candidate: off)"
    assert not r["as_expected"] and "stdout_tail" in r
    runs["candidate"] = write_run(tmp_path / "b", "candidate", [2.1], "active")
    c = dict(case("disabled", "core-0.19.2", zero=1, disabled=(DISABLED_FIX,),
                  expected="MISMATCH"), rc=1, wall_s=90.0, cwd=str(tmp_path))
    r = case_result(c, json.dumps(dict(comparison_doc("MISMATCH", [(2.0, 2.1)]), runs=runs)),
                    "")
    assert r["harness_problem"] == f"hotfix unlike the run's role (candidate: {DISABLED_FIX} " \
        "not disabled)"


def test_a_failing_case_costs_no_other_case_its_record(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(driver_module.engine, "te_state", lambda: "ready")
    drv = Driver({"core-0.19.2": "/nowhere/pretrain_gpt.py"}, {"core-0.19.2": "/rel"},
                 str(tmp_path), deadline=time.time() + 1000, workers=2)

    def broken(*_a: Any, **_k: Any) -> Any:
        raise OSError("no such launcher")

    monkeypatch.setattr(driver_module, "run", broken)
    cases = selected(("core-0.19.2", "core-0.18.2"), ("fake",), "")
    results = drv.run_all(cases, log=lambda _line: None)
    assert [r["id"] for r in results] == [c["id"] for c in cases]
    by_release = {r["release"]: r["outcome"] for r in results}
    assert by_release == {"core-0.19.2": "harness error", "core-0.18.2": "not run"}
    assert "no such launcher" in results[0]["error"]
    late = Driver({"core-0.19.2": "/s"}, {"core-0.19.2": "/rel"}, str(tmp_path),
                  deadline=time.time() + 30, workers=1)
    cut = late.one(cases[0])
    assert cut["outcome"] == "not run" and "time budget" in cut["error"]
    # the checks that ended set the pace: slower runs than planned start fewer checks
    assert late.needed(cases[0]) == cases[0]["estimate_s"]
    late.per_run += [100.0, 30.0, 120.0]
    assert late.needed(cases[0]) == 2 * 100.0 + cases[0]["estimate_s"] - 2 * RUN_S


def synthetic_record() -> dict[str, Any]:
    """Three cases as a call would record them (the numbers are the test's own)."""
    def done(c: dict[str, Any], verdict: str | None, grad: list[tuple[float, float]],
             shipped: list[tuple[float, float]] | None = None, **extra: Any) -> dict[str, Any]:
        r = dict(c, verdict=verdict, wall_s=100.0, rc=0, **extra)
        r.update(differences(comparison_doc(verdict or "", grad)["rows"]))
        if shipped:
            r["shipped_verdict"] = "MISMATCH"
            r["shipped_differences"] = differences(comparison_doc("", shipped)["rows"])
        return r

    return {"results": [
        done(case("dp1", "core-0.19.2", zero=1, shipped=True, expected_shipped="MISMATCH"),
             "MATCH", [(2.24, 2.24001), (2.336, 2.33605)], shipped=[(2.24, 1.137)]),
        done(case("dp1", "core-0.19.2", zero=2, dtype="bf16"), "MATCH",
             [(2.25, 2.2504), (2.3, 2.302)]),
        done(case("disabled", "core-0.19.2", zero=1, disabled=(DISABLED_FIX,),
                  expected="MISMATCH"), "MISMATCH", [(2.24, 2.276), (2.3, 2.34)]),
        dict(case("fake", "core-0.19.2", zero=3, dp=2), verdict=None, outcome="no verdict",
             rc=3, wall_s=40.0, error=None),
    ]}


def test_the_report_of_a_synthetic_record() -> None:
    lines = report([synthetic_record()]).splitlines()
    table = [line for line in lines if line.startswith("| **") or "no verdict" in line]
    assert table[0] == ("| **MATCH** | MATCH | core-0.19.2 | TE | fp32 | 1 | GPT | hotfix | "
                        "4.5e-06 | 100 s |")
    assert table[1] == ("| **MISMATCH** | MISMATCH | core-0.19.2 | TE | fp32 | 1 | GPT | "
                        "as shipped (`--with-shipped`) | 0.49 | 100 s |")
    assert table[2].startswith("| **MATCH** | MATCH | core-0.19.2 | TE | bf16 | 2 |")
    assert "disabled core-linear-accumulate" in table[3] and "0.016" in table[3]
    assert table[4].startswith("| no verdict: exit status 3 |") and "2 ranks, fake group" in \
        table[4]
    floors = lines[lines.index("") + 1:]
    assert floors[2] == "| bf16 | MATCH | 1 | 0.00018 | 0.00018 | 0.00087 | 0.00018 |"
    assert floors[3] == "| fp32 | MATCH | 1 | 4.5e-06 | 4.5e-06 | 2.1e-05 | 4.5e-06 |"
    assert floors[4].startswith("| fp32 | MISMATCH | 2 | 0.49 |") and \
        floors[4].endswith("| 0.016 |")


def test_a_later_record_replaces_a_case_unless_it_did_not_run() -> None:
    first = synthetic_record()
    again = {"results": [dict(first["results"][1], verdict="MISMATCH"),
                         dict(first["results"][0], outcome="not run", verdict=None)]}
    results = joined([first, again])
    assert [r.get("verdict") for r in results] == ["MATCH", "MISMATCH", "MISMATCH", None]


def test_docs_parity_table_is_the_report_of_the_committed_records() -> None:
    """The generated table in docs/PARITY.md is ``--report`` of the committed GPU records (the
    claims test compares every line); without a record, no table claims a GPU result."""
    doc = REPO / "docs" / "PARITY.md"
    text = doc.read_text() if doc.exists() else ""
    regions = re.findall(r"<!-- generated by validation/parity_gpu --report (.+?), table \d -->",
                         text)
    named = sorted({path for region in regions for path in region.split()})
    assert named == sorted(str(p.relative_to(REPO)) for p in RECORDS)


def test_the_injection_without_its_capture(tmp_path: Path) -> None:
    """``MFSDP_VAL_MLM_INJECT=1``: the APEX stub and the shipped dataset helpers go into
    pretrain_gpt.py's process, but no capture (the command's own capture is the one read)."""
    from megatron_lm.launch import INJECT

    for module, body in (("megatron/training/training.py", "def train_step(): pass\n"),
                         ("megatron/core/datasets/utils.py", "def compile_helpers(): pass\n")):
        path = tmp_path / "site" / module
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(
        "import sys\nimport megatron.training.training as t\n"
        "import megatron.core.datasets.utils as u\n"
        "print('stub', 'fused_weight_gradient_mlp_cuda' in sys.modules)\n"
        "print('train_step', t.train_step.__qualname__)\n"
        "print('helpers', u.compile_helpers.__module__)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([INJECT, str(tmp_path / "site")]),
               MFSDP_HOTFIX_BOOTSTRAP="0", MFSDP_VAL_MLM_INJECT="1")
    env.pop("MFSDP_VAL_MLM_CAPTURE", None)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         cwd=tmp_path, timeout=300, check=True).stdout.splitlines()
    assert out == ["stub True", "train_step train_step", "helpers sitecustomize"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrain_gpt.py", "site"]


def test_the_floors_are_tied_to_the_recorded_verdicts() -> None:
    """A floor lowered below the noise a MATCH run measured, or raised over the difference of a
    MISMATCH run, disagrees with the record: in the committed records, none may."""
    from mfsdp_hotfix.parity.floors import FLOORS, Floor

    results = synthetic_record()["results"]
    assert floor_violations(results, FLOORS) == []
    low = dict(FLOORS, fp32=Floor("fp32", 1e-6, 1e-6, None, "too low"))
    assert any("MATCH recorded" in v and "dp1|zero1" in v
               for v in floor_violations(results, low))
    high = dict(FLOORS, fp32=Floor("fp32", 0.5, 0.5, None, "too high"))
    found = floor_violations(results, high)
    assert any("(shipped run)" in v and "MISMATCH recorded" in v for v in found)
    assert any("disabled" in v for v in found)
    from parity_gpu.record import read

    real = joined([read(str(path)) for path in RECORDS])
    assert floor_violations(real, FLOORS) == []


@pytest.mark.long  # a GPU driver end to end on the CPU: validation runs it
def test_two_cases_end_to_end_through_the_real_command(tmp_path: Path, monkeypatch) -> None:
    """The driver runs ``mfsdp-hotfix parity --json`` as the GPU call does, on a stand-in for
    pretrain_gpt.py (no GPU here; it prints Megatron-LM's lines, and without the hotfix a grad
    norm off by the size of the shipped defect): the hotfix's check records MATCH and, with
    ``--with-shipped``, the shipped run MISMATCH, each with the documented exit status."""
    monkeypatch.setattr(driver_module.engine, "te_state", lambda: "ready")
    monkeypatch.setattr(driver_module.engine, "te_env", lambda: {})
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the package, as `pip install .` would give it
    standin = REPO / "tests" / "parity" / "standin" / "pretrain_gpt.py"
    drv = Driver({"core-0.19.2": str(standin)}, {"core-0.19.2": str(tmp_path / "rel")},
                 str(tmp_path / "cases"), deadline=time.time() + 600, workers=2)
    cases = selected(("core-0.19.2",), ("dp1",), r"zero1\|te\|fused\|(fp32|bf16)\|gpt")
    assert [c["shipped"] for c in cases] == [True, False]
    results = drv.run_all(cases, log=lambda _line: None)
    by_shipped = {r["shipped"]: r for r in results}
    with_shipped, plain = by_shipped[True], by_shipped[False]
    assert with_shipped["verdict"] == "MATCH" and with_shipped["shipped_verdict"] == "MISMATCH"
    assert with_shipped["shipped_differences"]["first_grad_norm_rel"] == pytest.approx(
        0.016, rel=0.2)
    assert plain["verdict"] == "MATCH" and plain["rc"] == 0 and plain["rc_as_documented"]
    assert set(with_shipped["runs_read"]) == {"reference", "candidate", "shipped"}
    assert with_shipped["runs_read"]["reference"]["iterations"] == [1, 2, 3]
    lines = report([{"results": results}]).splitlines()
    assert any(line.startswith("| **MISMATCH** | MISMATCH | core-0.19.2 | TE | fp32 | 1 |")
               for line in lines)
