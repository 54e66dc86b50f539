"""The CPU side of the GPU validation: the matrix driver plans its cases without a GPU, the
tables in docs/VALIDATION.md are exactly what the committed raw JSON gives, and the CPU
micro-benchmarks run."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def script(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_matrix_plans_every_release_without_a_gpu() -> None:
    out = script("validation/run_matrix.py", "--phase", "matrix", "--dry").stdout
    for release in ("fsdp-0.4.0", "fsdp-0.5.1", "fsdp-0.6.1", "core-0.18.2", "core-0.19.2"):
        assert f"{release}|" in out, release
    for delay in ("d0", "d5", "d20", "d50"):
        assert f"|{delay}" in out


def test_core_gpt_plans_every_release_and_model_without_a_gpu() -> None:
    out = script("validation/core_gpt.py", "--dry").stdout
    for release in ("core-0.18.2", "core-0.19.2"):
        assert f"{release}|dense|probe-no-apex-stub" in out
        for model in ("dense", "moe"):
            for variant in ("shipped", "hotfix"):
                assert f"{release}|{model}|{variant}|serialized" in out
                assert f"{release}|{model}|{variant}|d0" in out
                assert f"{release}|{model}|{variant}|d20" in out
        assert f"{release}|moe-opfuser|hotfix|d20" in out
    assert '"CUDA_LAUNCH_BLOCKING": "1"' in out


def assert_documented(report_script: str, at_least: int) -> None:
    """Every table row ``report_script`` prints from the raw JSON is in docs/VALIDATION.md."""
    tables = [line for line in script(report_script).stdout.splitlines() if line.startswith("|")]
    documented = (REPO / "docs" / "VALIDATION.md").read_text()
    assert len(tables) > at_least
    missing = [line for line in tables if line not in documented]
    assert not missing, missing[:5]


def test_documented_tables_come_from_the_raw_json() -> None:
    assert_documented("validation/report.py", 50)


def test_cpu_benchmarks_run() -> None:
    out = script("benchmarks/run.py", "--quick").stdout
    assert "getter-guard" in out and "heavy packages imported at `import mfsdp_hotfix`: none" in out


def test_audit_phases_plan_every_release_and_configuration() -> None:
    out = script("validation/run_matrix.py", "--phase", "audit", "auditperf", "--dry").stdout
    for release in ("fsdp-0.4.0", "fsdp-0.5.1", "fsdp-0.6.1", "core-0.18.2", "core-0.19.2"):
        for variant in ("db+audit", "db+hotfix+audit"):
            assert f"{release}|z2|fused|nccl_sem|{variant}|d20" in out, (release, variant)
        for zero in (1, 2, 3):
            assert f"{release}|z{zero}|mb1|nccl_sem|db+hotfix+audit|d0|sweep" in out
    assert "core-0.19.2|z2|perf|db+hotfix+audit|d0|rep1" in out


def test_documented_audit_tables_come_from_the_raw_json() -> None:
    assert_documented("validation/audit_report.py", 40)


def test_gpu_tables_come_from_the_raw_json() -> None:
    assert_documented("validation/gpu_report.py", 300)


def test_core_gpt_and_cost_tables_come_from_the_raw_json() -> None:
    """The cost table lives in docs/PERFORMANCE.md (VALIDATION.md links to it)."""
    for doc, args in (
            ("VALIDATION.md", ("validation/core_gpt.py", "--report",
                               "docs/validation/core-gpt-h200.json")),
            ("VALIDATION.md", ("validation/core_gpt.py", "--report",
                               "docs/validation/core-gpt-opfuser-no-double-buffer-h200.json")),
            ("PERFORMANCE.md", ("benchmarks/safe_choices.py", "--report",
                                "docs/validation/bench-safe-choices-h200.json"))):
        documented = (REPO / "docs" / doc).read_text()
        rows = [line for line in script(*args).stdout.splitlines() if line.startswith("|")]
        assert len(rows) > 10
        assert [line for line in rows if line not in documented] == []
