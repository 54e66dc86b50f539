"""The CPU side of the GPU validation: the matrix driver plans its cases without a GPU and the CPU
micro-benchmarks run. (The tables in docs/VALIDATION.md are generated regions, compared both ways
with what the report scripts print from the committed raw JSON by tests/test_claims.py.)"""

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


def test_accumulation_gpu_script_finds_zero1s_lost_microbatch_on_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The GPU confirmation of zero1-fused-wgrad-overwrite, run on the CPU stand-in (tiny):
    on megatron-fsdp 0.6.1 ZeRO-1's 2-microbatch step equals its last microbatch alone, ZeRO-2/3
    not."""
    import json
    import os

    import releases

    out = tmp_path / "acc.json"
    env = {**os.environ, "MFSDP_HOTFIX": "0", "PYTHONPATH": os.pathsep.join(
        [str(releases.unpacked("megatron-fsdp", "0.6.1")), str(REPO)])}
    proc = subprocess.run([sys.executable, "validation/accumulation_gpu.py", "--cpu", "--tiny",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert {k: v["first_microbatch_lost"] for k, v in summary.items()} == {
        "zero1-megatron-lm": True, "zero1-auto-sync": True, "zero2-megatron-lm": False,
        "zero2-auto-sync": False, "zero3-megatron-lm": False, "zero3-auto-sync": False}


def test_accumulation_gpu_script_with_the_hotfix_keeps_every_microbatch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--fix hotfix``: with zero1-accumulate, no case's 2-microbatch step equals its last
    microbatch alone (CPU stand-in, tiny); ZeRO-1 under model auto-sync reduces its in-place
    buffer once per microbatch, which auto-sync-stop stops at the step, by design."""
    import json
    import os

    import releases

    out = tmp_path / "acc.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(releases.unpacked("megatron-fsdp", "0.6.1")), str(REPO)])}
    env.pop("MFSDP_HOTFIX", None)
    proc = subprocess.run([sys.executable, "validation/accumulation_gpu.py", "--cpu", "--tiny",
                           "--fix", "hotfix", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["fix"] == "hotfix"
    stopped = "zero1-auto-sync"
    assert {k: v["first_microbatch_lost"] for k, v in record["summary"].items()} == {
        f"zero{z}-{p}": None if f"zero{z}-{p}" == stopped else False
        for z in (1, 2, 3) for p in ("megatron-lm", "auto-sync")}
    assert record["runs"][f"{stopped}-2mb"]["error"].startswith(
        "UnsupportedConfiguration: mfsdp_hotfix: auto-sync-stop: ")
