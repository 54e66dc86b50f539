#!/usr/bin/env python3
"""GPU validation cases of Megatron-FSDP's gradient double buffer, many per process.

``run_case(spec) -> dict`` builds a fresh model of FSDP units, wraps it in ``MegatronFSDP`` on a
fake process group of world size 2 (one GPU; the group and its mesh are made once per process),
trains it for ``steps`` steps of ``microbatches`` microbatches (optionally with a real optimizer
step on Megatron-FSDP's sharded parameters), and returns the gradients of every step, the losses
and the final parameters, compared bit for bit with a saved serialized run of the same case.

What is per process, because it is fixed at import or CUDA initialisation: the release (its
folder on ``PYTHONPATH``, the import path ``pkg``), the hotfix (``fix="hotfix"`` imports
``mfsdp_hotfix`` before Megatron; ``MFSDP_HOTFIX=0`` keeps it off, ``MFSDP_HOTFIX_AUDIT`` arms the
audit), ``CUDA_LAUNCH_BLOCKING=1`` (the serialized truth), ``TORCH_CUDA_SANITIZER=1``, the fake
group's work semantics (``pg``) and TransformerEngine. A case that crashes is recorded and the
next case starts from a fresh model; an error that leaves the CUDA context unusable marks the
record ``fatal`` so that the caller starts a new process. The process's part lives in
``harness_process``; a case's model in ``emulated_layers`` (or ``te_layers``), its truth in
``serialized_truth``.

Spec keys (defaults in ``DEFAULTS``): ``pkg``, ``fix``, ``pg``, ``layer`` (``emulated`` or a
``te-*`` family of ``te_layers``), ``fuse``, ``delay_wgrad``, ``zero`` (1/2/3), ``db`` (double
buffer), ``hidden``, ``units`` (a list of ``{"ffn": int, "norm": bool}``, or an int with ``ffn``
and ``norm``), ``head``, ``tokens``, ``microbatches``, ``steps``, ``warmup``, ``dtype``
(fp32/bf16), ``optimizer`` (None/"adam"), ``faults`` (a ``schedule_faults.Schedule`` as a dict),
``truth`` (``{"mode": "save"|"compare", "path": ...}``), ``cycles_per_ms``, ``timing``,
``protocol`` (how each step's microbatches are driven: ``megatron-lm``, Megatron-LM's
``no_sync()`` around every microbatch but the last, or ``auto-sync``; see
``mfsdp_hotfix/selftest/protocol.py``). Records made before ``protocol`` existed built
``MegatronFSDP`` with its default ``sync_model_each_microbatch=False`` and called no
``no_sync()``: for ZeRO-2/3 without HSDP the release reduces the same way as under
``megatron-lm`` (it reduces sharded gradients after every backward either way).

The command line runs one case (used by run_matrix.py) and writes its record to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import audit_counts  # noqa: E402
import comparison  # noqa: E402  (no torch at import)
import schedule_faults  # noqa: E402
import serialized_truth  # noqa: E402
import slot_trace  # noqa: E402
from harness_process import Process, process_for  # noqa: E402
from shard_optimizer import ShardOptimizer  # noqa: E402
from step_timing import step_times  # noqa: E402


def _load_protocol() -> Any:
    """``mfsdp_hotfix/selftest/protocol.py`` loaded by its path: importing the package would arm
    the hotfix, and the "as shipped" cases must run the release unpatched."""
    import importlib.util

    name = "_mfsdp_hotfix_protocol"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(HERE), "mfsdp_hotfix", "selftest", "protocol.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


protocol = _load_protocol()

DEFAULTS: dict[str, Any] = dict(
    pkg="megatron_fsdp", fix="none", pg="nccl_sem", layer="emulated", fuse=True,
    delay_wgrad=False, zero=2, db=True, hidden=512, units=4, ffn=1024, norm=False, head=False,
    tokens=2048, microbatches=2, steps=3, warmup=0, dtype="fp32", optimizer=None, lr=1e-3,
    faults=None, truth=None, cycles_per_ms=0.0, timing=False, read_grads=True,
    trace_slots=False, input_seed=10_000, model_seed=1234, truth_wait_s=300.0,
    protocol=protocol.DEFAULT)


# ---------------------------------------------------------------------------- one case
def normalise(spec: dict[str, Any]) -> dict[str, Any]:
    s = dict(DEFAULTS)
    s.update(spec)
    if isinstance(s["units"], int):
        s["units"] = [{"ffn": s["ffn"], "norm": bool(s["norm"])} for _ in range(s["units"])]
    return s


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one case; never raises for a crash of the release (recorded in the result)."""
    s = normalise(spec)
    res: dict[str, Any] = {"id": s.get("id"), "spec": spec, "crashed": False, "error": None,
                           "fatal": False, "t_start": time.time()}
    proc = None
    try:
        proc = process_for(s)
        res["process"] = proc.info
        _run(proc, s, res)
    except BaseException as e:  # a crash of the release is a result, not a harness failure
        if isinstance(e, KeyboardInterrupt):
            raise
        # a configuration the release cannot run is refused before the first step: no crash
        res["unsupported"] = bool(getattr(e, "unsupported", False))
        res["crashed"] = not res["unsupported"]
        msg = str(e).strip().splitlines()
        res["error_type"] = type(e).__name__
        res["error"] = f"{type(e).__name__}: {' | '.join(msg[:3])[:600]}"
        res["traceback"] = traceback.format_exc()[-3000:]
        if s["truth"] and s["truth"].get("mode") == "save":
            serialized_truth.mark_crashed(s["truth"]["path"], res["error"])
    finally:
        schedule_faults.set_schedule(None)
        if proc is not None:
            res["fatal"] = _cleanup(proc) or _looks_fatal(res.get("error") or "")
    if s["truth"] and s["truth"].get("mode") == "compare" and "comparison" not in res:
        res["comparison"] = comparison.not_compared(
            "unsupported" if res.get("unsupported") else "crash", truth_crashed=None)
    res["wall_s"] = round(time.time() - res["t_start"], 3)
    return res


def _looks_fatal(error: str) -> bool:
    return any(m in error for m in ("CUDA error", "AcceleratorError", "illegal memory access",
                                    "device-side assert", "CUBLAS_STATUS", "cudaError"))


def _cleanup(proc: Process) -> bool:
    """Free the case's model; True when the CUDA context looks unusable."""
    try:  # a crash inside a coalescing manager must not leave later collectives 'coalescing'
        from torch.distributed import distributed_c10d as c10d

        c10d._world.pg_coalesce_state.clear()
    except Exception:
        pass
    gc.collect()
    if proc.cpu:
        return False
    try:
        proc.torch.cuda.synchronize()
        proc.torch.cuda.empty_cache()
        return False
    except Exception:
        return True


def _run(proc: Process, s: dict[str, Any], res: dict[str, Any]) -> None:
    """Build the case's model, train it, record what it did and settle its truth."""
    torch = proc.torch
    if s["fix"] != proc.key["fix"]:
        raise ValueError("fix is per process")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[s["dtype"]]
    audit_counts.reset()

    torch.manual_seed(s["model_seed"])
    module, model = _wrap(proc, s, res, dtype)
    slot_log = proc.trace_slots() if s["trace_slots"] else None
    if slot_log is not None:
        slot_log.clear()

    opt = None
    if s["optimizer"]:
        opt = ShardOptimizer(torch, model, s["lr"])

    faults = None
    if s["faults"] and os.environ.get("CUDA_LAUNCH_BLOCKING", "0") != "1":
        faults = schedule_faults.Schedule.from_dict(s["faults"], float(s["cycles_per_ms"]))
    schedule_faults.set_schedule(faults)

    timing = s["timing"] and not proc.cpu
    grads, losses, events = _train(proc, s, model, opt, dtype, timing)
    schedule_faults.set_schedule(None)
    run = {"grads": [g.cpu() for g in grads],
           "losses": torch.stack(losses).cpu() if losses else torch.zeros(0),
           "params": opt.local_params() if opt is not None else None}
    _record(proc, s, res, run, faults, events if timing else None, slot_log)
    _settle_truth(torch, s, res, run)
    del model, module, opt, grads, losses


def _wrap(proc: Process, s: dict[str, Any], res: dict[str, Any], dtype: Any
          ) -> tuple[Any, Any]:
    """The case's model, wrapped in ``MegatronFSDP`` as the spec says: (module, wrapped)."""
    dev = proc.device
    unit_cls, module = build_model(proc, s, dtype, dev)
    cfg = proc.mfmod.DistributedDataParallelConfig(
        data_parallel_sharding_strategy={1: "optim", 2: "optim_grads", 3: "optim_grads_params"}[
            s["zero"]],
        outer_dp_sharding_strategy="no_shard", overlap_grad_reduce=True, overlap_param_gather=True,
        average_in_collective=False, fsdp_double_buffer=bool(s["db"]), check_for_nan_in_grad=False,
        # the second double-buffer allocator (megatron-fsdp 0.6, megatron-core 0.19)
        **({"megatron_fsdp_max_pool_double_buffer": True} if s.get("maxpool") else {}),
        # N-slot pools (NVIDIA PR #6316); a release without the field raises TypeError naming it
        **({"fsdp_buffer_count": int(s["buffer_count"])} if s.get("buffer_count") else {}))
    dist_index = proc.mfpkg.FSDPDistributedIndex(device_mesh=proc.mesh, dp_shard_dim="dp",
                                                 tp_dim="tp")
    model = proc.mfpkg.MegatronFSDP(module, dist_index, ddp_config=cfg,
                                    mixed_precision_policy=proc.mfpkg.MixedPrecisionPolicy(),
                                    fsdp_unit_modules=[unit_cls], device=dev,
                                    **protocol.wrap_options(s["protocol"]))
    protocol.verify(model, s["protocol"])
    if proc.hotfix is not None:
        try:
            res["hotfix_status"] = proc.hotfix.status()
        except Exception as e:  # report, don't fail the case
            res["hotfix_status"] = f"status() failed: {type(e).__name__}: {e}"
    pgb = model.param_and_grad_buffer
    res["n_buckets"] = len(pgb.parameter_groups)
    res["double_buf_units"] = list(getattr(pgb, "double_buf_units", []) or [])
    if s["delay_wgrad"]:
        import te_layers

        res["delay_wgrad_hooks"] = te_layers.attach_delay_wgrad_hooks(module, pgb)
    return module, model


def _train(proc: Process, s: dict[str, Any], model: Any, opt: ShardOptimizer | None, dtype: Any,
           timing: bool) -> tuple[list[Any], list[Any], list[tuple[Any, Any]]]:
    """``warmup + steps`` steps, each of ``microbatches`` microbatches driven by the spec's
    protocol: every step's gradients (when read), every microbatch's loss, the timed steps'
    CUDA events."""
    torch = proc.torch
    dev = proc.device
    pgb = model.param_and_grad_buffer

    grads, losses, events = [], [], []
    gen = torch.Generator(device=dev)
    total = s["warmup"] + s["steps"]
    if not proc.cpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for step in range(total):
        model.zero_grad_buffer()
        if timing:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()

        def microbatch(mb: int, step: int = step, model: Any = model,
                       losses: list[Any] = losses) -> None:
            gen.manual_seed(s["input_seed"] + 100 * step + mb)
            x = torch.randn(s["tokens"], s["hidden"], device=dev, dtype=dtype, generator=gen,
                            requires_grad=True)
            loss = model(x).float().square().mean()
            loss.backward()
            losses.append(loss.detach())

        protocol.accumulate(model, s["protocol"], s["microbatches"], microbatch)
        model.finish_grad_sync()
        if timing:
            end.record()
            if step >= s["warmup"]:
                events.append((start, end))
        if s["read_grads"]:
            grads.append(torch.cat([grp.main_grad_buffer.data.detach().float().reshape(-1)
                                    for grp in pgb.parameter_groups
                                    if grp.main_grad_buffer is not None]).clone())
        if opt is not None:
            opt.step()
    if not proc.cpu:
        torch.cuda.synchronize()  # the only host synchronisation: no step waits for the host
    return grads, losses, events


def _record(proc: Process, s: dict[str, Any], res: dict[str, Any], run: dict[str, Any],
            faults: Any, events: list[tuple[Any, Any]] | None,
            slot_log: list[tuple[str, int, Any]] | None) -> None:
    """What the case did, into its record (``events``: None when its steps were not timed)."""
    torch = proc.torch
    res["steps_done"] = s["warmup"] + s["steps"]
    if not proc.cpu:
        res["peak_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    res["losses"] = [float(v) for v in run["losses"]]
    res["digest"] = serialized_truth.digest(run)
    if faults is not None:
        res["faults"] = faults.report()
    res["shim_stats"] = dict(getattr(proc.shims, "STATS", {}))
    if events is not None:
        res.update(step_times(events))
    for g in run["grads"]:
        if not torch.isfinite(g).all():
            res["nonfinite_grads"] = True
            break
    audit = audit_counts.read()
    if audit is not None:
        res["audit"] = audit
    if slot_log:
        res["slot_trace"] = slot_trace.summarize(slot_log)
    if proc.te_version:
        res["te_version"] = proc.te_version


def _settle_truth(torch: Any, s: dict[str, Any], res: dict[str, Any], run: dict[str, Any]) -> None:
    """A serialized run saves its truth; an asynchronous run compares with it."""
    truth = s["truth"] or {}
    if truth.get("mode") == "save":
        serialized_truth.save(torch, truth["path"], run)
        res["truth_saved"] = truth["path"]
    elif truth.get("mode") == "compare":
        ref = serialized_truth.load(torch, truth["path"], float(s["truth_wait_s"]))
        if ref is None:
            res["comparison"] = comparison.not_compared("crash", truth_crashed=True)
        else:
            res["comparison"] = serialized_truth.compare(run, ref)
            if truth.get("delete"):
                serialized_truth.remove(truth["path"])


# ---------------------------------------------------------------------------- models
def build_model(proc: Process, s: dict[str, Any], dtype: Any, dev: Any) -> tuple[Any, Any]:
    torch = proc.torch
    if s["layer"] == "emulated":
        unit_cls, model_cls = proc.classes
        with torch.device(dev):  # initialise on the GPU: fast, and the same for every case
            return unit_cls, model_cls(s["units"], s["hidden"], bool(s["head"])).to(dtype)
    import te_layers

    te = proc.te()
    return te_layers.build(torch, te, s, dtype, dev, proc.classes[1])



# ---------------------------------------------------------------------------- command line
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--pkg", required=True,
                   help="megatron_fsdp | megatron.core.distributed.fsdp.src.megatron_fsdp")
    p.add_argument("--zero", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--db", type=int, default=1, help="fsdp_double_buffer")
    p.add_argument("--fix", default="none", choices=("none", "hotfix", "ref"),
                   help="none: as shipped; hotfix: import mfsdp_hotfix first; ref: validation/refpatch")
    p.add_argument("--delay-ms", type=float, default=0.0, help="before every reduce-scatter")
    p.add_argument("--cycles-per-ms", type=float, default=0.0)
    p.add_argument("--pg", default="fake", choices=("fake", "nccl_sem"))
    p.add_argument("--units", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--norm", type=int, default=0, help="LayerNorm (non-fused params) in each unit")
    p.add_argument("--head", type=int, default=0,
                   help="plain nn.Linear head outside the FSDP units (bucket outside the pool)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--protocol", default=protocol.DEFAULT, choices=protocol.PROTOCOLS,
                   help="how each step's microbatches are driven (default: Megatron-LM's)")
    p.add_argument("--save-grads", default="")
    p.add_argument("--truth", default="")
    p.add_argument("--no-grads", action="store_true", help="perf runs: do not read grads back")
    p.add_argument("--defer-readback", action="store_true",
                   help="accepted for compatibility: grads are always read back after the last step")
    p.add_argument("--trace-slots", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="")
    return p.parse_args(argv)


def spec_from_args(a: argparse.Namespace) -> dict[str, Any]:
    truth = None
    if a.save_grads:
        truth = {"mode": "save", "path": a.save_grads}
    elif a.truth:
        truth = {"mode": "compare", "path": a.truth}
    return dict(id=a.label, pkg=a.pkg, fix=a.fix, pg=a.pg, zero=a.zero, db=bool(a.db),
                hidden=a.hidden, units=a.units, ffn=a.ffn, norm=bool(a.norm), head=bool(a.head),
                tokens=a.tokens, dtype=a.dtype, steps=a.steps, warmup=a.warmup,
                microbatches=a.microbatches, protocol=a.protocol,
                cycles_per_ms=a.cycles_per_ms, timing=True,
                read_grads=not a.no_grads, trace_slots=a.trace_slots, truth=truth, truth_wait_s=0,
                faults={"seed": 0, "rs": {"fixed_ms": a.delay_ms}} if a.delay_ms > 0 else None)


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    res = run_case(spec_from_args(a))
    res["label"] = a.label
    res["args"] = vars(a)
    res["cuda_launch_blocking"] = os.environ.get("CUDA_LAUNCH_BLOCKING", "0")
    cmp_ = res.get("comparison") or {}
    if cmp_.get("outcome") in ("exact", "wrong"):
        res["max_abs"] = cmp_["max_abs_diff"]
        res["rel_l2"] = cmp_["rel_l2"]
        res["first_bad_step"] = cmp_["first_bad_step"]
    if a.save_grads and not res["crashed"]:
        res["saved_grads"] = a.save_grads
    for k, v in (res.get("process") or {}).items():
        res.setdefault(k, v)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps({k: res.get(k) for k in ("label", "crashed", "error", "rel_l2", "max_abs",
                                              "step_ms_median", "peak_mem_mb")}, default=str))


if __name__ == "__main__":
    main()
