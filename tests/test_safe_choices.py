"""The CPU side of ``benchmarks/safe_choices/`` (what the safe choices cost, measured on a GPU
with real TransformerEngine): the run order, the time budget, the worker protocol (real
subprocesses whose set-up and turns are stand-ins), the ratios and the README table. What a
worker measures on the GPU (``setup``) is not exercised here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

PACKAGE = REPO / "benchmarks" / "safe_choices"
sys.path.insert(0, str(PACKAGE.parent))
from safe_choices.driver import drive  # noqa: E402
from safe_choices.plan import REFERENCE, SIZES, VARIANTS, gemm_flop, plan, unit_params  # noqa: E402
from safe_choices.report import compact_table, render_markdown  # noqa: E402
from safe_choices.summary import step_stats, summarize  # noqa: E402
from safe_choices.worker import Worker  # noqa: E402

SIZE = dict(units=2, hidden=8, ffn=32, tokens=4, microbatches=1, warmup=1, steps=5)
# median step ms of each variant, per repetition
MEDIANS = {"hotfix": [100.0, 110.0, 90.0], "no-db": [101.0, 110.0, 99.0],
           "fuse-off": [120.0, 121.0, 108.0], "shipped": [100.0, 100.0, 90.0]}
PEAKS = {"hotfix": 1000.0, "no-db": 1200.0, "fuse-off": 1100.0, "shipped": 1000.0}
IDENTITY = dict(n_params=1_234_000, gpu="NVIDIA H200", torch="2.11.0+cu130", te="2.20.2",
                release_version="megatron-fsdp 0.6.1")


def fake_turn(variant, rep):
    m = MEDIANS[variant][rep]
    steps = [m - 2, m - 1, m, m + 1, m + 30]  # median m
    return dict(ok=True, rep=rep, step_ms=steps, peak_mem_mb=PEAKS[variant],
                **step_stats(steps))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeWorker:
    """In-process stand-in for ``Worker``: start-up and each turn advance the clock."""

    def __init__(self, spec, clock, log, start_s, turn_s, fail):
        self.spec, self.clock, self.log = spec, clock, log
        self.turn_s, self.fail = turn_s, fail
        clock.t += start_s / 4  # the four workers of a group start in parallel
        log.append(("start", spec["group"], spec["variant"]))

    def ready(self):
        if ("start", self.spec["group"], self.spec["variant"]) in self.fail:
            return dict(ok=False, error="ImportError: no TE")
        return dict(ok=True, **IDENTITY)

    def turn(self, rep):
        self.clock.t += self.turn_s
        self.log.append((self.spec["group"], rep, self.spec["variant"]))
        if (self.spec["group"], rep, self.spec["variant"]) in self.fail:
            return dict(ok=False, rep=rep, error="RuntimeError: boom")
        return fake_turn(self.spec["variant"], rep)

    def close(self):
        self.log.append(("close", self.spec["group"], self.spec["variant"]))


def run_fake(groups, budget_s=1e9, hard_limit_s=1e9, start_s=20.0, turn_s=5.0, fail=()):
    clock, log = Clock(), []
    records, started, skipped = drive(
        groups, lambda spec: FakeWorker(spec, clock, log, start_s, turn_s, set(fail)),
        budget_s, hard_limit_s, clock=clock)
    return records, started, skipped, log


def test_variants_alternate_within_each_repetition():
    groups = plan(["fsdp-0.6.1:3", "core-0.19.2:2"], 3, SIZE)
    keys = [v["key"] for v in VARIANTS]
    assert keys[0] == REFERENCE == "hotfix"
    records, _, _, log = run_fake(groups)
    turns = [entry for entry in log if entry[0] not in ("start", "close")]
    assert [v for _, _, v in turns] == keys * 6  # A B C D A B C D ...
    assert [(g, rep) for g, rep, _ in turns[::4]] == [
        ("fsdp-0.6.1:3", 0), ("fsdp-0.6.1:3", 1), ("fsdp-0.6.1:3", 2),
        ("core-0.19.2:2", 0), ("core-0.19.2:2", 1), ("core-0.19.2:2", 2)]
    # a group's workers all start before its first turn and stop after its last
    assert [e[0] for e in log[:4]] == ["start"] * 4 and log[4][0] == "fsdp-0.6.1:3"
    assert [e[0] for e in log[16:20]] == ["close"] * 4 and log[20][0] == "start"
    assert len(records) == 24
    by_key = {v["key"]: (v["hotfix"], v["fuse"], v["db"]) for v in VARIANTS}
    assert by_key == {"hotfix": (True, True, True), "no-db": (False, True, False),
                      "fuse-off": (False, False, True), "shipped": (False, True, True)}
    specs = groups[0]["workers"] + groups[1]["workers"]
    assert [(s["pkg"], s["zero"]) for s in specs[::4]] == [
        ("megatron_fsdp", 3), ("megatron.core.distributed.fsdp.src.megatron_fsdp", 2)]


def test_unknown_release_or_zero_level_is_refused():
    with pytest.raises(SystemExit):
        plan(["fsdp-9.9:3"], 1, SIZE)
    with pytest.raises(SystemExit):
        plan(["fsdp-0.6.1:1"], 1, SIZE)


def test_a_group_starts_only_if_it_fits_the_budget():
    groups = plan(["fsdp-0.6.1:3", "fsdp-0.6.1:2", "core-0.19.2:3"], 1, SIZE)
    # a group: 20 s start-up + 4 turns x 5 s = 40 s; after two (80 s) 20 s are left of 100
    records, _, skipped, _ = run_fake(groups, budget_s=100)
    assert [r["group"] for r in records[::4]] == ["fsdp-0.6.1:3", "fsdp-0.6.1:2"]
    assert [s["group"] for s in skipped] == ["core-0.19.2:3"]
    assert "a group took 40 s; 20 s were left" in skipped[0]["reason"]
    # the first group runs even when it alone is over the budget
    records, _, skipped, _ = run_fake(groups, budget_s=1)
    assert len(records) == 4 and len(skipped) == 2


def test_no_turn_starts_past_the_hard_limit():
    groups = plan(["fsdp-0.6.1:3"], 3, SIZE)
    records, _, skipped, log = run_fake(groups, hard_limit_s=47)
    # 20 s start-up, then turns of 5 s: the 6th could end at 50 s
    assert len(records) == 5
    assert skipped == [dict(group="fsdp-0.6.1:3", turns=7,
                            reason="stopped before rep1 no-db: --hard-limit-s 47")]
    assert [e[0] for e in log[-4:]] == ["close"] * 4  # the workers are stopped all the same


def test_ratios_are_taken_within_each_repetition():
    records, _, _, _ = run_fake(plan(["fsdp-0.6.1:3"], 3, SIZE))
    (group,) = summarize(records)
    rows = {r["variant"]: r for r in group["rows"]}
    assert rows["hotfix"]["time_ratio"] == dict(median=1.0, min=1.0, max=1.0, n=3)
    # fuse-off: 120/100, 121/110, 108/90 -> 1.2, 1.1, 1.2
    assert rows["fuse-off"]["time_ratio"] == dict(median=1.2, min=1.1, max=1.2, n=3)
    # no-db: 1.01, 1.0, 1.1 -> median 1.01
    assert rows["no-db"]["time_ratio"] == dict(median=1.01, min=1.0, max=1.1, n=3)
    assert rows["no-db"]["mem_ratio"] == dict(median=1.2, min=1.2, max=1.2, n=3)
    assert [run["step_ms_median"] for run in rows["shipped"]["runs"]] == [100.0, 100.0, 90.0]
    assert rows["hotfix"]["pooled"]["step_ms_min"] == 88.0  # over the three runs' steps
    assert rows["hotfix"]["n_ok"] == 3
    assert records[0]["result"]["te"] == "2.20.2"  # the worker's identity goes with each turn


def test_a_failure_is_reported_and_leaves_its_repetition_out():
    fail = {("fsdp-0.6.1:3", 1, "hotfix"), ("fsdp-0.6.1:3", 2, "shipped"),
            ("start", "fsdp-0.6.1:3", "no-db")}
    records, started, _, _ = run_fake(plan(["fsdp-0.6.1:3"], 3, SIZE), fail=fail)
    assert len(records) == 12 and [w["ok"] for w in started] == [True, False, True, True]
    rows = {r["variant"]: r for r in summarize(records)[0]["rows"]}
    # without the hotfix's rep1 only reps 0 and 2 give fuse-off ratios: 1.2 and 1.2
    assert rows["fuse-off"]["time_ratio"] == dict(median=1.2, min=1.2, max=1.2, n=2)
    assert rows["shipped"]["n_ok"] == 2 and rows["shipped"]["time_ratio"]["n"] == 1
    failed = [run for run in rows["shipped"]["runs"] if not run["ok"]]
    assert failed == [dict(rep=2, ok=False, turn_s=5.0, error="RuntimeError: boom")]
    assert rows["no-db"]["n_ok"] == 0 and rows["no-db"]["time_ratio"] is None
    assert rows["no-db"]["runs"][0]["error"] == "start-up failed: ImportError: no TE"


# A worker whose set-up and turns are stand-ins, run through the real protocol (serve/Worker).
FAKE_WORKER = """
import json, os, sys, time
sys.path.insert(0, {bench!r})
from safe_choices.summary import step_stats
from safe_choices.worker import serve
spec = json.loads(sys.argv[1])
behaviour = os.environ["FAKE_BEHAVIOUR"]
MEDIANS = {medians!r}

def start(info):
    print("noise from a library on stdout")
    if behaviour == "die":
        os._exit(3)
    if behaviour == "raise":
        raise ImportError("no TE here")
    info.update(n_params=42, te="fake")

    def turn(rep, out):
        if behaviour == "turn-raises" and rep == 1:
            raise RuntimeError("boom at rep 1")
        m = MEDIANS[spec["variant"]][rep]
        out.update(step_ms=[m], peak_mem_mb=1.0, **step_stats([m]))
    return turn

serve(start)
"""


def real_worker(spec, behaviour, tmp_path):
    code = FAKE_WORKER.format(bench=str(PACKAGE.parent), medians=MEDIANS)
    env = dict(os.environ, FAKE_BEHAVIOUR=behaviour)
    log = tmp_path / f"{spec['variant']}-{behaviour}.log"
    return Worker([sys.executable, "-c", code, json.dumps(spec)], env, str(log), 60, 60)


def test_worker_protocol(tmp_path):
    spec = plan(["fsdp-0.6.1:3"], 1, SIZE)[0]["workers"][2]
    w = real_worker(spec, "turn-raises", tmp_path)
    ready = w.ready()
    assert ready["ok"] and ready["n_params"] == 42 and ready["start_s"] >= 0
    first, second, third = w.turn(0), w.turn(1), w.turn(2)
    assert first["ok"] and first["step_ms_median"] == 120.0 and first["rep"] == 0
    assert not second["ok"] and second["error"] == "RuntimeError: boom at rep 1"
    assert "Traceback" in second["traceback"]
    assert third["ok"] and third["step_ms_median"] == 108.0
    w.close()
    assert w.proc.returncode == 0
    assert "noise from a library on stdout" in (tmp_path / "fuse-off-turn-raises.log").read_text()

    w = real_worker(spec, "raise", tmp_path)
    ready = w.ready()
    assert not ready["ok"] and ready["error"] == "ImportError: no TE here"
    late = w.turn(0)  # it exits after a failed start-up
    assert not late["ok"] and late["error"].startswith("worker")
    w.close()

    w = real_worker(spec, "die", tmp_path)
    ready = w.ready()
    assert not ready["ok"] and "worker exited (rc 3)" in ready["error"]
    assert "noise from a library" in ready["error"]  # the log's tail says what it printed
    w.close()


def test_drive_with_real_worker_processes(tmp_path):
    groups = plan(["fsdp-0.6.1:3"], 2, SIZE)
    records, started, skipped = drive(
        groups, lambda spec: real_worker(spec, "ok", tmp_path), 1e9, 1e9)
    assert [w["ok"] for w in started] == [True] * 4 and not skipped
    assert [(r["rep"], r["variant"]) for r in records] == [
        (rep, v["key"]) for rep in range(2) for v in VARIANTS]
    rows = {r["variant"]: r for r in summarize(records)[0]["rows"]}
    assert rows["fuse-off"]["time_ratio"] == dict(median=1.15, min=1.1, max=1.2, n=2)


def test_gemm_flops_count_every_weight_once_per_token_and_pass():
    size = dict(SIZES["full"])
    h, f = size["hidden"], size["ffn"]
    biases_and_norms = 2 * h + 3 * h + h + 2 * h + f + h
    weights = unit_params(h, f) - biases_and_norms
    assert gemm_flop(size) == 6 * size["units"] * weights * 8192  # 4096 tokens x 2
    assert 5.9e13 < gemm_flop(size) < 6.0e13


def doc_for(records, skipped=()):
    return dict(date_utc="2026-12-03 21:00", size=SIZE, records=records, skipped=list(skipped),
                summary=summarize(records))


def test_markdown_table():
    groups = plan(["fsdp-0.6.1:3", "fsdp-0.6.1:2"], 3, SIZE)
    records, _, skipped, _ = run_fake(groups, budget_s=50)
    text = render_markdown(doc_for(records, skipped))
    assert "h 8, ffn 32: 1.23 M parameters, bf16; 4 tokens x 1 microbatches" in text
    assert "NVIDIA H200, torch 2.11.0+cu130, TransformerEngine 2.20.2" in text
    rows = [line for line in text.splitlines() if line.startswith("| fsdp-0.6.1 | 3 |")]
    assert len(rows) == 4
    fuse_off = next(line for line in rows if "fusion off" in line)
    assert "| 3 | 120.0, 121.0, 108.0 |" in fuse_off
    assert "| 1100 | 1.200 [1.100–1.200] | 1.100 [1.100–1.100] |" in fuse_off
    assert "Not run: fsdp-0.6.1:2" in text
    assert compact_table(doc_for(records)).count("fsdp-0.6.1:3") == 4


def test_cli_dry_and_report(tmp_path):
    proc = subprocess.run([sys.executable, str(PACKAGE), "--dry"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "4 groups, 48 turns, 1208279040 parameters"  # 6 units, h 4096, ffn 16384
    assert lines[1:5] == [f"fsdp-0.6.1:3 rep0 {v['key']}" for v in VARIANTS]
    records, _, _, _ = run_fake(plan(["core-0.19.2:2"], 1, SIZE))
    path = tmp_path / "result.json"
    path.write_text(json.dumps(doc_for(records)))
    proc = subprocess.run([sys.executable, str(PACKAGE), "--report", str(path)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("| core-0.19.2 | 2 |") == 4
