"""``selftest --gpu`` on a machine without a GPU: the CLI route as typed, the plan (1 GPU: fake
group; N GPUs: N ranks), the workers' environment, the verdict from recorded run results, the
fault's calibration math, the gradient comparison, and the shims' old import path.

What these cannot show: a run on a GPU (CI has none). The one-GPU runs are recorded in
docs/validation/selftest-gpu-h200.txt; here the worker's reports are fabricated in the shape it
writes them, and the launcher is run with a stand-in worker (including torchrun with 2 CPU
ranks), which checks how runs and ranks are started, stopped and read back, not what a rank does.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_python, verdict_line

from mfsdp_hotfix.selftest import gpu
from mfsdp_hotfix.selftest.gpu_spec import GpuRun, GpuRunResult, merge

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # also on a machine whose torch could see one
NO_TORCH = "import sys; sys.modules['torch'] = None; from mfsdp_hotfix.cli import main; " \
           "sys.exit(main(sys.argv[1:]))"


# ---- the CLI route, in the form users type it

def test_gpu_selftest_without_a_gpu_says_cannot_run_and_what_to_do() -> None:
    proc = run_python("", env=NO_GPU, args=("-m", "mfsdp_hotfix", "selftest", "--gpu"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = verdict_line(proc.stdout)
    assert last.startswith("selftest: CANNOT RUN: no CUDA GPU"), proc.stdout
    assert "\n  the GPU selftest cannot run here: no CUDA GPU" in proc.stdout
    assert "FAIL" not in proc.stdout  # the word of a failed fix only
    assert "run `mfsdp-hotfix selftest` (CPU)" in last
    assert "Traceback" not in proc.stdout + proc.stderr


def test_gpu_selftest_json_without_a_gpu() -> None:
    proc = run_python("", env=NO_GPU,
                      args=("-m", "mfsdp_hotfix", "selftest", "--gpu", "--json"))
    assert proc.returncode == 2
    data = json.loads(proc.stdout)
    assert data["verdict"] == "CANNOT RUN" and data["mode"] == "gpu"
    assert data["cannot_run"].startswith("no CUDA GPU")
    assert verdict_line(proc.stderr) == data["conclusion"]


def test_gpu_selftest_without_torch() -> None:
    proc = run_python("", args=("-c", NO_TORCH, "selftest", "--gpu"))
    assert proc.returncode == 2
    assert proc.stdout.strip() == (
        "selftest: CANNOT RUN: no torch in this environment; without a GPU, run `mfsdp-hotfix "
        "selftest` (CPU)\n  the GPU selftest cannot run here: no torch in this environment\n  it "
        "needs this environment's torch with CUDA and at least one visible GPU; nothing was "
        "tested")


def test_gpu_options_need_gpu() -> None:
    proc = run_python("", args=("-m", "mfsdp_hotfix", "selftest", "--gpus", "2",
                                "--delay-ms", "5"))
    assert proc.returncode == 2
    assert "--gpus, --delay-ms only apply with --gpu" in proc.stderr


def test_help_explains_the_gpu_mode() -> None:
    proc = run_python("", args=("-m", "mfsdp_hotfix", "selftest", "--help"))
    text = " ".join(proc.stdout.split())
    for words in ("fake 2-rank group with NCCL work semantics", "CUDA_LAUNCH_BLOCKING=1",
                  "saw >0 slot reuses, none unordered", "Exit 2 when it cannot run here",
                  "--delay-ms", "--gpus", "te-layernorm-mlp"):
        assert words in text, words


def test_gpu_modules_import_no_torch() -> None:
    code = ("import sys, mfsdp_hotfix.cli, mfsdp_hotfix.selftest.gpu, "
            "mfsdp_hotfix.selftest.gpu_worker; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


# ---- the plan

def test_one_gpu_is_a_fake_two_rank_group_in_one_process() -> None:
    plan = gpu.build_plan(1)
    assert plan.fake and plan.gpus == 1 and plan.layer == "emulated"
    assert [r.name for r in plan.runs] == ["shipped serialized", "hotfix serialized",
                                           "shipped", "hotfix"]
    for run in plan.runs:
        assert run.fake and run.ranks == 2 and run.processes == 1
        assert gpu.command(run, "run.json", "out", python="py") == [
            "py", "-m", "mfsdp_hotfix.selftest.gpu_worker", "run.json", "out"]
    assert "a fake 2-rank process group with NCCL work semantics" in plan.describe()


def test_several_gpus_are_nccl_ranks_under_torchrun() -> None:
    plan = gpu.build_plan(8, gpus=4, layer="auto", te_found=True, zero=2, delay_ms=5)
    assert not plan.fake and plan.gpus == 4 and plan.layer == "te-layernorm-mlp"
    run = plan.runs[0]
    assert (run.ranks, run.processes, run.zero, run.delay_ms) == (4, 4, 2, 5)
    assert gpu.command(run, "run.json", "out", python="py") == [
        "py", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", "4", "-m", "mfsdp_hotfix.selftest.gpu_worker", "run.json", "out"]
    assert "4 GPUs, 4 NCCL ranks (torchrun)" in plan.describe()
    assert gpu.build_plan(3).runs[0].ranks == 3  # default: every visible GPU


@pytest.mark.parametrize(("visible", "wanted", "layer", "te", "message"), [
    (0, None, "auto", False, "no CUDA GPU is visible"),
    (2, 3, "auto", False, "--gpus 3 asked for, 2 CUDA GPU(s) visible"),
    (2, 0, "auto", False, "--gpus 0 asked for"),
    (1, None, "te-linear", False, "--layer te-linear needs TransformerEngine"),
])
def test_plans_that_cannot_run(visible: int, wanted: int | None, layer: str, te: bool,
                               message: str) -> None:
    with pytest.raises(gpu.CannotRun, match=re.escape(message)):
        gpu.build_plan(visible, wanted, layer, te)


def test_run_description_round_trips() -> None:
    run = gpu.build_plan(2, layer="te-linear", te_found=True).runs[3]
    assert GpuRun.from_json(run.to_json()) == run and run.key == "hotfix"


def test_environment_of_each_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # a user's shell may have these set; neither may leak into the runs
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    monkeypatch.setenv("MFSDP_HOTFIX", "0")
    monkeypatch.setenv("MFSDP_HOTFIX_AUDIT", "/elsewhere")
    runs = {r.name: r for r in gpu.build_plan(1).runs}
    env = {name: gpu.environment(run, "/out", "/release") for name, run in runs.items()}
    assert env["shipped serialized"]["CUDA_LAUNCH_BLOCKING"] == "1"
    assert "MFSDP_HOTFIX_AUDIT" not in env["shipped serialized"]
    assert "CUDA_LAUNCH_BLOCKING" not in env["hotfix"]
    assert env["hotfix"]["MFSDP_HOTFIX_AUDIT"] == "/out/hotfix-audit"
    assert env["shipped"]["MFSDP_HOTFIX"] == "0" and "MFSDP_HOTFIX" not in env["hotfix"]
    assert env["hotfix"]["PYTHONPATH"].split(":")[0] == "/release"
    assert env["hotfix"]["MFSDP_HOTFIX_CROSS_RANK_CHECK"] == "off"  # FakeStore has no get/set
    assert env["hotfix"]["TMPDIR"] == "/out"  # removed with the runs' folder
    nccl = gpu.environment(gpu.build_plan(2).runs[3], "/out")
    assert "MFSDP_HOTFIX_CROSS_RANK_CHECK" not in nccl


# ---- the verdict, from recorded results

RELEASE = {"dist": "megatron-fsdp", "version": "0.6.1", "flavour": "standalone", "path": "/r"}


def _report(**fields: object) -> dict[str, object]:
    return {"rank": 0, "crashed": False, "release": RELEASE, "gpu": "NVIDIA H200",
            "te_version": "2.20.2",
            "rs_calls": 48, "rs_delayed": 48, **fields}


def _audit(reuses: int, unordered: int, state: str = "on") -> dict[str, object]:
    return {"audit": state, "copies": [{"reuses": reuses, "unordered": unordered,
                                        "crashed": False}]}


def _compared(exact: bool, diff_sq: float = 0.0) -> dict[str, object]:
    return {"compared": True, "exact": exact, "max_abs": 0.0 if exact else 0.05,
            "diff_sq": diff_sq, "ref_sq": 1.0}


def _results(plan: gpu.GpuPlan, **by_name: GpuRunResult) -> dict[str, GpuRunResult]:
    runs = {r.name: r for r in plan.runs}
    defaults = {
        "shipped serialized": merge(runs["shipped serialized"], [_report()], [], [0], False),
        "hotfix serialized": merge(runs["hotfix serialized"], [_report()], [], [0], False),
        "shipped": merge(runs["shipped"], [_report(**_compared(False, 0.49))],
                         [_audit(16, 12)], [0], False),
        "hotfix": merge(runs["hotfix"], [_report(**_compared(True))], [_audit(16, 0)], [0],
                        False),
    }
    return {**defaults, **{name.replace("_", " "): r for name, r in by_name.items()}}


PLAN = gpu.build_plan(1, te_found=True)
RUNS = {r.name: r for r in PLAN.runs}


def test_pass_hotfix_exact_and_audit_ordered() -> None:
    passed, line = gpu.conclusion(PLAN, _results(PLAN))
    assert passed
    assert line == ("selftest: PASS: on 1 GPU, megatron-fsdp 0.6.1: with the hotfix, bit-identical "
                    "to the serialized run; as shipped: wrong\n"
                    "  megatron-fsdp 0.6.1 with te.LayerNormMLP (TE 2.20.2), 48 reduce-scatters "
                    "delayed 20 ms: with the hotfix the gradients are bit-identical to the "
                    "serialized run and the audit found 0 unordered of 16 gradient-slot reuses\n"
                    "  as shipped: WRONG gradients (rel. L2 0.7 vs its serialized run); the audit "
                    "found 12 unordered of 16 gradient-slot reuses")


@pytest.mark.parametrize(("hotfix", "words"), [
    (merge(RUNS["hotfix"], [_report(**_compared(False, 0.04))], [_audit(16, 0)], [0], False),
     "the gradients are wrong against the serialized run (rel. L2 0.2)"),
    (merge(RUNS["hotfix"], [_report(crashed=True, exception="RuntimeError: boom")],
           [_audit(16, 0)], [3], False), "the run crashed: RuntimeError: boom"),
    (merge(RUNS["hotfix"], [None], [], [-9], True), "the run crashed: timed out after 300s"),
    (merge(RUNS["hotfix"], [_report(**_compared(True))], [_audit(0, 0)], [0], False),
     "the audit saw 0 gradient-slot reuses, so it checked nothing"),
    (merge(RUNS["hotfix"], [_report(**_compared(True))], [_audit(16, 2)], [0], False),
     "the audit found 2 unordered of 16 gradient-slot reuses"),
    (merge(RUNS["hotfix"], [_report(**_compared(True))], [], [0], False),
     "the audit wrote 0 of 1 rank file(s)"),
    (merge(RUNS["hotfix"], [_report(**_compared(True))], [_audit(16, 0, "disabled: x")], [0],
           False), "the audit was not on (disabled: x)"),
    (merge(RUNS["hotfix"], [_report()], [_audit(16, 0)], [0], False),
     "the gradients are no truth against the serialized run"),
])
def test_fail_rules(hotfix: GpuRunResult, words: str) -> None:
    passed, line = gpu.conclusion(PLAN, _results(PLAN, hotfix=hotfix))
    assert not passed and line.startswith("selftest: FAIL: on 1 GPU")
    assert words in line, line


def test_fail_when_the_truth_crashed() -> None:
    truth = merge(RUNS["hotfix serialized"], [_report(crashed=True, exception="X: y")], [],
                  [3], False)
    passed, line = gpu.conclusion(PLAN, _results(PLAN, hotfix_serialized=truth))
    assert not passed and "the serialized run (the truth) crashed: X: y" in line


@pytest.mark.parametrize(("shipped", "words"), [
    (merge(RUNS["shipped"],
           [_report(crashed=True, exception="AssertionError: No buffer found for bucket_id: 3 ")],
           [{"audit": "on", "copies": [{"reuses": 0, "unordered": 0, "crashed": True}]}], [3],
           False),
     "as shipped: CRASH (AssertionError: No buffer found for bucket_id: 3); the audit recorded "
     "the crash"),
    (merge(RUNS["shipped"], [_report(**_compared(True))], [_audit(16, 12)], [0], False),
     "as shipped: gradients exact in this run, but the audit found 12 unordered of 16 "
     "gradient-slot reuses: the race is there and this run's timing did not expose it"),
    (merge(RUNS["shipped"], [_report(**_compared(True))], [_audit(16, 0)], [0], False),
     "as shipped: gradients exact and the audit found 0 unordered of 16 gradient-slot reuses: "
     "this copy shows no slot race in this configuration"),
])
def test_the_shipped_run_is_reported_not_judged(shipped: GpuRunResult, words: str) -> None:
    passed, line = gpu.conclusion(PLAN, _results(PLAN, shipped=shipped))
    assert passed and line.startswith("selftest: PASS") and words in line


def test_ranks_are_merged() -> None:
    run = gpu.build_plan(2).runs[3]
    one = _report(**_compared(False, 0.09))
    two = dict(_report(**_compared(True)), rank=1, ref_sq=3.0)
    result = merge(run, [one, two], [_audit(8, 0), _audit(8, 1)], [0], False)
    assert result.outcome() == "wrong" and not result.crashed
    assert math.isclose(result.rel_l2 or 0.0, (0.09 / 4.0) ** 0.5)
    assert (result.audit_reuses, result.audit_unordered, result.audit_files) == (16, 1, 2)
    assert result.rs_delayed == 96
    missing = merge(run, [one, None], [], [1], False)
    assert missing.crashed and missing.exception == "1 rank(s) reported nothing (exit codes [1])"


def test_table_and_json() -> None:
    results = _results(PLAN)
    table = gpu.format_gpu_table(PLAN, results).splitlines()
    assert table[0] == "Megatron-FSDP: megatron-fsdp 0.6.1 (standalone) at /r"
    assert table[1] == "GPU: NVIDIA H200; TransformerEngine 2.20.2"
    rows = {line.split("  ")[0]: line.split() for line in table[4:8]}
    assert rows["shipped"][1:5] == ["wrong", "0.7", "0.05", "12/16"]
    assert rows["hotfix"][1:5] == ["exact", "0", "0", "0/16"]
    assert rows["hotfix serialized"][2:4] == ["ran", "-"]
    data = gpu.to_json(PLAN, results)
    assert data["verdict"] == "PASS" and data["fake_group"] is True
    assert [r["outcome"] for r in data["runs"]] == ["ran", "ran", "wrong", "exact"]
    json.dumps(data)


def test_driver_starts_the_four_runs_together() -> None:
    import io

    launches: list[list[str]] = []

    def launcher(runs: list[GpuRun], out_dir: str, path: str | None,
                 progress: object) -> list[GpuRunResult]:
        launches.append([r.name for r in runs])
        recorded = _results(PLAN)
        return [recorded[r.name] for r in runs]

    out, talk = io.StringIO(), io.StringIO()
    gpu.run_gpu_selftest(PLAN, out=out, progress=talk, launcher=launcher)
    assert launches == [["shipped serialized", "hotfix serialized", "shipped", "hotfix"]]
    assert verdict_line(out.getvalue()).startswith("selftest: PASS: ")
    assert "selftest: hotfix: exact" in talk.getvalue()


# ---- calibration of the fault, and the comparison of gradients (CPU torch)

def test_calibration_math() -> None:
    from mfsdp_hotfix.selftest.gpu_shims import cycles_per_ms, delay_cycles

    samples = [(1_000_000, 0.9), (50_000_000, 25.0), (50_000_000, 26.0), (50_000_000, 24.0)]
    assert cycles_per_ms(samples) == 2_000_000.0  # median rate of the longest sleeps
    assert delay_cycles(20, 1_980_000.4) == 39_600_008
    assert delay_cycles(0, 2e6) == 0
    with pytest.raises(ValueError):
        cycles_per_ms([(50_000_000, 0.0)])
    with pytest.raises(ValueError):
        delay_cycles(-1, 2e6)


def test_gradient_comparison() -> None:
    """The rank report's keys from mfsdp_hotfix.compare (every case of it: tests/test_compare.py):
    merged over ranks, a NaN leaves no max |difference| and makes the run wrong."""
    import torch

    from mfsdp_hotfix.selftest.gpu_worker import compared

    a = [{"w": torch.tensor([1.0, 2.0]), "empty": torch.empty(0)}]
    same = compared(a, [{k: t.clone() for k, t in a[0].items()}])
    assert (same["exact"], same["steps_compared"], same["tensors_compared"]) == (True, 1, 2)
    off = compared([{"w": torch.tensor([1.0, 3.0]), "empty": torch.empty(0)}], a)
    assert (off["exact"], off["max_abs"], off["diff_sq"], off["ref_sq"]) == (False, 1.0, 1.0, 5.0)
    nan = compared([{"w": torch.tensor([1.0, float("nan")]), "empty": torch.empty(0)}], a)
    assert nan["exact"] is False and nan["max_abs"] is None and nan["diff_sq"] is None
    merged = merge(RUNS["hotfix"], [_report(**nan), dict(_report(**same), rank=1)], [], [0, 0],
                   False)
    assert merged.outcome() == "wrong" and merged.max_abs is None and merged.rel_l2 is None
    assert merged.tensors_compared == 4 and merged.not_exact_because == [
        "step 0: w: 1 NaN in the run", "step 0: w: 1 of 2 elements differ in their bits"]
    assert compared([], [])["exact"] is False  # nothing compared is not exact


def test_emulated_model_on_a_device_is_the_cpu_model() -> None:
    import torch

    from mfsdp_hotfix.selftest import model

    moved = model.build_on(torch.device("cpu"), "emulated", 32, 3, 7)
    plain = model.build(32, 3, 7)
    assert all(torch.equal(a, b) for a, b in zip(moved.state_dict().values(),
                                                  plain.state_dict().values(), strict=True))


# ---- validation/fakepg_shims.py: same names, the package's code, no hotfix imported

def test_fakepg_shims_reexports_the_package_shims() -> None:
    code = (
        "import sys; sys.path.insert(0, 'validation')\n"
        "import fakepg_shims as s\n"
        "print(sorted(n for n in ('install_nccl_semantics', 'install_rs_delay', 'STATS', "
        "'EventWork') if hasattr(s, n)))\n"
        "print(s.install_rs_delay.__code__.co_filename.endswith("
        "'mfsdp_hotfix/selftest/gpu_shims.py'))\n"
        "print(sorted(s.STATS), 'mfsdp_hotfix' in sys.modules)\n"
        "import torch.distributed as dist\n"
        "before = dist.reduce_scatter_tensor\n"
        "s.install_rs_delay(0)\n"
        "print(dist.reduce_scatter_tensor.__wrapped__ is before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "['EventWork', 'STATS', 'install_nccl_semantics', 'install_rs_delay']", "True",
        "['event_works', 'recorded_tensors', 'rs_calls', 'rs_sleeps'] False", "True"]


def test_table_shows_how_a_run_broke_except_a_reported_shipped_crash() -> None:
    hotfix = merge(RUNS["hotfix"], [_report(crashed=True, exception="RuntimeError: boom",
                                            traceback="Traceback\n  File x\nRuntimeError: boom")],
                   [], [3], False)
    shipped = merge(RUNS["shipped"], [_report(crashed=True, exception="AssertionError: No buffer",
                                              traceback="Traceback\nAssertionError: No buffer")],
                    [], [3], False)
    table = gpu.format_gpu_table(PLAN, _results(PLAN, hotfix=hotfix, shipped=shipped))
    assert "--- hotfix: last lines of its traceback ---\nTraceback\n  File x\nRuntimeError: boom" \
        in table
    assert "--- shipped:" not in table
    died = merge(RUNS["shipped"], [None], [], [-11], False, log_tail="Segmentation fault")
    table = gpu.format_gpu_table(PLAN, _results(PLAN, shipped=died))
    assert "--- shipped: last lines of its output ---\nSegmentation fault" in table


def test_verdict_names_the_layer() -> None:
    emulated = gpu.build_plan(1)
    _, line = gpu.conclusion(emulated, _results(emulated))
    assert "megatron-fsdp 0.6.1 with the emulated fused-wgrad contract, 48" in line
    linear = gpu.build_plan(1, layer="te-linear", te_found=True)
    assert "with te.Linear (TE 2.20.2), 48" in gpu.conclusion(linear, _results(linear))[1]


def test_documented_timing_is_the_recorded_run() -> None:
    """docs/USAGE.md's durations are the wall times of the recorded GPU runs (the serialized pair
    runs together, then shipped, then hotfix): the default route with TE, and the emulated layer
    on 0.4.0 from the earlier recording."""
    def totals(name: str) -> list[int]:
        recorded = (REPO / "docs" / "validation" / name).read_text()
        out = []
        for block in recorded.split("selftest: GPU mode")[1:]:
            times = {" ".join(line.split()[:-6]): float(line.split()[-1])
                     for line in block.splitlines()
                     if re.match(r"^(shipped|hotfix)( serialized)? +(ran|crash|wrong|exact) ",
                                 line)}
            out.append(round(max(times["shipped serialized"], times["hotfix serialized"])
                             + times["shipped"] + times["hotfix"]))
        return out

    for name, copy in (("selftest-gpu-h200-default-route.txt", "megatron-fsdp 0.6.1"),
                       ("selftest-gpu-h200-core-default-route.txt", "megatron-core 0.19.2")):
        recorded = (REPO / "docs" / "validation" / name).read_text()
        assert "rel. L2 vs serialized" in recorded and "32/46" in recorded
        assert f"selftest: PASS: on 1 GPU, {copy} with te.LayerNormMLP" in recorded
    (te_run,) = totals("selftest-gpu-h200-default-route.txt")
    emulated = totals("selftest-gpu-h200.txt")[1]
    readme = " ".join((REPO / "docs" / "USAGE.md").read_text().split())
    assert f"about {te_run} s of runs plus the start of the command: PASS" in readme
    assert f"with the emulated layer on 0.4.0, {emulated} s, PASS" in readme
    assert "relative L2 1.36, the audit found 32 of 46 slot reuses unordered" in readme


# ---- the launcher, with a stand-in worker (the real one needs a GPU)

STUB_WORKER = '''
import json, os, sys, time
from pathlib import Path
from mfsdp_hotfix.selftest import gpu_turns
from mfsdp_hotfix.selftest.gpu_spec import GpuRun
started = time.time()
spec = GpuRun.from_json(Path(sys.argv[1]).read_text())
run = json.loads(Path(sys.argv[1]).read_text())
out = Path(sys.argv[2])
rank = 0 if run["fake"] else int(os.environ["RANK"])
if os.environ.get("STUB_HANG"):
    time.sleep(600)
if os.environ.get("STUB_CRASH_RANK"):  # that rank raises, its peers wait in a collective
    if rank != int(os.environ["STUB_CRASH_RANK"]):
        time.sleep(600)
    report = {"rank": rank, "crashed": True, "exception": "AssertionError: No buffer found"}
    (out / f"hotfix.rank{rank}.json").write_text(json.dumps(report))
    os._exit(3)
if os.environ.get("STUB_CRASH_SERIALIZED") and run["serialized"]:
    os._exit(3)  # before its turn, without a report: its asynchronous run must not wait on
time.sleep(float(os.environ.get("STUB_PREPARE_S", "0")))
ready = time.time()
assert gpu_turns.take_turn(str(out), spec, rank)
turn = time.time()
time.sleep(float(os.environ.get("STUB_TURN_S", "0")))
gpu_turns.flag(str(out), spec, "done", rank).touch()
done = time.time()
truth = out / f"{run['variant']}-truth.rank{rank}.pt"
key = run["variant"] + (" serialized" if run["serialized"] else "")
report = {"rank": rank, "crashed": False, "rs_delayed": 1, "prepare_s": ready - started,
          "turn_s": done - turn, "times": [started, ready, turn, done],
          "env": {k: os.environ.get(k) for k in ("CUDA_LAUNCH_BLOCKING", "MFSDP_HOTFIX",
                                                 "WORLD_SIZE", "LOCAL_RANK")}}
if run["serialized"]:
    truth.write_text("truth")
else:
    serialized = gpu_turns.flag(str(out), GpuRun(**{**run, "serialized": True}), "ended")
    if gpu_turns.wait_for([truth, serialized], 60) and truth.exists():
        report.update(compared=True, exact=True, max_abs=0.0, diff_sq=0.0, ref_sq=1.0)
    audit = {"audit": "on", "copies": [{"reuses": 4, "unordered": 0, "crashed": False}]}
    Path(os.environ["MFSDP_HOTFIX_AUDIT"] + f".rank{rank}.json").write_text(json.dumps(audit))
(out / (key.replace(" ", "-") + f".rank{rank}.json")).write_text(json.dumps(report))
'''


@pytest.fixture
def stub_worker(tmp_path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "stub_gpu_worker.py").write_text(STUB_WORKER)
    monkeypatch.setattr(gpu, "WORKER", "stub_gpu_worker")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
    out = tmp_path / "out"
    out.mkdir()
    return str(out)


@pytest.mark.parametrize("gpus", [1, 2])
def test_launch_starts_each_run_and_reads_every_rank(stub_worker: str, gpus: int) -> None:
    import io

    plan = gpu.build_plan(gpus)
    results = gpu.launch(plan.runs, stub_worker, None, io.StringIO())
    assert [r.run.name for r in results] == [r.name for r in plan.runs]
    for result in results:
        assert not result.crashed, result.log_tail
        assert result.reports == (1 if gpus == 1 else gpus)  # torchrun started every rank
        assert result.rs_delayed == result.reports
        if not result.run.serialized:
            assert result.outcome() == "exact" and result.audit_files == result.reports
    runs = {r.run.name: r for r in results}
    reports = {name: json.loads((Path(stub_worker) / f"{r.run.key}.rank0.json").read_text())
               for name, r in runs.items()}
    assert reports["shipped serialized"]["env"]["CUDA_LAUNCH_BLOCKING"] == "1"
    assert reports["shipped"]["env"]["CUDA_LAUNCH_BLOCKING"] is None
    assert reports["shipped"]["env"]["MFSDP_HOTFIX"] == "0"
    assert reports["hotfix"]["env"]["MFSDP_HOTFIX"] is None
    if gpus == 2:
        assert reports["hotfix"]["env"]["WORLD_SIZE"] == "2"


def test_the_runs_prepare_together_and_take_the_gpu_in_turns(
        stub_worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run prepares at once; on the GPU the serialized pair shares a turn and each
    asynchronous run has one to itself, once all are prepared; an asynchronous run compares once
    its truth is there."""
    import io

    monkeypatch.setenv("STUB_PREPARE_S", "2")
    monkeypatch.setenv("STUB_TURN_S", "1")
    results = {r.run.name: r for r in gpu.launch(gpu.build_plan(1).runs, stub_worker, None,
                                                 io.StringIO())}
    times = {name: json.loads((Path(stub_worker) / f"{r.run.key}.rank0.json").read_text())[
        "times"] for name, r in results.items()}
    started, ready, turn, done = (list(column) for column in zip(*times.values(), strict=True))
    assert max(started) < min(ready)  # all were preparing at the same time
    assert min(times[name][2] for name in ("shipped", "hotfix")) >= max(ready)
    alone = [(times[name][2], times[name][3]) for name in ("shipped", "hotfix")]
    for name, (_, _, begin, end) in times.items():
        for other_begin, other_end in alone:
            if (other_begin, other_end) != (begin, end):
                assert end <= other_begin or other_end <= begin, name  # no overlap
    assert [results[name].outcome() for name in ("shipped", "hotfix")] == ["exact", "exact"]
    assert all(r.turn_s is not None and r.turn_s >= 1 for r in results.values())
    assert all(r.prepare_s is not None and r.prepare_s >= 2 for r in results.values())


def test_an_asynchronous_run_whose_truth_never_comes_does_not_wait_for_it(
        stub_worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import time

    monkeypatch.setenv("STUB_CRASH_SERIALIZED", "1")
    began = time.monotonic()
    results = {r.run.name: r for r in gpu.launch(gpu.build_plan(1).runs, stub_worker, None,
                                                 io.StringIO())}
    assert time.monotonic() - began < 50  # the stub would wait 60 s for a truth
    assert results["shipped serialized"].crashed
    assert results["shipped"].outcome() == "no truth" and results["hotfix"].outcome() == "no truth"


def test_the_real_worker_rehearsed_on_the_cpu(fsdp_release, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The real worker (``cpu_rehearsal_worker``: the stand-in for torch.cuda, the CPU for the
    GPU, no race possible) through the real launcher, on a small model: all four prepare
    together, the serialized pair has the GPU first, then each asynchronous run alone; the
    gradients are kept and compared; the audit counts the stand-in's slot reuses, unordered as
    shipped and none with the hotfix; PASS; the runs' folder is gone."""
    import io
    import tempfile

    monkeypatch.setattr(gpu, "WORKER", "cpu_rehearsal_worker")
    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parent}:{REPO}")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plan = gpu.build_plan(1, hidden=64, tokens=64, timeout_s=240.0)
    out, talk = io.StringIO(), io.StringIO()
    results = gpu.run_gpu_selftest(plan, path=str(fsdp_release("0.6.1")), out=out, progress=talk)
    turns = [line.split(": on the GPU")[0].strip().removeprefix("selftest:").strip()
             for line in talk.getvalue().splitlines() if ": on the GPU," in line]
    assert turns[0] == "shipped serialized and hotfix serialized", talk.getvalue()
    assert sorted(turns[1:]) == ["hotfix", "shipped"]
    shipped, hotfix = results["shipped"], results["hotfix"]
    assert hotfix.outcome() == "exact" and hotfix.audit_reuses and hotfix.audit_unordered == 0
    assert shipped.outcome() == "exact" and shipped.audit_unordered  # the stand-in's clocks
    assert all(r.prepare_s and r.turn_s for r in results.values())
    assert verdict_line(out.getvalue()).startswith("selftest: PASS: "), out.getvalue()
    assert list(tmp_path.iterdir()) == []


def test_launch_kills_a_run_past_its_timeout(stub_worker: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import time

    monkeypatch.setenv("STUB_HANG", "1")
    run = gpu.build_plan(1, timeout_s=1.0).runs[3]
    started = time.monotonic()
    (result,) = gpu.launch([run], stub_worker, None, io.StringIO())
    assert time.monotonic() - started < 30
    assert result.timed_out and result.outcome() == "crash"
    assert result.exception == "timed out after 1s"


def test_torchrun_stops_the_peers_of_a_crashed_rank(stub_worker: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker exits 3 after a crash so that torchrun stops its peers (stuck in NCCL)."""
    import io
    import time

    monkeypatch.setenv("STUB_CRASH_RANK", "1")
    run = gpu.build_plan(2).runs[3]
    started = time.monotonic()
    (result,) = gpu.launch([run], stub_worker, None, io.StringIO())
    assert time.monotonic() - started < 120 and not result.timed_out
    assert result.crashed and result.exception == "AssertionError: No buffer found"


def test_a_crash_inside_te_suggests_the_emulated_layer() -> None:
    crash = merge(RUNS["hotfix"], [_report(crashed=True, exception="OSError: libnccl.so.2",
                                           traceback='File "/x/transformer_engine/__init__.py"')],
                  [], [3], False)
    passed, line = gpu.conclusion(PLAN, _results(PLAN, hotfix=crash))
    assert not passed and "OSError: libnccl.so.2 (inside TransformerEngine: if TE itself fails " \
        "here, try --layer emulated)" in line


def test_a_broken_cuda_is_a_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def broken() -> bool:
        raise RuntimeError("driver too old")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    with pytest.raises(gpu.CannotRun, match=r"CUDA does not work here \(RuntimeError: driver"):
        gpu.probe_cuda()
