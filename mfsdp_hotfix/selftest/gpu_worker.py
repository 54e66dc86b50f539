"""One process of ``selftest --gpu``: the whole fake 2-rank world on one GPU, or one NCCL rank.

Run by the driver (``gpu``) as ``python -m mfsdp_hotfix.selftest.gpu_worker RUN_JSON OUT_DIR``,
or under torchrun (one process per GPU; rank from ``RANK``/``LOCAL_RANK``), with the release
under test importable and ``MFSDP_HOTFIX=0`` for the shipped variant (``mfsdp_hotfix`` itself is
imported as this module's parent package, before Megatron-FSDP, as a user's ``import
mfsdp_hotfix`` would be). Order matters: install the shims, create the process group, then
import the release (it binds ``torch.distributed`` names at import). Everything up to the sharded
model is prepared while the other runs prepare too; then the rank waits for its run's turn on the
GPU (``gpu_turns``), and in it calibrates the delay, arms it, trains and copies the gradients to
the host.

It trains ``steps`` steps of ``microbatches`` forward/backward passes, driven as ``protocol``
says (``protocol.accumulate``), each ending with ``finish_grad_sync``, without an optimizer step
(weights fixed, inputs change per step), keeps each step's local gradient shards on the GPU
(no host synchronisation between steps, which could hide a race) and reads them back at the end.
A serialized run saves them (``<variant>-truth.rank<R>.pt``); an asynchronous run waits for that
file (or the serialized run's end) and compares them with it, bit for bit. Writes
``OUT_DIR/<run>.rank<R>.json``; exit status 0, or 3 when the run crashed (torchrun then stops the
other ranks).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from mfsdp_hotfix.compare import compare
from mfsdp_hotfix.selftest import gpu_turns
from mfsdp_hotfix.selftest import protocol as accumulation
from mfsdp_hotfix.selftest.gpu_spec import DTYPES, ZERO_STRATEGY, GpuRun
from mfsdp_hotfix.selftest.worker import STANDALONE, VENDORED, _release_info, resolve_flavour
from mfsdp_hotfix.selftest.wrapping import wrap

CRASHED = 3


def truth_file(out_dir: str, run: GpuRun, rank: int) -> Path:
    return Path(out_dir) / f"{run.variant}-truth.rank{rank}.pt"


def report_file(out_dir: str, run: GpuRun, rank: int) -> Path:
    return Path(out_dir) / f"{run.key}.rank{rank}.json"


def audit_prefix(out_dir: str, run: GpuRun) -> str:
    """``MFSDP_HOTFIX_AUDIT`` of a run: the audit writes ``<prefix>.rank<R>.json``."""
    return str(Path(out_dir) / f"{run.key}-audit")


def local_grads(model: Any) -> dict[str, Any]:
    """This rank's gradient shards after ``finish_grad_sync``, by parameter name, cloned on the
    GPU (a parameter whose shard is empty on this rank contributes an empty tensor)."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in sorted(model.module.named_parameters()):
        grad = param.grad
        if grad is None:
            out[name] = torch.empty(0, device=param.device)
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        out[name] = local.detach().clone()
    return out


def compared(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank report's comparison keys (``merge`` sums the squared norms over ranks)."""
    result = compare(got, want)
    return {"compared": True, "exact": result.exact, "max_abs": result.max_abs,
            "diff_sq": result.diff_sq, "ref_sq": result.ref_sq, "steps_compared": result.steps,
            "tensors_compared": result.tensors, "not_exact_because": result.to_dict()[
                "not_exact_because"]}


def run_rank(run: GpuRun, out_dir: str, report: dict[str, Any]) -> None:
    """Prepare, take the run's turn on the GPU, then keep or compare the gradients."""
    import torch

    rank = report["rank"]
    prepared = prepare(run, report)
    report["prepare_s"] = process_age_s()
    if not gpu_turns.take_turn(out_dir, run, rank):
        raise TimeoutError(f"no turn on the GPU within {run.timeout_s:.0f}s")
    turn = time.perf_counter()
    grads = train(run, report, *prepared)
    gpu_turns.flag(out_dir, run, "done", rank).touch()
    report["turn_s"] = time.perf_counter() - turn
    truth = truth_file(out_dir, run, rank)
    if run.serialized:
        partial = truth.with_suffix(".partial")
        torch.save(grads, partial)
        partial.replace(truth)  # whole, or not there: an asynchronous run reads it at once
    elif gpu_turns.wait_for([truth, gpu_turns.flag(out_dir, replace(run, serialized=True),
                                                   "ended")], run.timeout_s) and truth.exists():
        report.update(compared(grads, torch.load(truth)))
    report["crashed"] = False


def process_age_s() -> float:
    """Seconds since this process began (``/proc``): the time to prepare includes the start of
    the interpreter and the imports before ``main``."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


def prepare(run: GpuRun, report: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Everything before the turn: CUDA's context, the shims (the delay not armed yet), the
    process group, TransformerEngine, the release, the sharded model. (model, device, dtype)."""
    flavour = resolve_flavour(run.flavour)  # before importing torch: fail fast
    import torch
    import torch.distributed as dist

    from mfsdp_hotfix.selftest import gpu_shims
    from mfsdp_hotfix.selftest import model as model_lib

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report.update(gpu=torch.cuda.get_device_name(device), torch=torch.__version__,
                  cuda_launch_blocking=os.environ.get("CUDA_LAUNCH_BLOCKING", "0"))
    if run.fake:
        gpu_shims.install_nccl_semantics()
    gpu_shims.install_rs_delay(0)  # armed in the turn, once calibrated alone on the GPU
    if run.fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    else:
        dist.init_process_group("nccl", timeout=timedelta(seconds=max(60.0, run.timeout_s / 2)))
    if run.layer.startswith("te-"):
        import transformer_engine  # type: ignore[import-not-found]

        report["te_version"] = str(getattr(transformer_engine, "__version__", "unknown"))
    package = importlib.import_module(VENDORED if flavour == "core" else STANDALONE)
    report["release"] = _release_info(flavour, package)
    fully_shard = importlib.import_module(package.__name__ + ".fully_shard")

    dtype = getattr(torch, DTYPES[run.dtype])
    net = model_lib.build_on(device, run.layer, run.hidden, run.units, run.seed, dtype)
    model = wrap(fully_shard, net, type(net.units[0]), ZERO_STRATEGY[run.zero], True, device,
                 protocol=run.protocol)
    import mfsdp_hotfix

    report["hotfix"] = (mfsdp_hotfix.summary() if mfsdp_hotfix.status()["hotfix"] != "off"
                        else "mfsdp_hotfix: off (MFSDP_HOTFIX=0): the release as shipped")
    return model, device, dtype


def train(run: GpuRun, report: dict[str, Any], model: Any, device: Any, dtype: Any
          ) -> list[dict[str, Any]]:
    """The turn: calibrate and arm the delay, train, and copy each step's gradients to the host."""
    import torch

    from mfsdp_hotfix.selftest import gpu_shims

    rank = report["rank"]
    rate, _ = gpu_shims.measure_cycles_per_ms()
    cycles = gpu_shims.delay_cycles(run.delay_ms, rate)
    report.update(cycles_per_ms=rate, delay_cycles=cycles)
    gpu_shims.set_rs_delay(cycles)
    gen = torch.Generator(device=device)
    kept = []
    started = time.perf_counter()
    for step in range(run.steps):
        model.zero_grad_buffer()

        def microbatch(micro: int, step: int = step) -> None:
            gen.manual_seed(run.seed + 100_000 * rank + 100 * step + micro)
            x = torch.randn(run.tokens, run.hidden, device=device, dtype=dtype, generator=gen,
                            requires_grad=True)
            model(x).float().square().mean().backward()

        accumulation.accumulate(model, run.protocol, run.microbatches, microbatch)
        model.finish_grad_sync()
        kept.append(local_grads(model))
    torch.cuda.synchronize()
    report["train_s"] = time.perf_counter() - started
    return [{name: g.cpu() for name, g in step.items()} for step in kept]


def main(argv: list[str]) -> int:
    run_json, out_dir = argv
    run = GpuRun.from_json(Path(run_json).read_text())
    rank = 0 if run.fake else int(os.environ.get("RANK", "0"))
    report: dict[str, Any] = {"rank": rank, "run": run.name, "crashed": True}
    started = time.perf_counter()
    try:
        run_rank(run, out_dir, report)
    except BaseException as exc:  # a crash of the release is the run's outcome
        report["exception"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-4000:]
    shims = sys.modules.get("mfsdp_hotfix.selftest.gpu_shims")
    if shims is not None:
        report["rs_calls"] = shims.STATS["rs_calls"]
        report["rs_delayed"] = shims.STATS["rs_sleeps"]
    audit = sys.modules.get("mfsdp_hotfix.audit")
    if audit is not None:  # MFSDP_HOTFIX_AUDIT: this process skips atexit, so finish it here
        try:
            audit.finish()
        except Exception as exc:
            report["audit_error"] = f"{type(exc).__name__}: {exc}"
    report["worker_s"] = time.perf_counter() - started
    import json

    report_file(out_dir, run, rank).write_text(json.dumps(report, default=repr))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a peer stuck in a collective must not hang this rank.
    os._exit(CRASHED if report["crashed"] else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
