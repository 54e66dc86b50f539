"""The CPU side of validation/megatron_lm/ (Megatron-LM's pretrain_gpt.py on one GPU): the plan
covers the matrix, the command lines are what each dimension asks for and the releases' own
argument parser accepts them, a checkout is checked against the wheel by content, the injected
sitecustomize stays out of other processes and chains on, and the record schema and outcome
rules hold. The GPU records themselves are tied to docs by tests/test_claims.py."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "validation"))
import releases  # noqa: E402
import workdir  # noqa: E402
from megatron_lm import driver  # noqa: E402
from megatron_lm.arguments import parse_check, pretrain_args  # noqa: E402
from megatron_lm.driver import FAIL_FAST, MIN_START_S, Driver  # noqa: E402
from megatron_lm.launch import INJECT, Paths, command  # noqa: E402
from megatron_lm.outcome import OUTCOMES, classify  # noqa: E402
from megatron_lm.plan import (  # noqa: E402
    AUDITS,
    MICROBATCHES,
    RELEASES,
    SIZE,
    UNIT_TESTS,
    VARIANTS,
    case,
    plan,
    truth_variant,
)
from megatron_lm.record import serialized_pairs  # noqa: E402
from megatron_lm.stage import (  # noqa: E402
    REVISIONS,
    SCRIPTS,
    git_blob_sha1,
    matches,
    missing_test_modules,
    stage_sources,
    training_differences,
)
from megatron_lm.summary import (  # noqa: E402
    ROW_KEYS,
    joined,
    read,
    row,
    summary,
    te_versions,
    unit_test_table,
)
from megatron_lm.tables import report_tables  # noqa: E402
from megatron_lm.unit_tests import (  # noqa: E402
    PROBE,
    collect_unit_tests,
    run_unit_tests,
    unit_test_ends,
)


def test_the_plan_covers_every_dimension_with_a_serialized_truth_for_each_run() -> None:
    cases = plan()
    runs = [c for c in cases if c["group"] != "unit"]
    serialized = {(c["config"], c["variant"]) for c in runs if c["serialized"]}
    for c in runs:
        if not c["serialized"]:
            assert (c["config"], truth_variant(c)) in serialized, c["id"]
    for rel in RELEASES:
        for zero in (3, 2):
            for dtype in ("fp32", "bf16"):
                for variant in VARIANTS:
                    for run in ("serialized", "d0", "d20"):
                        assert f"{rel}|dp2|zero{zero}|{dtype}|{variant}|{run}" in \
                            {c["id"] for c in cases}
        ids = {c["id"] for c in cases}
        for config in ("zero1|fp32", "zero1|fp32|no-overlap", "zero3|fp8",
                       "zero3|bf16|recompute", "zero3|bf16|moe"):
            for variant in VARIANTS:
                assert f"{rel}|dp2|{config}|{variant}|d20" in ids, (rel, config)
        for variant in ("shipped", "hotfix"):
            assert f"{rel}|unit-tests|{variant}" in ids
        for audit in AUDITS:
            assert f"{rel}|dp2|zero3|fp32|{audit}|d20" in ids
    first = RELEASES[0]
    for variant in ("shipped", "hotfix", *AUDITS):
        assert any(c["id"].startswith(f"{first}|dp1|zero3|fp32|{variant}|") for c in cases)
    assert all(c["launcher"] == "torchrun" for c in runs if c["dp"] == 1)
    local = plan(groups=("local", "dp1-local"))
    assert local and all(c["impl"] == "local" and "|local|" in c["id"] for c in local)
    assert {c["id"].replace("|local", "") for c in local if c["group"] == "local"} == \
        {c["id"] for c in cases if c["group"] == "core"}
    # the order of --groups is the order of the runs
    groups = [c["group"] for c in plan(groups=("dp1", "local"))]
    assert groups == sorted(groups, key=("dp1", "local").index)


def test_each_dimension_is_its_own_flag_and_the_batch_is_four_microbatches() -> None:
    def flags(**kw: Any) -> list[str]:
        return pretrain_args(case("core", "core-0.19.2", **kw))

    base = flags()
    for flag in ("--use-megatron-fsdp", "--fsdp-double-buffer", "--overlap-grad-reduce",
                 "--overlap-param-gather", "--fake-process-group", "--mock-data"):
        assert flag in base
    assert base[base.index("--ckpt-format") + 1] == "fsdp_dtensor"
    assert base[base.index("--transformer-impl") + 1] == "transformer_engine"
    assert "--no-gradient-accumulation-fusion" not in base  # fusion is the default
    size = SIZE
    assert int(base[base.index("--global-batch-size") + 1]) == MICROBATCHES * size["mbs"] * 2
    assert "--fsdp-double-buffer" not in flags(variant="db-off")
    off = flags(zero=1, ogr=False)
    assert "--overlap-grad-reduce" not in off and "--overlap-param-gather" not in off
    assert off[off.index("--data-parallel-sharding-strategy") + 1] == "optim"
    fp8 = flags(dtype="fp8")
    assert "--bf16" in fp8 and fp8[fp8.index("--fp8-format") + 1] == "hybrid"
    assert "--recompute-granularity" in flags(recompute=True)
    assert "--moe-grouped-gemm" in flags(moe=True)
    dp1 = flags(dp=1)
    assert "--fake-process-group" not in dp1
    assert int(dp1[dp1.index("--global-batch-size") + 1]) == MICROBATCHES * size["mbs"]
    local = flags(impl="local")
    assert local[local.index("--transformer-impl") + 1] == "local"
    assert "--no-gradient-accumulation-fusion" in local
    # the local layers refuse Megatron-LM's default --persist-layer-norm (a GPU run stopped so)
    assert "--no-persist-layer-norm" in local and "--no-persist-layer-norm" not in flags()


@pytest.mark.parametrize("release, kw", [
    ("core-0.19.2", dict(dtype="fp8")),
    ("core-0.19.2", dict(dp=1)),
    ("core-0.18.2", dict(dtype="bf16", moe=True)),
    ("core-0.18.2", dict(zero=1, ogr=False, variant="db-off")),
])
def test_the_releases_own_parser_takes_the_command_line_as_meant(release: str,
                                                                  kw: dict[str, Any]) -> None:
    c = case("core", release, **kw)
    parsed = parse_check(str(releases.unpacked("megatron-core", release.split("-")[1])), c)
    assert parsed["data_parallel_size"] == c["dp"]
    assert parsed["num_microbatches"] == MICROBATCHES
    assert parsed["use_megatron_fsdp"] and parsed["use_distributed_optimizer"]
    assert parsed["data_parallel_sharding_strategy"] == c["sharding"]
    assert parsed["fsdp_double_buffer"] == c["db"]
    assert parsed["overlap_grad_reduce"] == c["overlap_grad_reduce"]
    assert parsed["gradient_accumulation_fusion"] is True
    assert parsed["fake_process_group"] == (c["dp"] == 2)
    assert parsed["bf16"] == (c["dtype"] != "fp32")
    assert parsed["fp8"] == ("hybrid" if c["dtype"] == "fp8" else None)
    assert (parsed["num_experts"] or 0) == (SIZE["experts"] if c["moe"] else 0)


def test_a_checkout_is_the_wheels_only_when_every_training_file_is_the_same(tmp_path: Path
                                                                           ) -> None:
    wheel, checkout = tmp_path / "wheel", tmp_path / "checkout"
    for root in (wheel, checkout):
        (root / "megatron" / "training" / "utils").mkdir(parents=True)
        (root / "megatron" / "training" / "training.py").write_text("def train_step(): ...\n")
        (root / "megatron" / "training" / "utils" / "common.py").write_text("X = 1\n")
    assert matches(training_differences(str(checkout), str(wheel)))
    (checkout / "megatron" / "training" / "utils" / "common.py").write_text("X = 2\n")
    diff = training_differences(str(checkout), str(wheel))
    assert diff["differing"] == ["megatron/training/utils/common.py"] and not matches(diff)
    (checkout / "megatron" / "training" / "utils" / "common.py").write_text("X = 1\n")
    (checkout / "megatron" / "training" / "extra.py").write_text("")
    assert training_differences(str(checkout), str(wheel))["only_in_checkout"] == [
        "megatron/training/extra.py"]
    # the blob id is git's, so a tree compares with `git ls-tree` too
    assert git_blob_sha1(str(checkout / "megatron" / "training" / "extra.py")) == \
        "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"


def _archive(tmp_path: Path, ref: str, folder: str) -> Path:
    """``folder`` of the Megatron-LM clone at ``ref``, unpacked under ``tmp_path``."""
    out = tmp_path / ref
    out.mkdir()
    archive = subprocess.run(["git", "--git-dir", str(releases.MEGATRON_LM_GIT), "archive",
                              ref, folder], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


@pytest.mark.skipif(releases.MEGATRON_LM_GIT is None, reason="needs MFSDP_TEST_MEGATRON_LM "
                    "(a Megatron-LM git dir)")
def test_the_documented_revisions_are_the_wheels_training_code(tmp_path: Path) -> None:
    for release, ref in REVISIONS.items():
        out = _archive(tmp_path, ref, "megatron/training")
        for other in RELEASES:
            wheel = releases.unpacked("megatron-core", other.split("-")[1])
            assert matches(training_differences(str(out), str(wheel))) == \
                (other == release), (ref, other)


def test_a_checkout_without_a_module_the_unit_tests_import_is_found_before_any_run(
        tmp_path: Path, monkeypatch: Any) -> None:
    def write(rel: str, text: str = "") -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    write("tests/unit_tests/conftest.py", "from tests.unit_tests.dist import TempDir\n"
                                          "import torch\nfrom . import local\n")
    write("tests/unit_tests/dist/__init__.py", "from tests.unit_tests.dist.utils import x\n")
    write("tests/unit_tests/fsdp/test_a.py", "import tests.unit_tests.helpers as h\n"
                                             "from tests.unit_tests.fsdp.utils import y\n")
    write("tests/unit_tests/fsdp/utils.py")
    assert missing_test_modules(str(tmp_path), "tests/unit_tests/fsdp") == [
        "tests.unit_tests.dist.utils", "tests.unit_tests.helpers"]
    write("tests/unit_tests/dist/utils.py")
    write("tests/unit_tests/helpers.py")
    assert missing_test_modules(str(tmp_path), "tests/unit_tests/fsdp") == []
    # the driver does not start the unit tests of a release whose checkout lacks one
    monkeypatch.setattr(workdir, "run_dir", lambda: str(tmp_path))
    paths = Paths({"core-0.19.2": str(tmp_path)}, {"core-0.19.2": str(tmp_path)},
                      {"core-0.19.2": ["tests.unit_tests.dist.utils"]})
    drv = Driver(paths, 1000.0, time.time() + 3600, 1, 240.0, 300.0)
    monkeypatch.setattr(driver, "run_unit_tests", lambda *a: pytest.fail("started"))
    (unit,) = [c for c in plan(groups=("unit@core-0.19.2",)) if c["variant"] == "shipped"]
    r = drv.one(unit)
    assert r["outcome"] == "not run" and r["error"].endswith(": tests.unit_tests.dist.utils")


def _write(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_unit_tests_are_collected_where_they_will_run_before_they_run(
        tmp_path: Path, monkeypatch: Any) -> None:
    """Real pytest through torchrun (and ``mfsdp_hotfix run``), on a checkout whose test imports
    a module at the checkout's root, as 0.19's import ``hybrid_builders``."""
    checkout, release, rel = tmp_path / "mlm", tmp_path / "wheel", "core-0.19.2"
    for root in (checkout, release):
        _write(root / "megatron" / "training" / "__init__.py", "# the same file\n")
    for name in SCRIPTS:
        _write(checkout / name)
    _write(checkout / "hybrid_builders.py", "VALUE = 1\n")
    folder = UNIT_TESTS[rel]
    _write(checkout / folder / "test_a.py", "from hybrid_builders import VALUE\n\n\n"
                                            "def test_a():\n    assert VALUE == 1\n")
    monkeypatch.setattr(workdir, "run_dir", lambda: str(tmp_path / "run"))
    src, checks = stage_sources({rel: str(checkout)}, {rel: str(release)})
    assert checks[rel]["matches"] and checks[rel]["missing_scripts"] == []
    paths = Paths({rel: str(release)}, src)
    unit = {c["variant"]: c for c in plan(groups=(f"unit@{rel}",))}
    for variant in ("shipped", "hotfix"):
        got = collect_unit_tests(unit[variant], paths, 300)
        assert got["errors"] == [], got
        assert got["ids"] == [f"{folder}/test_a.py::test_a"]
        assert got["hotfix"]["loaded"] is (variant == "hotfix")
    # a run "as shipped" that loads the hotfix anyway is refused, not compared
    site = tmp_path / "site"
    _write(site / "sitecustomize.py", "import mfsdp_hotfix\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    got = collect_unit_tests(unit["shipped"], paths, 300)
    assert got["errors"] == ["harness: the hotfix loaded=True in the shipped unit tests' "
                             "process"]
    monkeypatch.delenv("PYTHONPATH")
    # a module of the root left behind: found in seconds, and no test run is started
    (Path(src[rel]) / "hybrid_builders.py").unlink()
    drv = Driver(paths, 1000.0, time.time() + 3600, 1, 240.0, 300.0)
    monkeypatch.setattr(driver, "run_unit_tests", lambda *a: pytest.fail("started"))
    r = drv.one(unit["shipped"])
    assert r["outcome"] == "not run"
    assert "No module named 'hybrid_builders'" in r["error"], r["error"]


@pytest.mark.long  # a GPU driver end to end on the CPU: validation runs it
def test_a_unit_test_file_past_its_limit_is_killed_with_its_worker_and_keeps_what_it_ended(
        tmp_path: Path, monkeypatch: Any) -> None:
    checkout, release, rel = tmp_path / "mlm", tmp_path / "wheel", "core-0.18.2"
    for root in (checkout, release):
        _write(root / "megatron" / "training" / "__init__.py")
    for name in SCRIPTS:
        _write(checkout / name)
    folder = checkout / UNIT_TESTS[rel]
    _write(folder / "test_quick.py", "import pytest\n\ndef test_a():\n    pass\n\n"
                                     "def test_b():\n    pytest.skip('needs 8 GPUs')\n")
    pid_file = tmp_path / "worker.pid"
    _write(folder / "test_hang.py", f"import os, time\n\ndef test_first():\n    pass\n\n"
                                    f"def test_hang():\n"
                                    f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                                    f"    time.sleep(300)\n")
    monkeypatch.setattr(workdir, "run_dir", lambda: str(tmp_path / "run"))
    src, _ = stage_sources({rel: str(checkout)}, {rel: str(release)})
    paths = Paths({rel: str(release)}, src)
    (unit,) = [c for c in plan(groups=(f"unit@{rel}",)) if c["variant"] == "shipped"]
    collected = collect_unit_tests(unit, paths, 300)["ids"]
    assert len(collected) == 4
    r = run_unit_tests(unit, paths, 60.0, collected)
    base = UNIT_TESTS[rel]
    assert r["tests"] == {f"{base}/test_quick.py::test_a": "passed",
                          f"{base}/test_quick.py::test_b": "skipped: needs 8 GPUs",
                          f"{base}/test_hang.py::test_first": "passed"}
    assert r["outcome"] == "ok" and r["cut"] and r["error"].endswith("test_hang.py")
    assert r["hotfix"] == {"loaded": False}
    # the pytest worker that torchrun started is gone too (it would hold the GPU)
    pid = pid_file.read_text()
    for _ in range(50):
        state = Path(f"/proc/{pid}/stat")
        if not state.exists() or state.read_text().split(") ")[1][0] in "ZX":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the worker {pid} still runs")
    table = unit_test_table([r])
    assert table[rel]["cut"] == {"shipped": r["error"]}


def test_a_checkout_without_pretrain_gpts_scripts_is_not_staged(tmp_path: Path,
                                                               monkeypatch: Any) -> None:
    checkout, release = tmp_path / "mlm", tmp_path / "wheel"
    for root in (checkout, release):
        _write(root / "megatron" / "training" / "__init__.py")
    _write(checkout / "pretrain_gpt.py")
    monkeypatch.setattr(workdir, "run_dir", lambda: str(tmp_path / "run"))
    src, checks = stage_sources({"core-0.18.2": str(checkout)},
                                    {"core-0.18.2": str(release)})
    assert src == {} and checks["core-0.18.2"]["missing_scripts"] == [
        "gpt_builders.py", "model_provider.py"]


@pytest.mark.skipif(releases.MEGATRON_LM_GIT is None, reason="needs MFSDP_TEST_MEGATRON_LM "
                    "(a Megatron-LM git dir)")
def test_the_documented_revisions_hold_every_module_their_unit_tests_import(
        tmp_path: Path) -> None:
    for release, ref in REVISIONS.items():
        out = _archive(tmp_path, ref, "tests")
        assert missing_test_modules(str(out), UNIT_TESTS[release]) == [], ref
        # a checkout given in part (as one GPU call once was) is found out
        (out / "tests" / "unit_tests" / "dist_checkpointing" / "utils.py").unlink()
        assert "tests.unit_tests.dist_checkpointing.utils" in \
            missing_test_modules(str(out), UNIT_TESTS[release])


def _run_with_inject(tmp_path: Path, script: str) -> tuple[str, Path]:
    """Run a script named ``script`` with the injected sitecustomize first on PYTHONPATH and a
    second sitecustomize after it (which must still run)."""
    tmp_path.mkdir()
    nxt = tmp_path / "next"
    nxt.mkdir()
    (nxt / "sitecustomize.py").write_text("print('next sitecustomize ran')\n")
    body = tmp_path / script
    body.write_text("import sys\nprint('script ran')\nsys.exit(0)\n")
    cap = tmp_path / "cap"
    cap.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([INJECT, str(nxt)]),
               MFSDP_HOTFIX_BOOTSTRAP="0", MFSDP_VAL_MLM_CAPTURE=str(cap))
    out = subprocess.run([sys.executable, str(body)], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return out, cap


def test_the_injection_acts_only_in_pretrain_gpt_and_chains_to_the_next_sitecustomize(
        tmp_path: Path) -> None:
    out, cap = _run_with_inject(tmp_path / "other", "train.py")
    assert "next sitecustomize ran" in out and "script ran" in out
    assert not list(cap.iterdir())  # not pretrain_gpt.py: nothing done
    out, cap = _run_with_inject(tmp_path / "pretrain", "pretrain_gpt.py")
    assert "next sitecustomize ran" in out
    state = json.loads((cap / "capture.json").read_text())
    assert state["stages"] == ["started"] and state["iterations"] == 0
    assert state["hotfix_loaded"] is False  # the shipped route imports nothing of the package
    assert "fused_weight_gradient_mlp_cuda" not in out


def _record(outcome: str, **kw: Any) -> dict[str, Any]:
    c = case("core", "core-0.19.2", variant="shipped", delay_ms=20)
    return dict(c, outcome=outcome, **kw)


def test_a_run_refused_before_its_first_iteration_is_unsupported_and_a_later_failure_a_crash(
        ) -> None:
    before = {"stages": ["started"], "iterations": 0}
    during = {"stages": ["started", "training"], "iterations": 1}
    assert classify(1, before, 3, "AssertionError: not supported with X", None) == \
        "unsupported"
    assert classify(1, before, 3, "TypeError: int // None", None) == "crash"
    assert classify(1, during, 3, "AssertionError: No buffer found", None) == "crash"
    assert classify(0, during, 3, None, None) == "crash"  # fewer iterations than planned
    done = {"stages": ["started", "training"], "iterations": 3}
    assert classify(0, done, 3, None, "wrong") == "wrong"
    assert classify(0, done, 3, None, "exact") == "exact"
    assert classify(0, done, 3, None, None) == "ok"


def test_summary_rows_have_exactly_the_schema_keys() -> None:
    rows = [row(_record("wrong", comparison={"rel_l2": 0.5, "max_abs_diff": 1.0,
                                                 "first_bad_step": 0}, error=None)),
            row(dict(group="unit", release="core-0.19.2", variant="hotfix",
                         id="core-0.19.2|unit-tests|hotfix", serialized=False, outcome="ok"))]
    for r in rows:
        assert tuple(r) == ROW_KEYS and r["outcome"] in OUTCOMES
    assert rows[0]["rel_l2"] == 0.5 and rows[0]["zero"] == 3
    assert "| core-0.19.2 | TE | 3 | fp32 | – | shipped | – | – | wrong (rel. L2 0.5) |" in \
        report_tables({"rows": rows, "unit_tests": {}})


def test_each_tests_end_is_what_pytest_reported_whatever_the_tests_print(
        tmp_path: Path) -> None:
    """Real pytest with the probe and Megatron-LM's own options (``-s``: the tests' prints
    land amid pytest's lines)."""
    _write(tmp_path / "pyproject.toml", '[tool.pytest.ini_options]\naddopts = "-s -rA"\n')
    _write(tmp_path / "tests" / "test_a.py", """import pytest

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown")

@pytest.fixture
def broken_setup():
    raise RuntimeError("setup")

class TestA:
    @pytest.mark.parametrize("x", ["a b", "c"])
    def test_x(self, x):
        print("a print of the test")

def test_skipped():
    pytest.skip("This test requires 8 GPUs")

def test_failed():
    assert False

def test_teardown(broken_teardown):
    pass

def test_setup(broken_setup):
    pass

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

@pytest.mark.xfail(reason="known")
def test_xpass():
    pass
""")
    ends = tmp_path / "ends.jsonl"
    env = dict(os.environ, PYTHONPATH=PROBE, MFSDP_VAL_UNIT_ENDS=str(ends))
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
                    "mfsdp_val_unit_probe", "-v", "tests"], cwd=tmp_path, env=env,
                   capture_output=True, timeout=300)
    # a run killed while writing a line keeps the lines before it
    with open(ends, "a") as f:
        f.write('{"id": "tests/test_a.py::test_cut", "en')
    assert unit_test_ends(str(ends)) == {
        "tests/test_a.py::TestA::test_x[a b]": "passed",
        "tests/test_a.py::TestA::test_x[c]": "passed",
        "tests/test_a.py::test_skipped": "skipped: This test requires 8 GPUs",
        "tests/test_a.py::test_failed": "failed: assert False",
        "tests/test_a.py::test_teardown": "error: RuntimeError: teardown",
        "tests/test_a.py::test_setup": "error: RuntimeError: setup",
        "tests/test_a.py::test_xfail": "xfail",
        "tests/test_a.py::test_xpass": "xpass"}


def test_unit_tests_differ_only_where_both_runs_ended_them() -> None:
    table = unit_test_table([
        dict(group="unit", release="core-0.19.2", variant="shipped", hotfix={"loaded": False},
             tests={"t::a": "passed", "t::b": "skipped: x", "t::c": "passed"}),
        dict(group="unit", release="core-0.19.2", variant="hotfix",
             hotfix={"loaded": True, "state": "active", "verdict": "affected: ..."},
             tests={"t::a": "failed", "t::b": "skipped: y"})])
    assert table["core-0.19.2"]["differ"] == ["t::a"]
    assert table["core-0.19.2"]["one_run_only"] == ["t::c"]
    report = report_tables({"rows": [], "unit_tests": table})
    assert "| core-0.19.2 | hotfix | active: affected: ... | None | 0 | 1 | 1 | 0 | 0 | 0 | " \
        in report  # nothing was collected in this table: "None"
    assert "| core-0.19.2 | a | 1 | passed | failed |" in report
    assert "| core-0.19.2 | c | 1 | passed | – |" in report  # ended in one run only
    assert "| core-0.19.2 | x | 1 | 0 |" in report and "| core-0.19.2 | y | 0 | 1 |" in report


def test_serialized_runs_are_compared_with_the_shipped_one_of_their_configuration(
        tmp_path: Path) -> None:
    import torch

    steps = [{"grad/0.0": torch.arange(4.0), "loss/lm loss": torch.tensor(1.5)}]
    other = [{"grad/0.0": torch.arange(4.0) + 1, "loss/lm loss": torch.tensor(1.5)}]
    results = []
    for variant, data in (("shipped", steps), ("hotfix", steps), ("db-off", other)):
        c = case("core", "core-0.19.2", variant=variant, serialized=True)
        torch.save(data, tmp_path / f"{variant}.pt")
        results.append(dict(c, capture_file=str(tmp_path / f"{variant}.pt")))
    pairs = serialized_pairs(results)
    config = results[0]["config"]
    assert pairs[f"{config}|hotfix"]["outcome"] == "exact"
    assert pairs[f"{config}|db-off"]["outcome"] == "wrong"
    assert pairs[f"{config}|db-off"]["differing"] == ["grad/0.0"]


def test_the_command_leaves_the_attention_backend_to_its_flag(tmp_path: Path,
                                                              monkeypatch: Any) -> None:
    """GPTModel asserts that NVTE_FLASH_ATTN/NVTE_FUSED_ATTN/NVTE_UNFUSED_ATTN agree with
    --attention-backend; a value set beside the flag stops every run at model construction."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    paths = Paths({"core-0.19.2": str(tmp_path)}, {"core-0.19.2": str(tmp_path)})
    for c in (case("core", "core-0.19.2"), case("local", "core-0.19.2", impl="local"),
              case("core", "core-0.19.2", variant="hotfix", serialized=True)):
        argv, env = command(c, paths, str(tmp_path), 1000.0)
        assert not {k for k in env if k.startswith("NVTE_") and k.endswith("_ATTN")}, c["id"]
        assert env.get("CUDA_LAUNCH_BLOCKING") == ("1" if c["serialized"] else None)
        assert argv[-len(pretrain_args(c)):] == pretrain_args(c)
        assert ("mfsdp_hotfix" in argv) == (c["variant"] == "hotfix")


# the raw records of the summary, in the order of the calls that made them
RECORDS = ("zero3", "zero2", "local", "te", "te-extras", "te-moe", "unit", "rest")


def test_the_committed_summary_is_what_the_raw_records_give() -> None:
    records = [str(REPO / "docs" / "validation" / f"megatron-lm-h100-{name}.json.gz")
               for name in RECORDS]
    committed = json.loads((REPO / "docs" / "validation" / "megatron-lm-summary.json").read_text())
    assert committed == json.loads(json.dumps(summary(joined(
        [read(path) for path in records], [os.path.basename(p) for p in records])),
        default=str))
    assert "/" not in json.dumps(committed["checkouts"])  # no machine paths in a summary
    for path in records:  # nor in a raw record: the checkouts are named as the doc names them
        with open(path, "rb") as f:
            assert b"/work/" not in gzip.decompress(f.read())


def _ran(case_id: str, outcome: str, **kw: Any) -> dict[str, Any]:
    return dict(id=case_id, outcome=outcome, **kw)


def test_joined_records_keep_each_case_once_and_list_what_a_later_call_replaced() -> None:
    env = {"gpu": "H100", "torch": "2.11"}
    first = {"env": env, "results": [_ran("a", "not run", error="time budget exhausted"),
                                     _ran("b", "unsupported", error="ValueError: flag"),
                                     _ran("c", "exact")]}
    second = {"env": env, "results": [_ran("c", "not run", error="time budget exhausted"),
                                      _ran("b", "exact"), _ran("a", "wrong")]}
    out = joined([first, second], ["one", "two"])
    assert [(r["id"], r["outcome"]) for r in out["results"]] == \
        [("a", "wrong"), ("b", "exact"), ("c", "exact")]  # the first call's order
    assert out["replaced"] == [{"id": "b", "record": "one", "outcome": "unsupported",
                                "by_record": "two", "error": "ValueError: flag"}]
    later = {"env": env, "results": [_ran("a", "not run", error="its serialized run was not run")]}
    assert joined([first, later])["results"][0]["error"] == "its serialized run was not run"
    with pytest.raises(ValueError, match="different machines"):
        joined([first, {"env": dict(env, gpu="H200"), "results": []}])


def _driver(tmp_path: Path, monkeypatch: Any, budget_s: float) -> Any:
    monkeypatch.setattr(workdir, "run_dir", lambda: str(tmp_path))
    monkeypatch.setattr(driver, "MIN_FREE_DISK", 0)  # this machine's disk is not the GPU machine's
    paths = Paths({"core-0.19.2": str(tmp_path)}, {"core-0.19.2": str(tmp_path)})
    return Driver(paths, 1000.0, time.time() + budget_s, 4, 240.0, 300.0)


def test_a_route_whose_first_runs_all_stop_before_training_starts_no_more(
        tmp_path: Path, monkeypatch: Any) -> None:
    drv = _driver(tmp_path, monkeypatch, 3600)
    started = []

    def run_case(c: dict[str, Any], *a: Any) -> dict[str, Any]:
        started.append(c["id"])
        return dict(c, rc=1, outcome="crash", error="TypeError: harness", capture=None)

    monkeypatch.setattr(driver, "run_case", run_case)
    cases = plan(groups=("local3@core-0.19.2",))
    results = [drv.one(c) for c in cases]
    assert len(started) == FAIL_FAST
    assert all(r["outcome"] == "not run" and "stopped before their first iteration" in r["error"]
               for r in results[FAIL_FAST:])
    drv = _driver(tmp_path, monkeypatch, 3600)  # one run that trains keeps the route going
    trained = iter([True] + [False] * 100)
    monkeypatch.setattr(driver, "run_case", lambda c, *a: dict(
        c, rc=0, outcome="ok", capture={"iterations": 3 if next(trained) else 0}))
    assert all(drv.one(c)["outcome"] == "ok" for c in cases)


def test_a_run_the_budget_cuts_is_not_run_and_one_past_the_case_timeout_a_crash(
        tmp_path: Path, monkeypatch: Any) -> None:
    c = case("local", "core-0.19.2", impl="local", serialized=True)
    timed_out = lambda c, *a: dict(c, rc="timeout", outcome="crash", capture=None)  # noqa: E731
    monkeypatch.setattr(driver, "run_case", timed_out)
    cut = _driver(tmp_path, monkeypatch, 100).one(c)
    assert cut["outcome"] == "not run" and "cut by the time budget" in cut["error"]
    hung = _driver(tmp_path, monkeypatch, 3600).one(c)
    assert hung["outcome"] == "crash" and "no end within 240 s" in hung["error"]
    late = _driver(tmp_path, monkeypatch, MIN_START_S - 1).one(c)
    assert late["outcome"] == "not run" and late["error"] == "time budget exhausted"


def test_no_gradient_pool_is_told_apart_from_a_pool_that_handed_out_no_slot() -> None:
    none_built = {"iterations": 3, "pool_allocations": {"0/weight_alloc": {
        "class": "StorageResizeBasedBucketAllocator", "calls": 0}}}
    unused = {"iterations": 3, "pool_allocations": {"0/main_grad_alloc": {
        "class": "FixedPoolAllocator", "calls": 0}}}
    assert row(_record("exact", capture=none_built))["grad_pool"] == "none built"
    assert row(_record("exact", capture=none_built))["grad_pool_allocations"] is None
    assert row(_record("exact", capture=unused))["grad_pool"] == "FixedPoolAllocator"
    assert row(_record("exact", capture=unused))["grad_pool_allocations"] == 0


def test_te_version_is_what_the_runs_with_te_layers_printed() -> None:
    te = dict(impl="te", log_head_versions=["> Transformer Engine version ... 2.20.2"])
    local = dict(impl="local", log_head_versions=["> Transformer Engine version ... 9.9"])
    assert te_versions([te, local, dict(impl="te")]) == ["2.20.2"]


def test_the_dry_plan_is_the_runs_only_selects() -> None:
    """``--dry`` prints what a GPU call with the same options would run, ``--only`` included."""
    out = subprocess.run([sys.executable, str(REPO / "validation" / "megatron_lm"), "--dry",
                          "--groups", "local3@core-0.19.2", "--only", r"\|bf16\|"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    ids = [line.split()[0] for line in out.splitlines()]
    assert ids == [c["id"] for c in plan(groups=("local3@core-0.19.2",))
                   if "|bf16|" in c["id"]] and len(ids) == 9


def test_a_run_without_one_fix_names_it_to_the_hotfix_and_no_other_run_does(
        tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("MFSDP_HOTFIX_DISABLED_FIXES", "getter-guard")  # the caller's: dropped
    paths = Paths({"core-0.19.2": str(tmp_path)}, {"core-0.19.2": str(tmp_path)})
    kw = dict(dp=1, zero=1, moe=True, op_fuser=True, deterministic=True)
    without = case("moe-opfuser", "core-0.19.2", variant="hotfix",
                   disabled_fix="expert-accumulate", **kw)
    plain = case("moe-opfuser", "core-0.19.2", variant="hotfix", **kw)
    assert without["id"] != plain["id"] and "without-expert-accumulate" in without["id"]
    argv, env = command(without, paths, str(tmp_path), 1000.0)
    assert env["MFSDP_HOTFIX_DISABLED_FIXES"] == "expert-accumulate" and "mfsdp_hotfix" in argv
    assert "MFSDP_HOTFIX_DISABLED_FIXES" not in command(plain, paths, str(tmp_path), 1000.0)[1]
    # a shipped run has no fix to turn off
    assert case("moe-opfuser", "core-0.19.2", disabled_fix="expert-accumulate",
                **kw)["disabled_fix"] == ""
