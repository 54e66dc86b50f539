#!/usr/bin/env python3
"""One GPU validation case of Megatron-FSDP's gradient double buffer, in its own process.

A model of identical FSDP units (two bias-free Linears with TE-style fused wgrad accumulation,
optionally a LayerNorm at the end of each unit whose params take the ordinary autograd path) is
wrapped in ``MegatronFSDP`` on a fake process group of world size 2 (one GPU), trained for
``--steps`` steps of ``--microbatches`` microbatches with no optimizer step (weights stay fixed,
inputs change per step), and the local gradient shard is read after every ``finish_grad_sync()``.

Writes one JSON file (``--out``): crash or not, max |grad - truth| and relative L2 error over all
steps against ``--truth`` (a file written by a ``--save-grads`` run, normally the same
configuration under ``CUDA_LAUNCH_BLOCKING=1``), peak memory, step time from CUDA events.

The release under test is whatever ``megatron_fsdp`` / ``megatron.core`` is first on sys.path;
``--pkg`` says which import path to use.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--pkg", required=True,
                   help="megatron_fsdp | megatron.core.distributed.fsdp.src.megatron_fsdp")
    p.add_argument("--zero", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--db", type=int, default=1, help="fsdp_double_buffer")
    p.add_argument("--fix", default="none", choices=("none", "hotfix", "ref"),
                   help="none: as shipped; hotfix: import mfsdp_hotfix first; ref: validation/refpatch")
    p.add_argument("--delay-ms", type=float, default=0.0)
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
    p.add_argument("--save-grads", default="")
    p.add_argument("--truth", default="")
    p.add_argument("--no-grads", action="store_true", help="perf runs: do not read grads back")
    p.add_argument("--defer-readback", action="store_true",
                   help="keep each step's grads on the GPU and copy them to the host only after "
                        "the last step (no host synchronisation between steps)")
    p.add_argument("--trace-slots", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="")
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    res = {"label": a.label, "args": vars(a), "crashed": False, "error": None,
           "cuda_launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", "0"),
           "t_start": time.time()}
    try:
        run(a, res)
    except BaseException as e:  # a crash of the release is a result, not a harness failure
        res["crashed"] = True
        msg = str(e).strip().splitlines()
        res["error"] = f"{type(e).__name__}: {' | '.join(msg[:3])[:600]}"
        res["traceback"] = traceback.format_exc()[-3000:]
    res["wall_s"] = round(time.time() - res["t_start"], 2)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps({k: res.get(k) for k in ("label", "crashed", "error", "rel_l2", "max_abs",
                                              "step_ms_median", "peak_mem_mb")}, default=str))


def run(a, res):
    hotfix = None
    if a.fix == "hotfix":
        import mfsdp_hotfix as hotfix  # must come before any Megatron-FSDP import
    import torch
    import torch.distributed as dist

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(0)
    res["torch"] = torch.__version__
    res["gpu"] = torch.cuda.get_device_name(0)

    sys.path.insert(0, HERE)
    import fakepg_shims as shims

    if a.pg == "nccl_sem":
        shims.install_nccl_semantics()
    cycles = int(round(a.delay_ms * a.cycles_per_ms))
    res["delay_cycles"] = cycles
    shims.install_rs_delay(cycles)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cuda", (2, 1), mesh_dim_names=("dp", "tp"))

    import importlib
    mfpkg = importlib.import_module(a.pkg)
    mfmod = importlib.import_module(a.pkg + ".megatron_fsdp")
    pgbmod = importlib.import_module(a.pkg + ".param_and_grad_buffer")
    res["release_file"] = mfpkg.__file__
    res["release_version"] = release_version(a.pkg)
    if a.fix == "ref":
        res["refpatch"] = __import__("refpatch").apply(a.pkg)

    slot_log = []
    if a.trace_slots:
        orig_alloc = pgbmod.FixedPoolAllocator.allocate

        def allocate(self, bucket_id, *args, **kw):
            had = bucket_id in self.using_buffer
            out = orig_alloc(self, bucket_id, *args, **kw)
            if not had and bucket_id in self.using_buffer:
                slot_log.append((self.name, bucket_id, self.using_buffer[bucket_id][0]))
            return out

        pgbmod.FixedPoolAllocator.allocate = allocate

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    dev = torch.device("cuda", 0)
    Unit, Model = build_classes(torch)
    torch.manual_seed(1234)
    with torch.device(dev):  # initialise on the GPU: fast, and the same for every case
        module = Model(a.units, a.hidden, a.ffn, bool(a.norm), bool(a.head)).to(dtype)

    DDPConfig = mfmod.DistributedDataParallelConfig
    strategy = {1: "optim", 2: "optim_grads", 3: "optim_grads_params"}[a.zero]
    cfg = DDPConfig(data_parallel_sharding_strategy=strategy, outer_dp_sharding_strategy="no_shard",
                    overlap_grad_reduce=True, overlap_param_gather=True,
                    average_in_collective=False, fsdp_double_buffer=bool(a.db),
                    check_for_nan_in_grad=False)
    dist_index = mfpkg.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp")
    model = mfpkg.MegatronFSDP(module, dist_index, ddp_config=cfg,
                               mixed_precision_policy=mfpkg.MixedPrecisionPolicy(),
                               fsdp_unit_modules=[Unit], device=dev)
    if hotfix is not None:
        try:
            res["hotfix_status"] = hotfix.status()
        except Exception as e:  # report, don't fail the case
            res["hotfix_status"] = f"status() failed: {type(e).__name__}: {e}"
    pgb = model.param_and_grad_buffer
    res["n_buckets"] = len(pgb.parameter_groups)
    res["double_buf_units"] = list(getattr(pgb, "double_buf_units", []) or [])

    truth = None
    if a.truth:
        truth = torch.load(a.truth, map_location="cpu")
    saved = []
    err_max, diff_sq, ref_sq, steps_compared = 0.0, 0.0, 0.0, 0
    first_bad_step = None

    def take(step, g):
        """Keep (when asked) and compare one step's grads, read back to the host."""
        nonlocal err_max, diff_sq, ref_sq, steps_compared, first_bad_step
        g = g.cpu()
        if a.save_grads:
            saved.append(g)
        if truth is not None:
            t = truth[step]
            if t.shape != g.shape:
                raise RuntimeError(f"truth shape {tuple(t.shape)} != grads {tuple(g.shape)}")
            d = (g - t)
            m = d.abs().max().item()
            if m != 0.0 and first_bad_step is None:
                first_bad_step = step
            err_max = max(err_max, m)
            diff_sq += float(d.double().square().sum())
            ref_sq += float(t.double().square().sum())
            steps_compared += 1
        return g
    events = []
    gen = torch.Generator(device=dev)

    total = a.warmup + a.steps
    for step in range(total):
        if step == a.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        model.zero_grad_buffer()
        start.record()
        for mb in range(a.microbatches):
            gen.manual_seed(10_000 + 100 * step + mb)
            x = torch.randn(a.tokens, a.hidden, device=dev, dtype=dtype, generator=gen,
                            requires_grad=True)
            out = model(x)
            loss = out.float().square().mean()
            loss.backward()
        model.finish_grad_sync()
        end.record()
        if step >= a.warmup:
            events.append((start, end))
        if not a.no_grads:
            g = torch.cat([grp.main_grad_buffer.data.detach().float().reshape(-1)
                           for grp in pgb.parameter_groups if grp.main_grad_buffer is not None])
            if a.defer_readback:
                saved.append(g.clone())
                continue
            g = take(step, g)
            if not torch.isfinite(g).all():
                res["nonfinite_grads_step"] = step
    torch.cuda.synchronize()
    if a.defer_readback and not a.no_grads:
        gpu_grads, saved = saved, []
        for step, g in enumerate(gpu_grads):
            take(step, g)
    res["steps_done"] = total
    res["peak_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    res["peak_reserved_mb"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
    times = sorted(s.elapsed_time(e) for s, e in events)
    res["step_ms_all"] = [round(s.elapsed_time(e), 3) for s, e in events]
    if times:
        res["step_ms_median"] = round(pct(times, 50), 3)
        res["step_ms_min"] = round(times[0], 3)
        res["step_ms_max"] = round(times[-1], 3)
        res["step_ms_p10"] = round(pct(times, 10), 3)
        res["step_ms_p90"] = round(pct(times, 90), 3)
    if a.save_grads:
        torch.save(saved, a.save_grads)
        res["saved_grads"] = a.save_grads
        res["grad_numel"] = int(saved[0].numel()) if saved else 0
    if truth is not None:
        res["steps_compared"] = steps_compared
        res["max_abs"] = err_max
        res["rel_l2"] = (diff_sq ** 0.5) / (ref_sq ** 0.5) if ref_sq > 0 else None
        res["first_bad_step"] = first_bad_step
    res["shim_stats"] = dict(shims.STATS)
    audit = sys.modules.get("mfsdp_hotfix.audit")  # MFSDP_HOTFIX_AUDIT set for this case
    if audit is not None:
        res["audit"] = audit.snapshot()
    if slot_log:
        res["slot_trace"] = summarize_slots(slot_log)


def pct(sorted_vals, q):
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    k = (len(sorted_vals) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def summarize_slots(log):
    """Per allocator: how often a bucket's new allocation lands in a different pool slot than its
    previous allocation (0.6.x pins each bucket to one slot; earlier releases take the first idle)."""
    out = {}
    last = {}
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


def release_version(pkg):
    from importlib import metadata
    dist_name = "megatron-fsdp" if pkg == "megatron_fsdp" else "megatron-core"
    try:
        return f"{dist_name} {metadata.version(dist_name)}"
    except Exception:
        return f"{dist_name} ?"


def build_classes(torch):
    nn = torch.nn
    _dummy = {}

    def dummy_wgrad(w):
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
        def forward(ctx, x, weight, main_grad_func):
            ctx.save_for_backward(x)
            ctx.weight = weight
            ctx.main_grad_func = main_grad_func
            return x @ weight.t()

        @staticmethod
        def backward(ctx, g):
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
        def __init__(self, fan_in, fan_out):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(fan_out, fan_in) / fan_in ** 0.5)

        def forward(self, x):
            w = self.weight
            getter = getattr(w, "get_main_grad", None)
            if getter is None:
                return x @ w.t()
            return FusedWgradLinearFn.apply(x, w, getter)

    class Unit(nn.Module):
        def __init__(self, h, f, norm):
            super().__init__()
            self.fc1 = FusedLinear(h, f)
            self.fc2 = FusedLinear(f, h)
            self.norm = nn.LayerNorm(h) if norm else None

        def forward(self, x):
            y = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
            if self.norm is not None:
                y = self.norm(y)
            return x + y

    class Model(nn.Module):
        def __init__(self, n, h, f, norm, head):
            super().__init__()
            self.units = nn.ModuleList(Unit(h, f, norm) for _ in range(n))
            self.head = nn.Linear(h, h, bias=False) if head else None

        def forward(self, x):
            for u in self.units:
                x = u(x)
            if self.head is not None:
                x = self.head(x)
            return x

    return Unit, Model


if __name__ == "__main__":
    main()
