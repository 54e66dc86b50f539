"""``mfsdp-hotfix selftest --gpu``: the before/after on the user's own GPU(s), judged against a
serialized run of the same code and by the on-the-job audit.

Four runs, each in fresh processes (nothing is patched in the caller's process):
``shipped serialized`` and ``hotfix serialized`` (``CUDA_LAUNCH_BLOCKING=1``: every kernel ends
before the next starts, so no stream can race; their gradients are the truth), and ``shipped``
(``MFSDP_HOTFIX=0``) and ``hotfix``, asynchronous, with the audit on, each compared bit for bit
with its own serialized run. A reduce-scatter is made slow (``gpu_shims.install_rs_delay``) so
that a missing ordering shows up as wrong gradients instead of depending on luck. The four start
together and prepare at the same time; the GPU work the proof rests on is done in turns, the
serialized pair together and each asynchronous run alone (``gpu_turns`` says why).

One GPU: one process holds a fake 2-rank group with NCCL work semantics (``gpu_shims``), because
Megatron-FSDP uses the double buffer only with sharded gradients (more than one rank) and NCCL
refuses two ranks on one GPU. Several GPUs: one NCCL rank per GPU, started with torchrun.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mfsdp_hotfix import processes
from mfsdp_hotfix.errors import CannotRun as CannotRun
from mfsdp_hotfix.selftest import gpu_turns
from mfsdp_hotfix.selftest.gpu_spec import LAYER_LABELS, GpuRun, GpuRunResult, merge
from mfsdp_hotfix.selftest.gpu_worker import audit_prefix, report_file
from mfsdp_hotfix.selftest.runner import worker_env
from mfsdp_hotfix.selftest.spec import CaseSpec
from mfsdp_hotfix.verdict_text import block, first_line

WORKER = "mfsdp_hotfix.selftest.gpu_worker"
SERIALIZED = ("shipped serialized", "hotfix serialized")
ASYNCHRONOUS = ("shipped", "hotfix")


@dataclass
class GpuPlan:
    """The GPUs used, how ranks are made, and the four runs in the order they are started."""

    gpus: int
    layer: str
    runs: list[GpuRun] = field(default_factory=list)

    @property
    def fake(self) -> bool:
        return self.gpus == 1

    def describe(self) -> str:
        first = self.runs[0]
        ranks = ("1 GPU, a fake 2-rank process group with NCCL work semantics" if self.fake
                 else f"{self.gpus} GPUs, {self.gpus} NCCL ranks (torchrun)")
        delay = (f"each reduce-scatter delayed {first.delay_ms:g} ms" if first.delay_ms
                 else "no reduce-scatter delay")
        return (f"{ranks}; {first.units} units of {LAYER_LABELS[self.layer]}, hidden "
                f"{first.hidden}, {first.tokens} tokens, {first.dtype}, ZeRO-{first.zero}, "
                f"fsdp_double_buffer=True, {first.steps} steps x {first.microbatches} "
                f"microbatches ({first.protocol} protocol); {delay}")


def build_plan(visible_gpus: int, gpus: int | None = None, layer: str = "auto",
               te_found: bool = False, **run: Any) -> GpuPlan:
    """The plan for ``visible_gpus`` (``gpus``: how many to use, default all): 1 GPU gives a fake
    2-rank group in one process, N give N NCCL ranks. ``layer`` "auto" is TransformerEngine's
    ``te.LayerNormMLP`` when ``transformer_engine`` is importable, else the emulated contract.
    ``run``: further :class:`GpuRun` fields (flavour, zero, delay_ms, dtype, ...)."""
    if visible_gpus < 1:
        raise CannotRun("no CUDA GPU is visible to torch here")
    use = visible_gpus if gpus is None else gpus
    if use < 1 or use > visible_gpus:
        raise CannotRun(f"--gpus {use} asked for, {visible_gpus} CUDA GPU(s) visible")
    if layer == "auto":
        layer = "te-layernorm-mlp" if te_found else "emulated"
    elif layer.startswith("te-") and not te_found:
        raise CannotRun(f"--layer {layer} needs TransformerEngine, and transformer_engine is not "
                        "importable here (use --layer emulated, or auto)")
    runs = [GpuRun(variant=variant, serialized=serialized, layer=layer, fake=use == 1,
                   ranks=2 if use == 1 else use, **run)
            for serialized in (True, False) for variant in ("shipped", "hotfix")]
    return GpuPlan(gpus=use, layer=layer, runs=runs)


def command(run: GpuRun, run_file: str, out_dir: str, python: str = sys.executable) -> list[str]:
    """The command line of one run: the worker, or torchrun starting one worker per GPU."""
    if run.fake:
        return [python, "-m", WORKER, run_file, out_dir]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(run.ranks), "-m", WORKER, run_file, out_dir]


def environment(run: GpuRun, out_dir: str, path: str | None = None) -> dict[str, str]:
    """The workers' environment: the release first on the path, ``MFSDP_HOTFIX=0`` for the
    shipped variant, ``CUDA_LAUNCH_BLOCKING=1`` exactly for the serialized runs, the audit on for
    the asynchronous ones, temporary files in ``out_dir``."""
    env = worker_env(CaseSpec(path=path, hotfix="off" if run.variant == "shipped" else "on"))
    env.pop("CUDA_LAUNCH_BLOCKING", None)
    env.pop("MFSDP_HOTFIX_AUDIT", None)
    if run.serialized:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    else:
        env["MFSDP_HOTFIX_AUDIT"] = audit_prefix(out_dir, run)
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS with several streams
    # What the runs leave in a temporary folder (torchrun's torchelastic_* when it is killed)
    # goes with the runs' own folder.
    env["TMPDIR"] = out_dir
    if run.fake:
        # torch's FakeStore has no set/get: nothing to exchange between ranks in one process
        env["MFSDP_HOTFIX_CROSS_RANK_CHECK"] = "off"
    else:
        env.setdefault("MFSDP_HOTFIX_CROSS_RANK_TIMEOUT", "20")
    return env


def probe_cuda() -> int:
    """The CUDA GPUs visible to this environment's torch. Counted without creating a CUDA
    context: the driver holds none while the runs use the GPU (they report its name)."""
    import torch

    try:
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    except Exception as exc:  # a driver/runtime mismatch, a broken device
        raise CannotRun(f"CUDA does not work here ({type(exc).__name__}: {exc})") from exc
    if not available:
        why = ("this torch is a CPU build" if torch.version.cuda is None
               else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU")
        raise CannotRun(f"no CUDA GPU: {why}")
    return count


def te_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


Launcher = Callable[[list[GpuRun], str, str | None, TextIO], list[GpuRunResult]]


def launch(runs: list[GpuRun], out_dir: str, path: str | None, progress: TextIO
           ) -> list[GpuRunResult]:
    """Start ``runs`` together, give them the GPU in turns (``gpu_turns``), wait for them
    (killing a run past its timeout), merge each. However this ends, no process of theirs is
    left (``processes.supervised``)."""
    started = time.monotonic()
    turns = gpu_turns.Turns(runs, out_dir)
    with processes.supervised() as children, contextlib.ExitStack() as files:
        procs = []
        for run in runs:
            run_file = os.path.join(out_dir, f"{run.key}.run.json")
            Path(run_file).write_text(run.to_json())
            log = files.enter_context(open(os.path.join(out_dir, f"{run.key}.log"), "w+b"))
            proc = children.start(command(run, run_file, out_dir),
                                  env=environment(run, out_dir, path), stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            procs.append((run, proc, log))
        timed_out = {run.key: False for run in runs}
        ended = {run.key: started for run in runs}
        last_tick = started
        while len(turns.ended) < len(runs):
            now = time.monotonic()
            for run, proc, _ in procs:
                if proc.poll() is None and now - started > run.timeout_s:
                    timed_out[run.key] = True
                    children.end(proc)
                if proc.poll() is not None and run.key not in turns.ended:
                    ended[run.key] = now
                    turns.end(run)
            granted = turns.advance()
            if granted:
                progress.write(f"selftest:   {' and '.join(r.name for r in granted)}: on the "
                               f"GPU, {now - started:.1f}s\n")
            if now - last_tick >= 15.0:
                last_tick = now
                waiting = ", ".join(run.name for run, proc, _ in procs if proc.poll() is None)
                progress.write(f"selftest:   still running ({waiting}), {now - started:.0f}s\n")
            progress.flush()
            time.sleep(0.05)
        results = []
        for run, proc, log in procs:
            code = proc.wait()
            log.seek(0)
            tail = log.read().decode(errors="replace")[-6000:]
            reports = [_read(report_file(out_dir, run, r)) for r in range(run.processes)]
            audit = [_read(Path(f"{audit_prefix(out_dir, run)}.rank{r}.json"))
                     for r in range(run.processes)]
            result = merge(run, reports, [a for a in audit if a is not None], [code],
                           timed_out[run.key], tail)
            result.wall_s = ended[run.key] - started
            results.append(result)
    return results


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run_gpu_selftest(plan: GpuPlan, path: str | None = None, out: TextIO | None = None,
                     progress: TextIO | None = None, launcher: Launcher = launch
                     ) -> dict[str, GpuRunResult]:
    """The four runs, started together and given the GPU in turns; prints the table and the
    verdict line. Their folder is removed however this ends."""
    stream = out if out is not None else sys.stdout
    talk = progress if progress is not None else sys.stderr
    talk.write(f"selftest: GPU mode: {plan.describe()}\n")
    talk.write(f"selftest: running {', '.join(r.name for r in plan.runs)} (prepared together, "
               "on the GPU in turns) ...\n")
    talk.flush()
    results: dict[str, GpuRunResult] = {}
    with processes.supervised() as children:
        out_dir = children.temp_dir("mfsdp-gpu-selftest-")
        for result in launcher(plan.runs, out_dir, path, talk):
            results[result.run.name] = result
            talk.write(f"selftest: {result.run.name}: {result.outcome()} in "
                       f"{result.wall_s:.1f}s{_phases(result)}\n")
    talk.flush()
    stream.write(format_gpu_table(plan, results) + "\n")
    stream.write(conclusion(plan, results)[1] + "\n")
    stream.flush()
    return results


def _phases(result: GpuRunResult) -> str:
    """`` (prepared in 14.2s, 1.6s on the GPU)``: where a run's time went."""
    if result.prepare_s is None:
        return ""
    turn = f", {result.turn_s:.1f}s on the GPU" if result.turn_s is not None else ""
    return f" (prepared in {result.prepare_s:.1f}s{turn})"


def _cell(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_gpu_table(plan: GpuPlan, results: dict[str, GpuRunResult]) -> str:
    first = next(iter(results.values()), None)
    lines = []
    if first is not None and first.release:
        lines.append(f"Megatron-FSDP: {first.release.get('dist')} {first.release.get('version')}"
                     f" ({first.release.get('flavour')}) at {first.release.get('path')}")
    if first is not None and first.gpu:
        lines.append(f"GPU: {first.gpu}" + (f"; TransformerEngine {first.te_version}"
                                            if first.te_version else ""))
    header = ("run", "outcome", "rel. L2 vs serialized", "max |diff|",
              "audit: unordered/reuses", "delayed RS", "time s")
    rows = [header]
    for name in SERIALIZED + ASYNCHRONOUS:
        r = results.get(name)
        if r is None:
            continue
        audit = (f"{_cell(r.audit_unordered, 'd')}/{_cell(r.audit_reuses, 'd')}"
                 if not r.run.serialized else "-")
        rows.append((name, r.outcome(), _cell(r.rel_l2, ".3g"), _cell(r.max_abs, ".3g"),
                     audit, str(r.rs_delayed), f"{r.wall_s:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    table = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    table.insert(1, "  ".join("-" * w for w in widths))
    lines += table
    for name in SERIALIZED + ASYNCHRONOUS:
        r = results.get(name)
        if r is not None and r.exception:
            lines.append(f"{name}: {_first_line(r.exception)}")
        if r is not None and r.hotfix and not r.run.serialized:
            lines.append(f"{name}: {r.hotfix}")
    lines.append("exact: bit-identical to the same run serialized (CUDA_LAUNCH_BLOCKING=1); "
                 "wrong: it differs; crash: it raised or died")
    for name in SERIALIZED + ASYNCHRONOUS:  # what to report when the hotfix side broke
        r = results.get(name)
        if r is None or not r.crashed or (r.run.variant == "shipped"
                                          and r.reports == r.run.processes):
            continue
        detail = r.traceback if r.reports == r.run.processes and r.traceback else r.log_tail
        tail = (detail or "").strip().splitlines()[-15:]
        lines += [f"--- {name}: last lines of its " + ("traceback" if detail is r.traceback
                                                       else "output") + " ---", *tail]
    return "\n".join(lines)


def _audit_problem(result: GpuRunResult) -> str | None:
    """Why the audit's counts of a run cannot back a verdict (None: they can)."""
    if result.audit_files < result.run.processes:
        return (f"the audit wrote {result.audit_files} of {result.run.processes} rank file(s)")
    if result.audit_state != "on":
        return f"the audit was not on ({result.audit_state})"
    if not result.audit_reuses:
        return ("the audit saw 0 gradient-slot reuses, so it checked nothing (the double "
                "buffer was not exercised)")
    return None


def _first_line(text: str | None) -> str:
    return text.strip().splitlines()[0][:200].strip() if text and text.strip() else ""


def layer_words(plan: GpuPlan, results: dict[str, GpuRunResult]) -> str:
    """``te.LayerNormMLP (TE 2.20.2)``, ``te.Linear (TE ...)`` or the emulated contract."""
    if plan.layer == "emulated":
        return "the emulated fused-wgrad contract"
    version = next((r.te_version for r in results.values() if r.te_version), None)
    name = {"te-layernorm-mlp": "te.LayerNormMLP", "te-linear": "te.Linear"}[plan.layer]
    return f"{name} (TE {version})" if version else name


def shipped_meaning(shipped: GpuRunResult) -> str:
    """What the run without the hotfix showed, in words."""
    outcome = shipped.outcome()
    audit = (f"the audit found {shipped.audit_unordered} unordered of {shipped.audit_reuses} "
             "gradient-slot reuses" if shipped.audit_reuses is not None else "no audit counts")
    if outcome == "crash":
        first = _first_line(shipped.exception)
        if shipped.audit_crashed:
            audit = "the audit recorded the crash" + (
                f" after {shipped.audit_unordered} unordered of {shipped.audit_reuses} "
                "gradient-slot reuses" if shipped.audit_reuses else "")
        return f"as shipped: CRASH ({first}); {audit}"
    if outcome == "wrong":
        return (f"as shipped: WRONG gradients (rel. L2 {_cell(shipped.rel_l2, '.3g')} vs its "
                f"serialized run); {audit}")
    if outcome == "exact":
        if shipped.audit_unordered:
            return (f"as shipped: gradients exact in this run, but {audit}: the race is there "
                    "and this run's timing did not expose it (a longer --delay-ms makes that "
                    "likelier)")
        return (f"as shipped: gradients exact and {audit}: this copy shows no slot race in "
                "this configuration")
    return f"as shipped: {outcome}; {audit}"


def conclusion(plan: GpuPlan, results: dict[str, GpuRunResult]) -> tuple[bool, str]:
    """PASS when the hotfix run is bit-identical to its serialized run and the audit saw more
    than 0 slot reuses, none unordered. The shipped run is reported, never judged."""
    truth, hotfix = results.get("hotfix serialized"), results.get("hotfix")
    shipped = results.get("shipped")
    what = next((f"{r.release.get('dist')} {r.release.get('version')}"
                 for r in results.values() if r.release.get("dist")), "Megatron-FSDP")
    where = f"{plan.gpus} GPU" + ("s" if plan.gpus > 1 else "")
    problem = None
    if truth is None or hotfix is None:
        problem = "the hotfix runs did not run"
    elif truth.crashed:
        problem = ("with the hotfix, the serialized run (the truth) crashed: "
                   f"{_first_line(truth.exception)}")
    elif hotfix.outcome() == "crash":
        problem = f"with the hotfix, the run crashed: {_first_line(hotfix.exception)}"
        if plan.layer != "emulated" and "transformer_engine" in (hotfix.traceback or ""):
            problem += " (inside TransformerEngine: if TE itself fails here, try --layer emulated)"
    elif hotfix.outcome() != "exact":
        problem = (f"with the hotfix, the gradients are {hotfix.outcome()} against the serialized"
                   f" run (rel. L2 {_cell(hotfix.rel_l2, '.3g')}): please report this")
    else:
        audit_problem = _audit_problem(hotfix)
        if audit_problem is not None:
            problem = f"with the hotfix: {audit_problem}"
        elif hotfix.audit_unordered:
            problem = (f"with the hotfix, the audit found {hotfix.audit_unordered} unordered of "
                       f"{hotfix.audit_reuses} gradient-slot reuses: please report this")
    passed = problem is None
    if passed:
        assert hotfix is not None
        delay = (f", {hotfix.rs_delayed} reduce-scatters delayed {hotfix.run.delay_ms:g} ms"
                 if hotfix.run.delay_ms else ", no reduce-scatter delay")
        state = "with the hotfix, bit-identical to the serialized run"
        details = [f"{what} with {layer_words(plan, results)}{delay}: with the hotfix the "
                   "gradients are bit-identical to the serialized run and the audit found 0 "
                   f"unordered of {hotfix.audit_reuses} gradient-slot reuses"]
    else:
        state = (problem or "").split(": ", 1)[0]
        details = [f"{what} with {layer_words(plan, results)}: {problem}"]
    if shipped is not None:
        details.append(shipped_meaning(shipped))
    word = "PASS" if passed else "FAIL"
    first = first_line(f"selftest: {word}: on {where}, {what}: {state}"
                       + (f"; as shipped: {shipped.outcome()}" if shipped is not None else ""),
                       "" if passed else "details below")
    return passed, block(first, details)


def to_json(plan: GpuPlan, results: dict[str, GpuRunResult]) -> dict[str, Any]:
    passed, told = conclusion(plan, results)
    first, *details = told.splitlines()
    return {"verdict": "PASS" if passed else "FAIL", "conclusion": first,
            "details": [line.strip() for line in details], "mode": "gpu",
            "gpus": plan.gpus, "fake_group": plan.fake, "layer": plan.layer,
            "runs": [results[name].to_dict() for name in SERIALIZED + ASYNCHRONOUS
                     if name in results]}
