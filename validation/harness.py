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
record ``fatal`` so that the caller starts a new process.

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
import hashlib
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import comparison  # noqa: E402  (no torch at import)
import schedule_faults  # noqa: E402


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
PROCESS_KEYS = ("pkg", "fix", "pg")


# ---------------------------------------------------------------------------- the process
class Process:
    """What one Python process sets up once: hotfix import, shims, fake group, release."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.key = {k: spec[k] for k in PROCESS_KEYS}
        self.hotfix = None
        if spec["fix"] == "hotfix":
            import mfsdp_hotfix  # must come before any Megatron-FSDP import

            self.hotfix = mfsdp_hotfix
        import torch
        import torch.distributed as dist

        self.torch = torch
        # MFSDP_VAL_CPU=1: the CPU test of this harness (tests/test_gpu_validation.py): the
        # selftest's torch.cuda stand-in, CPU tensors; nothing races, every case must be exact
        self.cpu = os.environ.get("MFSDP_VAL_CPU") == "1"
        self.device = torch.device("cpu") if self.cpu else torch.device("cuda", 0)
        if self.cpu:
            from mfsdp_hotfix.selftest import cuda_standin

            cuda_standin.install()
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.cuda.set_device(0)
        self.shims = _shims()
        if spec["pg"] == "nccl_sem":
            self.shims.install_nccl_semantics()
        schedule_faults.install()  # outermost: its sleep is enqueued before the collective
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if not dist.is_initialized():
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        self.mesh = init_device_mesh(self.device.type, (2, 1), mesh_dim_names=("dp", "tp"))
        self.mfpkg = importlib.import_module(spec["pkg"])
        self.mfmod = importlib.import_module(spec["pkg"] + ".megatron_fsdp")
        self.pgbmod = importlib.import_module(spec["pkg"] + ".param_and_grad_buffer")
        self.refpatch = None
        if spec["fix"] == "ref":
            self.refpatch = __import__("refpatch").apply(spec["pkg"])
        self.info = {"torch": torch.__version__,
                     "gpu": "cpu" if self.cpu else torch.cuda.get_device_name(0),
                     "release_file": self.mfpkg.__file__,
                     "release_version": release_version(spec["pkg"]),
                     "cuda_launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", "0"),
                     "sanitizer": os.environ.get("TORCH_CUDA_SANITIZER", "0"),
                     "mfsdp_hotfix_env": os.environ.get("MFSDP_HOTFIX"),
                     "audit_env": bool(os.environ.get("MFSDP_HOTFIX_AUDIT")),
                     "pid": os.getpid()}
        self.classes = build_classes(torch)
        self.te_version: str | None = None
        self._slot_log: list[tuple[str, int, Any]] | None = None

    def te(self) -> Any:
        """TransformerEngine, imported on the first te-* case only (CI has no TE)."""
        import te_layers

        te = te_layers.import_te()
        self.te_version = getattr(te, "__version__", "?")
        return te

    def trace_slots(self) -> list[tuple[str, int, Any]]:
        if self._slot_log is None:
            self._slot_log = []
            log = self._slot_log
            orig = self.pgbmod.FixedPoolAllocator.allocate

            def allocate(pool: Any, bucket_id: int, *args: Any, **kw: Any) -> Any:
                had = bucket_id in pool.using_buffer
                out = orig(pool, bucket_id, *args, **kw)
                if not had and bucket_id in pool.using_buffer:
                    log.append((pool.name, bucket_id, pool.using_buffer[bucket_id][0]))
                return out

            self.pgbmod.FixedPoolAllocator.allocate = allocate
        return self._slot_log


_PROCESS: Process | None = None


def process_for(spec: dict[str, Any]) -> Process:
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = Process(spec)
    elif any(_PROCESS.key[k] != spec[k] for k in PROCESS_KEYS):
        raise ValueError(f"this process runs {_PROCESS.key}; a case asked for "
                         f"{ {k: spec[k] for k in PROCESS_KEYS} } (start another process)")
    return _PROCESS


def _shims() -> Any:
    """The NCCL-work-semantics shim (validation/fakepg_shims.py, or its package home)."""
    try:
        import fakepg_shims

        return fakepg_shims
    except ImportError:
        from mfsdp_hotfix.selftest import fakepg  # type: ignore[attr-defined]

        return fakepg


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
            _write_json(s["truth"]["path"] + ".crash", {"error": res["error"]})
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
    torch = proc.torch
    if s["fix"] != proc.key["fix"]:
        raise ValueError("fix is per process")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[s["dtype"]]
    dev = proc.device
    audit_reset()

    torch.manual_seed(s["model_seed"])
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

    grads, losses, events = [], [], []
    gen = torch.Generator(device=dev)
    total = s["warmup"] + s["steps"]
    timing = s["timing"] and not proc.cpu
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
    schedule_faults.set_schedule(None)
    run = {"grads": [g.cpu() for g in grads],
           "losses": torch.stack(losses).cpu() if losses else torch.zeros(0),
           "params": opt.local_params() if opt is not None else None}
    res["steps_done"] = total
    if not proc.cpu:
        res["peak_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    res["losses"] = [float(v) for v in run["losses"]]
    res["digest"] = digest(run)
    if faults is not None:
        res["faults"] = faults.report()
    res["shim_stats"] = dict(getattr(proc.shims, "STATS", {}))
    if timing:
        times = sorted(a.elapsed_time(b) for a, b in events)
        res["step_ms_all"] = [round(a.elapsed_time(b), 3) for a, b in events]
        if times:
            res.update(step_ms_median=round(pct(times, 50), 3), step_ms_min=round(times[0], 3),
                       step_ms_max=round(times[-1], 3), step_ms_p10=round(pct(times, 10), 3),
                       step_ms_p90=round(pct(times, 90), 3))
    for g in run["grads"]:
        if not torch.isfinite(g).all():
            res["nonfinite_grads"] = True
            break
    audit = audit_counts()
    if audit is not None:
        res["audit"] = audit
    if slot_log:
        res["slot_trace"] = summarize_slots(slot_log)
    if proc.te_version:
        res["te_version"] = proc.te_version
    truth = s["truth"] or {}
    if truth.get("mode") == "save":
        save_truth(torch, truth["path"], run)
        res["truth_saved"] = truth["path"]
    elif truth.get("mode") == "compare":
        ref = load_truth(torch, truth["path"], float(s["truth_wait_s"]))
        if ref is None:
            res["comparison"] = comparison.not_compared("crash", truth_crashed=True)
        else:
            res["comparison"] = compare(run, ref)
            if truth.get("delete"):
                _remove(truth["path"])
    del model, module, opt, grads, losses


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


def build_classes(torch: Any) -> tuple[Any, Any]:
    """The emulated TE contract: units of two bias-free Linears with fused wgrad accumulation,
    optionally a LayerNorm at the end (non-fused params on the ordinary autograd path)."""
    nn = torch.nn
    point = schedule_faults.compute_point_class(torch)
    _dummy: dict[Any, Any] = {}

    def dummy_wgrad(w: Any) -> Any:
        key = (tuple(w.shape), w.dtype, w.device)
        t = _dummy.get(key)
        if t is None:
            t = _dummy[key] = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
        return t

    class FusedWgradLinearFn(torch.autograd.Function):
        """TE's fuse_wgrad_accumulation contract: the bound ``weight.get_main_grad`` captured at
        FORWARD time is called lazily in backward, the wgrad GEMM writes straight into it
        (overwrite when ``weight.overwrite_main_grad``, else accumulate), the weight is flagged
        ``grad_added_to_main_grad`` and a dummy wgrad is returned so the post-accumulate hook fires."""

        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, main_grad_func: Any) -> Any:
            ctx.save_for_backward(x)
            ctx.weight = weight
            ctx.main_grad_func = main_grad_func
            return x @ weight.t()

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            w = ctx.weight
            dx = g @ w
            main_grad = ctx.main_grad_func()
            g2 = g.reshape(-1, g.shape[-1])
            x2 = x.reshape(-1, x.shape[-1])
            if getattr(w, "overwrite_main_grad", False):
                torch.mm(g2.t(), x2, out=main_grad)
            else:
                main_grad.addmm_(g2.t(), x2)
            w.grad_added_to_main_grad = True
            return dx, dummy_wgrad(w), None

    class FusedLinear(nn.Module):
        def __init__(self, fan_in: int, fan_out: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(fan_out, fan_in) / fan_in ** 0.5)

        def forward(self, x: Any) -> Any:
            w = self.weight
            getter = getattr(w, "get_main_grad", None)
            if getter is None:
                return x @ w.t()
            return FusedWgradLinearFn.apply(x, w, getter)

    class Unit(nn.Module):
        def __init__(self, h: int, f: int, norm: bool, index: int = 0) -> None:
            super().__init__()
            self.index = index
            self.fc1 = FusedLinear(h, f)
            self.fc2 = FusedLinear(f, h)
            self.norm = nn.LayerNorm(h) if norm else None

        def forward(self, x: Any) -> Any:
            x = point.apply(x, self.index)  # compute-stream fault point (fwd and bwd)
            y = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
            if self.norm is not None:
                y = self.norm(y)
            return x + y

    class Model(nn.Module):
        """Units in order, then an optional plain Linear head outside the units. ``units`` is a
        list of ``{"ffn", "norm"}`` dicts (or, with ``unit_factory``, whatever it takes)."""

        def __init__(self, units: list[dict[str, Any]], h: int, head: bool,
                     unit_factory: Any = None) -> None:
            super().__init__()
            make = unit_factory or (lambda i, u: Unit(h, int(u["ffn"]), bool(u["norm"]), i))
            self.units = nn.ModuleList(make(i, u) for i, u in enumerate(units))
            self.head = nn.Linear(h, h, bias=False) if head else None

        def forward(self, x: Any) -> Any:
            for u in self.units:
                x = u(x)
            if self.head is not None:
                x = self.head(x)
            return x

    return Unit, Model


class ShardOptimizer:
    """A real optimizer step on Megatron-FSDP's sharded parameters, as every release supports it:
    ``finish_grad_sync()`` attaches the reduced gradient shards to the distributed optimizer
    parameters (``model.parameters()`` after construction), ``torch.optim.Adam`` updates their
    local shards, ``install_optimized_model_weights()`` copies them into the model weights.
    Adam runs on the local tensors so that no DTensor dispatch (and no collective) is involved."""

    def __init__(self, torch: Any, model: Any, lr: float) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.local = [_local(p).detach() for p in self.params]
        self.opt = torch.optim.Adam(self.local, lr=lr, foreach=False)

    def step(self) -> None:
        for p, loc in zip(self.params, self.local, strict=False):
            g = p.grad
            loc.grad = None if g is None else _local(g).detach().view_as(loc)
        self.opt.step()
        self.model.install_optimized_model_weights()
        for loc in self.local:
            loc.grad = None

    def local_params(self) -> Any:
        import torch

        return torch.cat([loc.detach().float().reshape(-1).cpu() for loc in self.local])


def _local(t: Any) -> Any:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


# ---------------------------------------------------------------------------- truth & compare
def save_truth(torch: Any, path: str, run: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(run, tmp)
    os.replace(tmp, path)


def load_truth(torch: Any, path: str, wait_s: float) -> dict[str, Any] | None:
    """The serialized run's record (waiting for it while it is being computed); None: it
    crashed, or never came."""
    deadline = time.time() + wait_s
    while not os.path.exists(path):
        if os.path.exists(path + ".crash") or time.time() > deadline:
            return None
        time.sleep(0.2)
    return dict(torch.load(path, map_location="cpu"))


def _bits(t: Any) -> Any:
    import torch

    t = t.float().contiguous()
    return t.view(torch.int32)


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """The run against its serialized truth with the package's comparison: each step's gradients;
    the last step also carries the losses of every step and the final parameters. Adds
    ``losses_exact`` / ``params_exact`` (bit-identical or not) to its record."""
    result = comparison.compare(_steps(run), _steps(ref))
    out: dict[str, Any] = result.to_dict()
    for name in ("losses", "params"):
        if run.get(name) is not None or ref.get(name) is not None:
            out[f"{name}_exact"] = name not in result.differing
    return out


def _steps(run: dict[str, Any]) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = [{"grads": g} for g in run["grads"]]
    if steps:
        steps[-1].update({name: run[name] for name in ("losses", "params")
                          if run.get(name) is not None})
    return steps


def digest(run: dict[str, Any]) -> str:
    """A hash of the bits of every gradient, loss and parameter (truth runs of two variants of
    the same case can be compared without keeping their tensors)."""
    h = hashlib.sha256()
    for t in [*run["grads"], run["losses"], run["params"]]:
        if t is not None:
            h.update(_bits(t).numpy().tobytes())
    return h.hexdigest()[:16]


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, default=str)


# ---------------------------------------------------------------------------- audit
def _audit_obj() -> Any:
    mod = sys.modules.get("mfsdp_hotfix.audit")
    return getattr(mod, "_audit", None) if mod is not None else None


def audit_reset() -> None:
    """Start the audit's counts afresh for this case (its rule state is per process)."""
    audit = _audit_obj()
    if audit is None:
        return
    audit.steps = 0
    for copy in audit.copies.values():
        rule = copy.rule
        if rule is None:
            continue
        rule.reuses = rule.unseen = rule.unordered_count = 0
        rule.unordered.clear()
        rule.crash = None
        rule._bucket_rs.clear()
        rule._slot_reader.clear()


def audit_counts() -> dict[str, Any] | None:
    mod = sys.modules.get("mfsdp_hotfix.audit")
    snap = mod.snapshot() if mod is not None else None
    if snap is None:
        return None
    copies = [c for c in snap.get("copies", []) if c.get("audited") or c.get("note")]
    crash = next((c["crash"] for c in copies if c.get("crashed")), None)
    return {"audit": snap.get("audit"), "reuses": sum(c.get("reuses", 0) for c in copies),
            "unordered": sum(c.get("unordered", 0) for c in copies),
            "unseen": sum(c.get("unseen", 0) for c in copies), "crash": crash,
            "fixes": sorted({f for c in copies for f in c.get("fixes", [])}),
            "first_unordered": next((c.get("first_unordered") for c in copies
                                     if c.get("first_unordered")), None)}


# ---------------------------------------------------------------------------- small helpers
def pct(sorted_vals: list[float], q: float) -> float:
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    k = (len(sorted_vals) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def summarize_slots(log: list[tuple[str, int, Any]]) -> dict[str, Any]:
    """Per allocator: how often a bucket's new allocation lands in a different pool slot than its
    previous allocation (0.6.x pins each bucket to one slot; earlier releases take the first idle)."""
    out: dict[str, Any] = {}
    last: dict[Any, Any] = {}
    for name, bucket, slot in log:
        o = out.setdefault(name, {"allocations": 0, "slot_changed": 0, "first": []})
        o["allocations"] += 1
        key = (name, bucket)
        if key in last and last[key] != slot:
            o["slot_changed"] += 1
        last[key] = slot
        if len(o["first"]) < 24:
            o["first"].append([bucket, slot])
    return out


def release_version(pkg: str) -> str:
    from importlib import metadata

    dist_name = "megatron-fsdp" if pkg == "megatron_fsdp" else "megatron-core"
    try:
        return f"{dist_name} {metadata.version(dist_name)}"
    except Exception:
        return f"{dist_name} ?"


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
