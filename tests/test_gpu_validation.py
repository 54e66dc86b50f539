"""The CPU side of the GPU validation engine (validation/harness.py, engine.py, fuzz.py,
te_matrix.py, gpu_phases.py, gpu_report.py): seeds, fault schedules, outcome rules, summaries
and case plans, and one end-to-end run of the smoke phase on CPU (real Megatron-FSDP, the
selftest's torch.cuda stand-in; nothing can race there, so every run that does not crash must
be bit-identical to its serialized run)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "validation"))

import engine  # noqa: E402
import fuzz  # noqa: E402
import gpu_phases  # noqa: E402
import gpu_report  # noqa: E402
import release_wheels  # noqa: E402
import schedule_faults  # noqa: E402
import serialized_truth  # noqa: E402
import te_layers  # noqa: E402
import te_matrix  # noqa: E402

RELEASES = list(release_wheels.RELEASED)  # the released ones; the N-slot trees have their own phase


def test_a_seed_is_its_configuration_and_schedule() -> None:
    draws = [fuzz.draw(s) for s in range(300)]
    assert draws == [fuzz.draw(s) for s in range(300)]
    assert len({json.dumps(d, sort_keys=True) for d in draws}) == 300
    for d in draws:
        sizes = [u["ffn"] for u in d["units"]]
        assert 3 <= len(sizes) <= 10 and 1 <= d["microbatches"] <= 4
        assert d["zero"] in (2, 3) and d["dtype"] in ("fp32", "bf16")
        assert max(sizes.count(f) for f in sizes) >= 3  # a pool of equal units
        assert sum(u["norm"] for u in d["units"]) <= 1
    for key, values in (("zero", {2, 3}), ("dtype", {"fp32", "bf16"}),
                        ("microbatches", {1, 2, 3, 4})):
        assert {d[key] for d in draws} == values
    assert {any(u["norm"] for u in d["units"]) for d in draws} == {True, False}
    te = sum(d["layer"] != "emulated" for d in draws)
    assert 40 < te < 110  # about a quarter
    for stream in schedule_faults.STREAMS:  # every stream is sometimes left undisturbed
        assert {d["faults"][stream].get("p", 0) > 0 for d in draws} == {True, False}


def test_a_seed_is_reproduced_from_its_number_by_the_command_line() -> None:
    cmd = [sys.executable, "validation/fuzz.py", "--release", "fsdp-0.6.1", "--seed", "17",
           "--show"]
    outs = [subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert outs[0] == outs[1]
    assert json.loads(outs[0]) == {"seed": 17, **fuzz.draw(17)}


def test_fault_schedules_repeat_per_stream_and_respect_their_budget() -> None:
    faults = fuzz.draw(5)["faults"]

    def sequence() -> list[float]:
        sched = schedule_faults.Schedule.from_dict(faults, 0.0)
        return [sched.draw(s) for _ in range(50) for s in schedule_faults.STREAMS]

    assert sequence() == sequence()
    sched = schedule_faults.Schedule.from_dict(
        {"seed": 1, "rs": {"fixed_ms": 20.0}, "budget_ms": 50.0}, 0.0)
    assert [sched.draw("rs") for _ in range(4)] == [20.0, 20.0, 0.0, 0.0]
    assert sched.report()["delayed"]["rs"] == 2 and sched.report()["calls"]["rs"] == 4
    off = schedule_faults.Schedule.from_dict({"seed": 1}, 0.0)
    assert {off.draw(s) for s in schedule_faults.STREAMS for _ in range(20)} == {0.0}


def run(grads: list[list[float]], losses: list[float], params: list[float] | None = None
        ) -> dict[str, object]:
    return {"grads": [torch.tensor(g) for g in grads], "losses": torch.tensor(losses),
            "params": None if params is None else torch.tensor(params)}


def test_outcome_is_exact_only_when_every_bit_is_the_same() -> None:
    """The harness's record of mfsdp_hotfix/compare.py: gradients per step, losses and final
    parameters with the last step, and how much it compared."""
    ref = run([[1.0, 0.0], [2.0, 3.0]], [0.5, 0.25], [1.0, 2.0])
    same = serialized_truth.compare(run([[1.0, 0.0], [2.0, 3.0]], [0.5, 0.25], [1.0, 2.0]), ref)
    assert same["outcome"] == "exact" and same["max_abs_diff"] == 0.0 and same["rel_l2"] == 0.0
    assert (same["steps_compared"], same["tensors_compared"]) == (2, 4)
    assert same["losses_exact"] and same["params_exact"]
    grad = serialized_truth.compare(run([[1.0, 0.0], [2.0, 3.5]], [0.5, 0.25], [1.0, 2.0]), ref)
    assert grad["outcome"] == "wrong" and grad["max_abs_diff"] == 0.5
    assert grad["first_bad_step"] == 1
    signed_zero = serialized_truth.compare(run([[1.0, -0.0], [2.0, 3.0]], [0.5, 0.25],
                                               [1.0, 2.0]), ref)
    assert signed_zero["outcome"] == "wrong" and signed_zero["max_abs_diff"] == 0.0
    loss = serialized_truth.compare(run([[1.0, 0.0], [2.0, 3.0]], [0.5, 0.3], [1.0, 2.0]), ref)
    assert loss["outcome"] == "wrong" and loss["losses_exact"] is False
    param = serialized_truth.compare(run([[1.0, 0.0], [2.0, 3.0]], [0.5, 0.25], [1.0, 2.5]), ref)
    assert param["outcome"] == "wrong" and param["params_exact"] is False
    nothing = serialized_truth.compare(run([], [0.5]), run([], [0.5]))
    assert nothing["outcome"] == "wrong" and nothing["not_exact_because"] == ["no step compared"]
    nan = serialized_truth.compare(run([[float("nan")]], [0.5]), run([[float("nan")]], [0.5]))
    assert nan["outcome"] == "wrong" and nan["max_abs_diff"] is None
    assert serialized_truth.digest(ref) == serialized_truth.digest(
        run([[1.0, 0.0], [2.0, 3.0]], [0.5, 0.25], [1.0, 2.0]))


def record(phase: str, release: str, variant: str, **kw: object) -> dict[str, object]:
    spec = {"phase": phase, "release": release, "variant": variant,
            "truth": {"mode": "compare", "path": "x"}, **kw.pop("spec", {})}  # type: ignore[dict-item]
    return {"id": f"{release}|{variant}|{json.dumps(spec, sort_keys=True)}", "spec": spec,
            "crashed": False, **kw}


def test_summary_records_have_exactly_the_required_keys_and_outcome_rules() -> None:
    recs = [
        record("fuzz", "fsdp-0.5.1", "shipped", spec={"seed": 1},
               comparison={"outcome": "wrong", "max_abs_diff": 0.05, "rel_l2": 0.5}),
        record("fuzz", "fsdp-0.5.1", "hotfix", spec={"seed": 1},
               comparison={"outcome": "exact", "max_abs_diff": 0.0, "rel_l2": 0.0}),
        record("fuzz", "fsdp-0.4.0", "shipped", spec={"seed": 2}, crashed=True,
               error="AssertionError: No buffer found",
               comparison={"outcome": "crash", "max_abs_diff": None}),
        record("fuzz", "fsdp-0.4.0", "hotfix", spec={"seed": 2},  # its serialized run crashed
               comparison={"outcome": "crash", "max_abs_diff": None, "truth_crashed": True}),
        record("fuzz", "fsdp-0.6.1", "shipped", spec={"seed": 3},
               skipped="not run: --budget-s reached before it started"),
        {"id": "truth", "spec": {"phase": "fuzz", "release": "fsdp-0.6.1", "seed": 3,
                                 "variant": "shipped", "truth": {"mode": "save", "path": "x"}},
         "crashed": False},
    ]
    rows = gpu_report.fuzz_summary(recs)
    assert all(tuple(r) == gpu_report.FUZZ_KEYS for r in rows)
    assert [(r["release"], r["seed"], r["variant"], r["outcome"], r["max_abs_diff"])
            for r in rows] == [("fsdp-0.4.0", 2, "hotfix", "crash", None),
                               ("fsdp-0.4.0", 2, "shipped", "crash", None),
                               ("fsdp-0.5.1", 1, "hotfix", "exact", 0.0),
                               ("fsdp-0.5.1", 1, "shipped", "wrong", 0.05)]
    te = [record("te", "core-0.19.2", "shipped-audit",
                 spec={"layer": "te-linear", "fuse": False, "zero": 3, "delay_ms": 20,
                       "dtype": "bf16", "te_variant": "shipped", "delay_wgrad": False},
                 te_version="2.20.2", audit={"reuses": 16, "unordered": 12, "unseen": 0},
                 comparison={"outcome": "wrong", "max_abs_diff": 0.1, "rel_l2": 0.7})]
    (row,) = gpu_report.te_summary(te)
    assert tuple(row)[:len(gpu_report.TE_KEYS)] == gpu_report.TE_KEYS
    assert {k: row[k] for k in gpu_report.TE_KEYS} == {
        "release": "core-0.19.2", "layer": "te-linear", "fuse": False, "zero": 3, "delay_ms": 20,
        "dtype": "bf16", "variant": "shipped", "te_version": "2.20.2", "outcome": "wrong",
        "rel_l2": 0.7}
    assert (row["audit_unordered"], row["audit_reuses"]) == (12, 16)


def test_a_configuration_the_release_cannot_run_is_unsupported_not_a_crash() -> None:
    spec = {"layer": "te-linear", "fuse": True, "zero": 2, "delay_ms": 0, "dtype": "fp32",
            "te_variant": "hotfix", "delay_wgrad": True}
    refusal = ("RuntimeError: delay_wgrad_compute: 8 parameters marked skip_backward_post_hook "
               "after wrapping, 0 with Megatron-FSDP's post_wgrad_grad_acc_hook: not supported "
               "by this release")
    flagged = record("te", "fsdp-0.4.0", "hotfix-audit", spec=spec, unsupported=True,
                     error=refusal, comparison={"outcome": "unsupported"})
    older = record("te", "fsdp-0.4.0", "shipped-audit", spec=dict(spec, te_variant="shipped"),
                   crashed=True, error=refusal, comparison={"outcome": "crash"})
    crash = record("te", "fsdp-0.5.1", "hotfix-audit", spec=spec, crashed=True,
                   error="AssertionError: No buffer found", comparison={"outcome": "crash"})
    assert [gpu_report.outcome(r) for r in (flagged, older, crash)] == [
        "unsupported", "unsupported", "crash"]
    rows = gpu_report.te_summary([flagged, older])
    assert {r["outcome"] for r in rows} == {"unsupported"} and all(r["error"] for r in rows)
    assert "unsupported by the release" in gpu_report.te_table(rows)
    exact_nan = record("fuzz", "fsdp-0.5.1", "hotfix", spec={"seed": 1}, nonfinite_grads=True,
                       comparison={"outcome": "exact", "max_abs_diff": 0.0})
    assert gpu_report.outcome(exact_nan) == "wrong"  # an older record's NaN-blind verdict


def test_each_committed_raw_file_holds_only_its_own_runs_cases() -> None:
    """No record of an earlier GPU run on the same machine: every record is of the file's
    phase, once, and started after the run did."""
    import calendar

    for path in sorted((REPO / "docs" / "validation").glob("gpu-*.json.gz")):
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
        start = calendar.timegm(time.strptime(doc["date_utc"], "%Y-%m-%d %H:%M:%S"))
        cases = [(r["spec"]["phase"], r["id"]) for r in doc["records"]]
        assert len(cases) == len(set(cases)), path.name
        # the smoke phase runs a few cases of each other phase, as smoke-<phase>
        assert all(phase == doc["phase"] or (doc["phase"] == "smoke" and phase.startswith(
            "smoke-")) for phase, _ in cases), path.name
        assert all(r["t_start"] >= start for r in doc["records"] if "t_start" in r), path.name


def test_fuzz_plan_writes_each_truth_before_its_comparison_in_every_era() -> None:
    jobs = fuzz.plan(RELEASES, list(range(100)), te_available=True)
    seen_truths: set[str] = set()
    per: dict[tuple[str, str], set[int]] = {}
    for j in jobs:
        for s in j["specs"]:
            assert s["fix"] == engine.VARIANTS[s["variant"]][0]
            if s["truth"]["mode"] == "save":
                assert j["serialized"] and j["env"]["CUDA_LAUNCH_BLOCKING"] == "1"
                seen_truths.add(s["truth"]["path"])
            else:
                assert not j["serialized"] and "CUDA_LAUNCH_BLOCKING" not in j["env"]
                assert s["truth"]["path"] in seen_truths  # queued after its truth
                assert f"/{s['variant']}/" in s["truth"]["path"]  # its own variant's truth
                per.setdefault((s["release"], s["variant"]), set()).add(s["seed"])
        assert j["te"] == any(s["layer"] != "emulated" for s in j["specs"])
        assert all((s["layer"] != "emulated") == j["te"] for s in j["specs"])
    assert set(per) == {(r, v) for r in RELEASES for v in ("shipped", "hotfix")}
    assert all(seeds == set(range(100)) for seeds in per.values())


def test_te_plan_covers_the_matrix_with_the_audit_beside_each_row() -> None:
    jobs = te_matrix.plan(RELEASES)
    runs = [(j, s) for j in jobs for s in j["specs"] if s["truth"]["mode"] == "compare"]
    cells = {(s["release"], s["layer"], s["fuse"], s["delay_wgrad"], s["zero"], s["delay_ms"],
              s["dtype"], s["te_variant"]) for _, s in runs}
    assert len(cells) == len(runs) == 5 * len(te_matrix.LAYERS) * 2 * 2 * 2 * 2
    assert {c[1] for c in cells} == set(te_layers.FAMILIES)
    for j, s in runs:
        assert j["te"] and j["env"]["MFSDP_HOTFIX_AUDIT"]
        assert s["fix"] == "hotfix"  # the audit needs the package imported
        assert (j["env"].get("MFSDP_HOTFIX") == "0") == (s["te_variant"] == "shipped")


def test_phases_plan_without_a_gpu() -> None:
    out = subprocess.run([sys.executable, "validation/gpu_phases.py", "--dry", "--phases",
                          *gpu_phases.PHASES], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    for phase in gpu_phases.PHASES:
        assert f"== {phase}:" in out
    for release in te_matrix.MAXPOOL_RELEASES:  # MaxPoolAllocator exists from 0.6 / 0.19 on
        assert f"maxpool/{release}/shipped/0/0:" in out
    assert "maxpool/fsdp-0.5.1" not in out
    for release in RELEASES:
        assert f"long/{release}/hotfix:" in out
        assert f"oracles/{release}/shipped/emu/sanitizer" in out


def test_seeds_take_a_range_and_say_so() -> None:
    for bad in ("100", "5:2", "a:b"):
        proc = subprocess.run([sys.executable, "validation/gpu_phases.py", "--dry", "--phases",
                               "fuzz", "--seeds", bad], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "give a range LO:HI" in proc.stderr
    assert gpu_phases.seed_range("3:7") == (3, 7)


@pytest.fixture()
def wheels(tmp_path: Path) -> Path:
    import releases

    folder = tmp_path / "wheels"
    folder.mkdir()
    shutil.copy(releases.wheel("megatron-fsdp", "0.4.0"), folder)
    return folder


def run_on_cpu(wheels: Path, work: Path, out: Path, phase: str) -> dict[str, Any]:
    """One CPU run of gpu_phases.py (megatron-fsdp 0.4.0, tiny cases) with MFSDP_VAL_WORK=work;
    its raw file holds exactly its own cases, once each, started during this run."""
    env = dict(os.environ, MFSDP_VAL_WORK=str(work), PYTHONWARNINGS="ignore")
    started = time.time()
    proc = subprocess.run([sys.executable, "validation/gpu_phases.py", "--cpu", "--tiny",
                           "--phases", phase, "--releases", "fsdp-0.4.0", "--wheels",
                           str(wheels), "--out", str(out), "--workers", "2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with gzip.open(out / f"{phase}.json.gz", "rt") as f:
        doc: dict[str, Any] = json.load(f)
    recs = doc["records"]
    cases = [(r["spec"]["phase"], r["id"]) for r in recs]
    assert len(cases) == len(set(cases))
    assert {r["job"]["run"] for r in recs} == {doc["run"]}
    assert all(r["t_start"] >= started for r in recs if "t_start" in r)
    compared = [r["comparison"] for r in recs if "comparison" in r]
    assert compared and all("steps_compared" in c and "tensors_compared" in c for c in compared)
    return doc


def job_files(work: Path, run: str) -> dict[str, str]:
    return {p.name: p.read_text() for p in (work / "runs" / run / "jobs").glob("*.jsonl")}


@pytest.mark.long  # a GPU driver end to end on the CPU: validation runs it
def test_smoke_phase_runs_end_to_end_on_cpu(wheels: Path, tmp_path: Path) -> None:
    """Real megatron-fsdp 0.4.0 (era A) through the engine, its worker processes, truths,
    optimizer steps, the audit and the report. On CPU nothing races: the shipped release
    crashes ('No buffer found') or is exact, the hotfix is always exact. Then a second run in
    the same work folder (a machine kept between runs): the two runs do not mix."""
    out, work = tmp_path / "out", tmp_path / "work"
    doc = run_on_cpu(wheels, work, out, "smoke")
    first = job_files(work, doc["run"])
    second = run_on_cpu(wheels, work, tmp_path / "out2", "long")
    assert second["run"] != doc["run"] and len(second["records"]) == 12  # 2 variants x 2 ZeRO x 3
    assert job_files(work, doc["run"]) == first  # the first run's files are untouched
    recs = doc["records"]
    assert doc["complete"] and not [r for r in recs if r.get("skipped")]
    fuzz_rows = gpu_report.fuzz_summary(recs, smoke=True)
    assert {r["variant"] for r in fuzz_rows} == {"shipped", "hotfix"}
    assert all(r["outcome"] == "exact" for r in fuzz_rows if r["variant"] == "hotfix")
    assert all(r["outcome"] in ("exact", "crash") for r in fuzz_rows)
    crashes = [r for r in recs if r.get("crashed")]
    assert all("No buffer found" in r["error"] for r in crashes), [r["error"] for r in crashes]
    long_rows = gpu_report.long_summary(recs, smoke=True)
    assert {r["variant"] for r in long_rows} == {"shipped", "hotfix"}
    for r in long_rows:
        if r["variant"] == "hotfix":
            assert r["outcome"] == "exact" and r["losses_exact"] and r["params_exact"]
    oracles = gpu_report.oracle_summary(recs, smoke=True)
    hot = [r for r in oracles if r["variant"] == "hotfix"]
    assert hot and all(r["audit_reuses"] is not None and r["audit_unordered"] == 0 for r in hot)
    assert all(r["sanitizer"] for r in oracles)
    report = subprocess.run([sys.executable, "validation/gpu_report.py", "--include-smoke",
                             str(out / "smoke.json.gz")], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout
    assert "| fsdp-0.4.0 | hotfix | emulated |" in report


DELAYED_WGRAD = """
import json, sys
sys.path.insert(0, "validation"); sys.path.insert(0, "tests")
import fake_te, harness, serialized_truth, te_layers, torch
te_layers.import_te = lambda: fake_te.te
out = {}
for fuse, dw in ((True, False), (True, True), (False, True)):
    path = f"{sys.argv[1]}/{fuse}_{dw}.pt"
    r = harness.run_case(dict(pkg="megatron_fsdp", zero=3, hidden=32, units=4, ffn=64, tokens=16,
                              microbatches=2, steps=2, layer="te-linear", fuse=fuse,
                              delay_wgrad=dw, truth={"mode": "save", "path": path}))
    out[f"{fuse}_{dw}"] = {"error": r["error"], "hooks": r.get("delay_wgrad_hooks"),
                           "unsupported": r.get("unsupported"), "crashed": r["crashed"],
                           "same": None if r["error"] else serialized_truth.compare(
                               torch.load(path), torch.load(f"{sys.argv[1]}/True_False.pt")
                           )["outcome"]}
print(json.dumps(out))
"""


@pytest.mark.parametrize("version", ["0.6.1", "0.4.0"])
def test_delayed_wgrad_runs_megatron_fsdp_hooks_after_backward_dw(fsdp_release, tmp_path: Path,
                                                                  version: str) -> None:
    """With delay_wgrad_compute the unit runs each layer's backward_dw() and then Megatron-FSDP's
    post_wgrad_grad_acc_hook of each marked parameter: the gradients equal those of the
    undelayed run (CPU: no race). A release without that hook (0.4.0) is refused."""
    env = dict(os.environ, MFSDP_VAL_CPU="1", MFSDP_HOTFIX="0", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(fsdp_release(version)), str(REPO)]))
    proc = subprocess.run([sys.executable, "-c", DELAYED_WGRAD, str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if version == "0.6.1":
        for key in ("True_True", "False_True"):
            assert out[key]["hooks"] == {"marked": 8, "hooked": 8}, out
            assert out[key]["same"] == "exact", out
    else:
        for key in ("True_True", "False_True"):
            assert "not supported by this release" in out[key]["error"], out
            assert out[key]["unsupported"] and not out[key]["crashed"], out  # not a crash
