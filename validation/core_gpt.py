#!/usr/bin/env python3
"""megatron-core's own stack on one GPU: ``GPTModel`` (TE layer spec) through the Megatron-FSDP
adapter, as Megatron-LM / Megatron-Bridge users run it.

The configuration is the users' one: ``TransformerConfig(gradient_accumulation_fusion=True)``,
``get_gpt_layer_with_transformer_engine_spec``, megatron-core's ``FullyShardedDataParallel``
adapter with ``DistributedDataParallelConfig(use_megatron_fsdp=True,
data_parallel_sharding_strategy="optim_grads_params", fsdp_double_buffer=True)``, built on
``parallel_state.initialize_model_parallel`` over a fake 2-rank world (one process, one GPU,
NCCL work semantics from ``fakepg_shims``).  A dense model and an MoE model (TE grouped experts,
``moe_grouped_gemm=True``) are run on megatron-core 0.18.2 and 0.19.2, as shipped and with
``mfsdp_hotfix`` imported first, each against the same run serialized
(``CUDA_LAUNCH_BLOCKING=1``), with and without a slow reduce-scatter; the ``main_grad`` buffers
are compared bit for bit after every ``finish_grad_sync``. Microbatches are driven as
Megatron-LM's schedule drives them: ``no_sync()`` around every microbatch but the last (records
before this was added called no ``no_sync()``; for ZeRO-3 the release reduces the same way).

Each case is its own process and records every stage it reaches (imports, parallel_state,
model_build, fsdp_wrap, forward, backward, finish_grad_sync, steps) with the exception and
traceback of the one that failed, so a single GPU run shows where the stack stops.

    python3 validation/core_gpt.py --out core_gpt.json             # driver (GPU)
    python3 validation/core_gpt.py --device cpu --out cpu.json     # adapter path on CPU

``--device cpu`` runs the same adapter path without TE (megatron-core's local spec, whose
``ColumnParallelLinear``/``RowParallelLinear`` take the same fused-wgrad route) on the CPU
``torch.cuda`` stand-in of ``mfsdp_hotfix.selftest``: it checks the build and wrap, orders
nothing, and its gradients say nothing about the race.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
import types

import comparison
import workdir

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RELEASES = ("core-0.18.2", "core-0.19.2")

# Small enough that a case is a few seconds of GPU work, with >= 3 symmetric FSDP units.
SIZES = {
    "gpu": dict(layers=6, hidden=1024, heads=16, ffn=4096, moe_ffn=2048, experts=4,
                vocab=8192, seq=512, mbs=4),  # 2048 tokens per microbatch
    "tiny": dict(layers=4, hidden=64, heads=4, ffn=128, moe_ffn=64, experts=4,
                 vocab=256, seq=32, mbs=2),  # CPU
}


# ------------------------------------------------------------------------------------- one case

class Stages:
    """Stage-by-stage record: the first exception ends the case, with where and why."""

    def __init__(self, res):
        self.res = res
        res["stages"] = []
        res["stopped_at"] = None

    def run(self, name, fn):
        t0 = time.time()
        rec = {"stage": name, "ok": False}
        self.res["stages"].append(rec)
        try:
            out = fn()
        except BaseException as e:  # a failure of the stack is a result, not a harness bug
            rec["s"] = round(time.time() - t0, 2)
            rec["error"] = f"{type(e).__name__}: {str(e).strip()[:1500]}"
            rec["where"] = _innermost_library_frame(e)
            rec["traceback"] = traceback.format_exc()[-6000:]
            self.res["stopped_at"] = name
            raise StageFailed(name) from e
        rec["ok"] = True
        rec["s"] = round(time.time() - t0, 2)
        return out


class StageFailed(Exception):
    pass


def _innermost_library_frame(exc):
    """File:line (function) of the deepest frame outside this script: where it broke."""
    tb = exc.__traceback__
    where = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if os.path.abspath(code.co_filename) != os.path.abspath(__file__):
            where = f"{code.co_filename}:{tb.tb_lineno} ({code.co_name})"
        tb = tb.tb_next
    return where


def install_apex_stub():
    """megatron-core's ``ColumnParallelLinear.__init__`` refuses
    ``gradient_accumulation_fusion=True`` unless APEX's ``fused_weight_gradient_mlp_cuda`` is
    importable, although with Megatron-FSDP (``__fsdp_param__``) its backward uses TE's
    ``general_gemm`` instead.  The stub's kernels raise, so any use of it would show."""
    mod = types.ModuleType("fused_weight_gradient_mlp_cuda")

    def _refuse(*_a, **_k):
        raise RuntimeError("core_gpt stub: fused_weight_gradient_mlp_cuda was called "
                           "(APEX path, not the Megatron-FSDP one)")

    mod.wgrad_gemm_accum_fp32 = _refuse
    mod.wgrad_gemm_accum_fp16 = _refuse
    mod.__core_gpt_stub__ = True
    sys.modules["fused_weight_gradient_mlp_cuda"] = mod


def run_case(c, res):
    st = Stages(res)
    cpu = c["device"] == "cpu"
    mods = st.run("imports", lambda: do_imports(c, res))
    torch = mods["torch"]
    st.run("parallel_state", lambda: init_parallel(c, res, mods))
    model, config = st.run("model_build", lambda: build_model(c, res, mods))
    if c.get("stop_after") == "model_build":
        return
    ddp = st.run("fsdp_wrap", lambda: wrap(c, res, mods, config, model))
    if c["fix"] == "hotfix":
        try:
            res["hotfix_status"] = json.loads(json.dumps(mods["hotfix"].status(), default=repr))
        except Exception as e:
            res["hotfix_status"] = f"status() failed: {type(e).__name__}: {e}"
    pgb = ddp.param_and_grad_buffer
    res["n_param_groups"] = len(pgb.parameter_groups)
    res["double_buf_units"] = len(getattr(pgb, "double_buf_units", []) or [])
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    gen = torch.Generator(device=dev)
    z = SIZES[c["size"]]

    def batch(step, mb):
        gen.manual_seed(10_000 + 100 * step + mb)
        tokens = torch.randint(0, z["vocab"], (z["mbs"], z["seq"] + 1), device=dev, generator=gen)
        pos = torch.arange(z["seq"], device=dev).unsqueeze(0).expand(z["mbs"], z["seq"])
        return tokens[:, :-1].contiguous(), pos, tokens[:, 1:].contiguous()

    def forward(step, mb):
        ids, pos, labels = batch(step, mb)
        mask = None
        if cpu:  # the local spec's softmax wants a mask (True = masked)
            mask = torch.ones(z["seq"], z["seq"], dtype=torch.bool, device=dev).triu(1)[None, None]
        loss = ddp(ids, pos, mask, labels=labels).float().mean()
        step_losses.append(loss.detach())
        return loss

    def grads():
        return torch.cat([g.main_grad_buffer.data.detach().float().reshape(-1)
                          for g in pgb.parameter_groups if g.main_grad_buffer is not None])

    truth = torch.load(c["truth"], map_location="cpu") if c.get("truth") else None
    steps, step_losses, events = [], [], []  # steps: {"grads", "losses"} per step

    def finish_step(step, ev):
        if ev is not None:
            ev[1].record()
            events.append(ev)
        g = grads().cpu()
        steps.append({"grads": g, "losses": torch.stack(step_losses).cpu()})
        step_losses.clear()
        if not torch.isfinite(g).all() and "nonfinite_step" not in res:
            res["nonfinite_step"] = step
        return g

    def start_step():
        ddp.zero_grad_buffer()
        if cpu:
            return None
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        ev[0].record()
        return ev

    # step 0, stage by stage, driven as Megatron-LM's schedule does (forward_backward_no_pipelining:
    # one ddp.no_sync() around every microbatch but the last, entered even with one microbatch)
    ev = start_step()
    last = c["microbatches"] - 1
    no_sync = contextlib.ExitStack()
    no_sync.enter_context(ddp.no_sync())
    if last == 0:
        no_sync.close()
    loss = st.run("forward", lambda: forward(0, 0))
    res["loss0"] = float(loss.detach())
    st.run("backward", loss.backward)
    for mb in range(1, c["microbatches"]):
        if mb == last:
            no_sync.close()
        st.run(f"microbatch{mb}", lambda mb=mb: forward(0, mb).backward())
    no_sync.close()
    st.run("finish_grad_sync", ddp.finish_grad_sync)
    g = st.run("read_grads", lambda: finish_step(0, ev))

    def later_steps():
        for step in range(1, c["steps"]):
            ev = start_step()
            with ddp.no_sync():
                for mb in range(last):
                    forward(step, mb).backward()
            forward(step, last).backward()
            ddp.finish_grad_sync()
            g = finish_step(step, ev)
        return g

    g = st.run("steps", later_steps)
    if not cpu:
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in events)
        res["step_ms_median"] = round(ms[len(ms) // 2], 2)
        res["peak_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    res["steps_done"] = c["steps"]
    res["grad_numel"] = int(g.numel())
    res["grad_l2"] = float(g.double().norm())
    if c.get("save_grads"):
        torch.save(steps, c["save_grads"])
    if truth is not None:
        res["comparison"] = comparison.compare(steps, truth).to_dict()
        res["max_abs"] = res["comparison"]["max_abs_diff"]
        res["rel_l2"] = res["comparison"]["rel_l2"]
        res["first_bad_step"] = res["comparison"]["first_bad_step"]
    res["shim_stats"] = dict(mods["shims"].STATS)


def do_imports(c, res):
    mods = {}
    if c["fix"] == "hotfix":
        import mfsdp_hotfix  # before any Megatron-FSDP import: its import hooks patch the copy
        mods["hotfix"] = mfsdp_hotfix
    import torch
    mods["torch"] = torch
    res["torch"] = torch.__version__
    if c["device"] == "cpu":
        from mfsdp_hotfix.selftest import cuda_standin
        cuda_standin.install()
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(0)
        res["gpu"] = torch.cuda.get_device_name(0)
    sys.path.insert(0, HERE)
    import fakepg_shims as shims  # before megatron: it binds _coalescing_manager at import
    mods["shims"] = shims
    if c["device"] != "cpu":
        shims.install_nccl_semantics()
        cycles = int(round(c["delay_ms"] * c["cycles_per_ms"]))
        res["delay_cycles"] = cycles
        shims.install_rs_delay(cycles)
    res["apex_fused_wgrad_importable"] = _importable("fused_weight_gradient_mlp_cuda")
    if c["apex_stub"] and not res["apex_fused_wgrad_importable"]:
        install_apex_stub()
        res["apex_stub_installed"] = True
    if c["device"] != "cpu":
        import transformer_engine
        res["te_version"] = getattr(transformer_engine, "__version__", "?")
    import megatron.core
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.transformer.transformer_config import TransformerConfig
    if c["device"] == "cpu":
        # no TE on CPU: the adapter's "TE >= 2.10 for gradient_accumulation_fusion" check
        # would stop the run; megatron-core's own linear layers then use torch.matmul(out=)
        import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
        adapter.is_te_min_version = lambda *_a, **_k: True
        # ... and it builds its DeviceMesh with device_type="cuda": DTensors would move there
        from torch.distributed.device_mesh import DeviceMesh

        class CpuDeviceMesh:
            @staticmethod
            def from_group(*args, **kwargs):
                return DeviceMesh.from_group(*args, **dict(kwargs, device_type="cpu"))

        adapter.DeviceMesh = CpuDeviceMesh
    res["megatron_core"] = _dist_version("megatron-core")
    res["megatron_core_file"] = megatron.core.__file__
    from megatron.core.extensions import transformer_engine as te_ext  # noqa: F401 - HAVE_TE
    res["mcore_have_te"] = bool(getattr(te_ext, "HAVE_TE", False))
    mods.update(parallel_state=parallel_state, tensor_parallel=tensor_parallel,
                DDPConfig=DistributedDataParallelConfig, FSDP=FullyShardedDataParallel,
                GPTModel=GPTModel, specs=gpt_layer_specs, TransformerConfig=TransformerConfig)
    return mods


def init_parallel(c, res, mods):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    ps = mods["parallel_state"]
    # gloo groups need a real store (FakeStore has no set/get): what Megatron-LM's
    # --no-create-gloo-process-groups does
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=1,
                                 create_gloo_process_groups=False)
    if c["device"] == "cpu":  # the RNG tracker saves CUDA generator states: no-op forks
        tracker = mods["tensor_parallel"].get_cuda_rng_tracker()
        tracker.fork = lambda *_a, **_k: contextlib.nullcontext()
    else:
        mods["tensor_parallel"].model_parallel_cuda_manual_seed(1234)
    res["groups"] = {
        "dp": ps.get_data_parallel_world_size(),
        "dp_cp_ranks": dist.get_process_group_ranks(
            ps.get_data_parallel_group(with_context_parallel=True)),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "expt_dp": ps.get_expert_data_parallel_group().size(),
        "backend": dist.get_backend(ps.get_data_parallel_group()),
    }


def build_model(c, res, mods):
    import torch
    from megatron.core.transformer.enums import AttnBackend

    z = SIZES[c["size"]]
    experts = z["experts"] if c["model"].startswith("moe") else 0
    # TE grouped experts on the GPU; megatron-core's SequentialMLP on CPU (no TE there)
    grouped = bool(experts) and c["spec"] == "te"
    kw = dict(num_layers=z["layers"], hidden_size=z["hidden"], num_attention_heads=z["heads"],
              ffn_hidden_size=z["ffn"], params_dtype=torch.float32,
              gradient_accumulation_fusion=True, hidden_dropout=0.0, attention_dropout=0.0,
              add_bias_linear=False, use_cpu_initialization=c["device"] == "cpu",
              perform_initialization=True, init_method_std=0.02,
              # TE's unfused attention (GPU) / megatron-core's own (CPU): plain PyTorch
              # kernels, bit-reproducible from run to run
              attention_backend=AttnBackend.local if c["spec"] == "local" else AttnBackend.unfused)
    if experts:
        # top-1 routing: every token goes to one expert, so the permutation's scatter has no
        # duplicate indices and the run stays bit-reproducible
        kw.update(num_moe_experts=experts, moe_router_topk=1, moe_router_pre_softmax=True,
                  moe_grouped_gemm=grouped,
                  moe_ffn_hidden_size=z["moe_ffn"], moe_token_dispatcher_type="alltoall",
                  moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    if c["model"] == "moe-opfuser":
        # TEGroupedMLP through TE's op fuser: SwiGLU experts, and on 0.19.2 the forward
        # pre-hook (_ensure_main_grad) that takes each expert weight's main_grad slot at
        # forward time; 0.19.2 also wants NVTE_CUTEDSL_FUSED_GROUPED_MLP>0 (set by the driver)
        kw.update(use_transformer_engine_op_fuser=True, gated_linear_unit=True,
                  activation_func=torch.nn.functional.silu)
    config = mods["TransformerConfig"](**kw)
    specs = mods["specs"]
    if c["spec"] == "te":
        layer_spec = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts or None, moe_grouped_gemm=grouped)
    else:
        layer_spec = specs.get_gpt_layer_local_spec(
            num_experts=experts or None, moe_grouped_gemm=grouped)
    torch.manual_seed(1234)
    model = mods["GPTModel"](config=config, transformer_layer_spec=layer_spec, vocab_size=z["vocab"],
                             max_sequence_length=z["seq"], pre_process=True, post_process=True,
                             share_embeddings_and_output_weights=False,
                             position_embedding_type="rope")
    if c["device"] != "cpu":
        model = model.cuda()
    res["params"] = sum(p.numel() for p in model.parameters())
    res["layer_class"] = type(model.decoder.layers[0]).__name__
    res["mlp_class"] = type(model.decoder.layers[0].mlp).__name__
    experts = getattr(model.decoder.layers[0].mlp, "experts", None)
    if experts is not None:
        res["experts_class"] = type(experts).__name__
    return model, config


def wrap(c, res, mods, config, model):
    import torch

    ddp_config = mods["DDPConfig"](
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
        fsdp_double_buffer=c["db"], overlap_grad_reduce=True, overlap_param_gather=True,
        use_distributed_optimizer=True, check_for_nan_in_grad=False,
        average_in_collective=False)
    if c["device"] == "cpu":
        ddp = mods["FSDP"](config=config, ddp_config=ddp_config, module=model,
                           device=torch.device("cpu"))
    else:
        ddp = mods["FSDP"](config=config, ddp_config=ddp_config, module=model)
    res["fsdp_unit_modules"] = [getattr(u, "__name__", str(u))
                                for u in getattr(ddp, "fsdp_unit_modules", [])]
    res["ddp_class"] = f"{type(ddp).__module__}.{type(ddp).__name__}"
    return ddp


def _importable(name):
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:
        return False


def _dist_version(name):
    from importlib import metadata
    try:
        return metadata.version(name)
    except Exception:
        return "?"


def case_main(path, out):
    with open(path) as f:
        c = json.load(f)
    res = {"label": c["label"], "case": c, "crashed": False, "error": None,
           "cuda_launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", "0"),
           "t_start": time.time()}
    try:
        run_case(c, res)
    except StageFailed as e:
        res["crashed"] = True
        rec = res["stages"][-1]
        res["error"] = f"[{e}] {rec['error'][:600]}"
    except BaseException as e:  # outside a stage: still a result
        res["crashed"] = True
        res["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        res["traceback"] = traceback.format_exc()[-4000:]
    res["wall_s"] = round(time.time() - res["t_start"], 2)
    with open(out, "w") as f:
        json.dump(res, f, indent=1, default=str)


# --------------------------------------------------------------------------------------- driver

def make_cases(a, cpm):
    """Per release, the probe without the APEX stub (stops after model_build); per (release,
    model), the serialized truth of shipped and hotfix, then the asynchronous runs at each
    delay."""
    cases = []
    model_env = {"moe-opfuser": {"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"}}
    base = dict(device=a.device, spec="local" if a.device == "cpu" else "te",
                db=not a.no_double_buffer,
                size="tiny" if a.device == "cpu" else "gpu",
                steps=a.steps, microbatches=a.microbatches, cycles_per_ms=cpm, delay_ms=0.0)
    for rel in a.releases:
        for model in a.models:
            tag = f"{rel}|{model}" + ("|no-double-buffer" if a.no_double_buffer else "")
            if model == a.models[0]:  # the APEX check does not depend on the model
                cases.append(dict(base, label=f"{tag}|probe-no-apex-stub", release=rel,
                                  model=model, fix="none", apex_stub=False,
                                  stop_after="model_build", wave=0,
                                  env=model_env.get(model, {})))
            for fix in ("none", "hotfix"):
                variant = "shipped" if fix == "none" else "hotfix"
                tpath = os.path.join(workdir.run_dir(), "truth", f"{rel}_{model}_{variant}.pt")
                cases.append(dict(base, label=f"{tag}|{variant}|serialized", release=rel,
                                  model=model, fix=fix, apex_stub=True, save_grads=tpath,
                                  wave=0, variant=variant,
                                  env=dict(model_env.get(model, {}), CUDA_LAUNCH_BLOCKING="1")))
                for d in (a.delays if model != "moe-opfuser" else a.delays[-1:]):
                    cases.append(dict(base, label=f"{tag}|{variant}|d{d:g}", release=rel,
                                      model=model, fix=fix, apex_stub=True, delay_ms=d,
                                      truth=tpath, wave=1, env=model_env.get(model, {}),
                                      variant=variant))
    # most informative first, so that a cut budget drops the op-fuser variant first
    return sorted(cases, key=lambda c: (c["wave"], a.models.index(c["model"])))


class Driver:
    def __init__(self, a, rel_paths, deadline):
        self.a = a
        self.rel_paths = rel_paths
        self.deadline = deadline
        for sub in ("cases", "truth"):
            os.makedirs(os.path.join(workdir.run_dir(), sub), exist_ok=True)
        self.truth_runs = {}

    def run(self, c):
        if time.time() > self.deadline:
            return dict(c, skipped="time budget exhausted")
        if c["release"] not in self.rel_paths:
            return dict(c, skipped="release wheel not found")
        if c.get("truth") and c["truth"] in self.truth_runs:
            self.truth_runs[c["truth"]].result()  # its serialized run first
        if c.get("truth") and not os.path.exists(c["truth"]):
            # still run it: where it stops is the result; nothing to compare with
            c = dict(c, truth=None, no_truth="the serialized run crashed or was skipped")
        name = c["label"].replace("|", "_")
        cpath = os.path.join(workdir.run_dir(), "cases", name + ".case.json")
        jout = os.path.join(workdir.run_dir(), "cases", name + ".json")
        with open(cpath, "w") as f:
            json.dump(c, f)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [REPO, self.rel_paths[c["release"]]] + [p for p in [env.get("PYTHONPATH")] if p])
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        env["PYTHONUNBUFFERED"] = "1"
        env["MFSDP_HOTFIX_CROSS_RANK_CHECK"] = "off"  # FakeStore has no set/get
        env.setdefault("OMP_NUM_THREADS", "2")
        env.update(c.get("env", {}))
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", cpath,
                                "--out", jout], env=env, capture_output=True, text=True,
                               timeout=self.a.case_timeout)
            rc, log = p.returncode, (p.stdout + p.stderr)
        except subprocess.TimeoutExpired as e:
            rc, log = "timeout", str(e)
        rec = dict(c, rc=rc, proc_s=round(time.time() - t0, 1))
        if os.path.exists(jout):
            with open(jout) as f:
                rec["result"] = json.load(f)
        else:
            rec["result"] = None
        if rc != 0 or rec["result"] is None or rec["result"].get("crashed"):
            rec["log_tail"] = log[-4000:]
        return rec

    def run_all(self, cases):
        """Serialized runs are submitted first; each asynchronous run starts once its own
        serialized run is done (no wave barrier: the GPU stays busy)."""
        self.truth_runs = {}
        out = []
        with cf.ThreadPoolExecutor(max(1, self.a.workers)) as ex:
            futures = []
            for c in cases:
                f = ex.submit(self.run, c)
                futures.append(f)
                if c.get("save_grads"):
                    self.truth_runs[c["save_grads"]] = f
            for f in cf.as_completed(futures):
                r = f.result()
                out.append(r)
                print(short(r), flush=True)
        order = {c["label"]: i for i, c in enumerate(cases)}
        return sorted(out, key=lambda r: order[r["label"]])


def outcome(r):
    res = r.get("result") or {}
    if r.get("skipped"):
        return "skipped"
    if not res:
        return "no-result"
    if res.get("crashed"):
        return "crash"
    if r.get("truth"):
        if "comparison" in res:
            return res["comparison"]["outcome"]
        # recorded before the bit comparison: the values were compared, not the bits
        largest = res.get("max_abs")
        same_values = largest is not None and not largest and "nonfinite_step" not in res
        return "equal values" if same_values else "wrong"
    if r.get("no_truth"):
        return "ran-no-truth"
    return "ok"


def short(r):
    res = r.get("result") or {}
    o = outcome(r)
    if o == "skipped":
        return f"SKIP  {r['label']}: {r['skipped']}"
    if o == "no-result":
        return f"FAIL  {r['label']} rc={r.get('rc')}: {r.get('log_tail', '')[-400:]}"
    stages = ",".join(s["stage"] for s in res.get("stages", []) if s["ok"])
    if o == "crash":
        return f"CRASH {r['label']} at {res.get('stopped_at')}: {res.get('error')} (ok: {stages})"
    return (f"{o:5s} {r['label']}: rel_l2={res.get('rel_l2')} max_abs={res.get('max_abs')} "
            f"step={res.get('step_ms_median')}ms proc={r.get('proc_s')}s")


def summary(results):
    rows = []
    for r in results:
        res = r.get("result") or {}
        rows.append({"release": r["release"], "model": r["model"], "db": r["db"],
                     "variant": r.get("variant", "probe"), "delay_ms": r["delay_ms"],
                     "serialized": bool(r.get("save_grads")), "outcome": outcome(r),
                     "rel_l2": res.get("rel_l2"), "max_abs": res.get("max_abs"),
                     "stopped_at": res.get("stopped_at"), "error": res.get("error"),
                     "where": next((s.get("where") for s in res.get("stages", [])
                                    if not s["ok"]), None),
                     "te_version": res.get("te_version"), "label": r["label"]})
    return rows


def report_table(path):
    """Markdown table of a driver's JSON (``--report``): one row per case, as recorded; the
    outcome is decided again from each case's record (older records compared values only)."""
    with open(path) as f:
        doc = json.load(f)
    decided = {case["label"]: outcome(case) for case in doc.get("cases", [])}
    out = ["| release | model | variant | RS delay ms | run | outcome | rel. L2 vs serialized | "
           "stopped at | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["summary"]:
        rel = "–" if r["rel_l2"] is None else f"{r['rel_l2']:.3g}"
        err = (r["error"] or "").split("\n")[0][:90].replace("|", "/")
        model = r["model"] + ("" if r.get("db", True) else ", fsdp_double_buffer=False")
        out.append(f"| {r['release']} | {model} | {r['variant']} | {r['delay_ms']:g} | "
                   f"{'serialized' if r['serialized'] else 'asynchronous'} | "
                   f"{decided.get(r['label'], r['outcome'])} | "
                   f"{rel} | {r['stopped_at'] or '–'} | {err or '–'} |")
    out.append("")
    if "serialized_shipped_vs_hotfix" in doc:
        out.append("Serialized shipped vs serialized hotfix: "
                   f"{doc['serialized_shipped_vs_hotfix']}")
    else:  # recorded before the bit comparison
        out.append("Serialized shipped vs serialized hotfix, max abs difference (values, bits "
                   f"not compared): {doc.get('serialized_shipped_vs_hotfix_max_abs')}")
    return "\n".join(out)


def truth_pairs(results):
    """Serialized shipped vs serialized hotfix grads of each configuration: must be identical."""
    import torch
    out = {}
    for r in results:
        if r.get("variant") != "shipped" or not r.get("save_grads"):
            continue
        other = r["save_grads"].replace("_shipped.pt", "_hotfix.pt")
        if os.path.exists(r["save_grads"]) and os.path.exists(other):
            both = comparison.compare(torch.load(r["save_grads"]), torch.load(other))
            out[f"{r['release']}|{r['model']}"] = {
                k: both.to_dict()[k] for k in ("outcome", "max_abs_diff", "steps_compared",
                                               "tensors_compared")}
    return out


def driver_main(a):
    t0 = time.time()
    sys.path.insert(0, HERE)
    from release_wheels import unpack_releases
    from run_matrix import calibrate
    rel_paths = {k: v for k, v in unpack_releases(os.path.join(HERE, "wheels")).items()
                 if k in a.releases}
    rel_paths.update(kv.split("=", 1) for kv in a.release_path)
    report = {"argv": sys.argv, "releases": rel_paths, "t_start": t0}
    cpm = 0.0
    if a.device != "cpu":
        report["calibration"] = calibrate()
        cpm = report["calibration"]["cycles_per_ms"]
    cases = make_cases(a, cpm)
    drv = Driver(a, rel_paths, t0 + a.budget_s)
    results = drv.run_all(cases)
    report["summary"] = summary(results)
    try:
        report["serialized_shipped_vs_hotfix"] = truth_pairs(results)
    except Exception as e:
        report["serialized_shipped_vs_hotfix"] = f"{type(e).__name__}: {e}"
    report["cases"] = results
    report["wall_s"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {a.out} ({report['wall_s']} s)")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--dry", action="store_true", help="print the planned cases and exit")
    p.add_argument("--case", help="internal: run one case described by this JSON file")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--releases", default=",".join(RELEASES))
    p.add_argument("--release-path", action="append", default=[],
                   help="NAME=FOLDER: use an unpacked release from this folder")
    p.add_argument("--models", default="dense,moe,moe-opfuser")
    p.add_argument("--delays", default="0,20", help="reduce-scatter delays in ms")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=170.0)
    p.add_argument("--case-timeout", type=float, default=150.0)
    p.add_argument("--no-double-buffer", action="store_true",
                   help="fsdp_double_buffer=False (to see whether a crash needs the pool)")
    p.add_argument("--report", metavar="JSON", help="print the markdown table of a result")
    a = p.parse_args(argv)
    a.releases = [r for r in a.releases.split(",") if r]
    a.models = [m for m in a.models.split(",") if m]
    a.delays = [float(d) for d in a.delays.split(",") if d]
    if a.device == "cpu":
        a.delays = [0.0]
    return a


if __name__ == "__main__":
    args = parse()
    if args.report:
        print(report_table(args.report))
    elif args.dry:
        for case in make_cases(args, 0.0):
            print(case["label"], json.dumps(case["env"]))
    elif not args.out:
        sys.exit("--out is required")
    elif args.case:
        case_main(args.case, args.out)
    else:
        driver_main(args)
