"""One case of core_gpt.py, in its own process: megatron-core's ``GPTModel`` through the
Megatron-FSDP adapter on a fake 2-rank world, trained stage by stage.

    python3 validation/core_gpt.py --case CASE.json --out RESULT.json   # what the driver runs

The case records every stage it reaches (imports, parallel_state, model_build, fsdp_wrap,
forward, backward, finish_grad_sync, steps) with the exception, traceback and innermost frame
outside this file of the one that failed, so a single GPU run shows where the stack stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
import types

import comparison

HERE = os.path.dirname(os.path.abspath(__file__))

# Small enough that a case is a few seconds of GPU work, with >= 3 symmetric FSDP units.
SIZES = {
    "gpu": dict(layers=6, hidden=1024, heads=16, ffn=4096, moe_ffn=2048, experts=4,
                vocab=8192, seq=512, mbs=4),  # 2048 tokens per microbatch
    "tiny": dict(layers=4, hidden=64, heads=4, ffn=128, moe_ffn=64, experts=4,
                 vocab=256, seq=32, mbs=2),  # CPU
}



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
    built = _build(st, c, res)
    if built is None:
        return
    mods, ddp = built
    torch = mods["torch"]
    run = Training(c, res, torch, ddp)
    truth = torch.load(c["truth"], map_location="cpu") if c.get("truth") else None
    _first_step(st, c, res, run)
    g = st.run("steps", run.later_steps)
    _record(c, res, mods, run, g, truth)


def _build(st, c, res):
    """The stack up to the wrapped model, stage by stage: (modules, wrapped model); None when
    the case stops after building the model."""
    mods = st.run("imports", lambda: do_imports(c, res))
    st.run("parallel_state", lambda: init_parallel(c, res, mods))
    model, config = st.run("model_build", lambda: build_model(c, res, mods))
    if c.get("stop_after") == "model_build":
        return None
    ddp = st.run("fsdp_wrap", lambda: wrap(c, res, mods, config, model))
    if c["fix"] == "hotfix":
        try:
            res["hotfix_status"] = json.loads(json.dumps(mods["hotfix"].status(), default=repr))
        except Exception as e:
            res["hotfix_status"] = f"status() failed: {type(e).__name__}: {e}"
    pgb = ddp.param_and_grad_buffer
    res["n_param_groups"] = len(pgb.parameter_groups)
    res["double_buf_units"] = len(getattr(pgb, "double_buf_units", []) or [])
    return mods, ddp


class Training:
    """The case's steps: inputs seeded per step and microbatch, each step's ``main_grad``
    buffers and losses kept (``steps``), its CUDA events timed on the GPU."""

    def __init__(self, c, res, torch, ddp):
        self.c, self.res, self.torch, self.ddp = c, res, torch, ddp
        self.pgb = ddp.param_and_grad_buffer
        self.cpu = c["device"] == "cpu"
        self.dev = torch.device("cpu") if self.cpu else torch.device("cuda", 0)
        self.gen = torch.Generator(device=self.dev)
        self.z = SIZES[c["size"]]
        self.steps, self.step_losses, self.events = [], [], []  # steps: {"grads", "losses"}
        self.last = c["microbatches"] - 1

    def batch(self, step, mb):
        torch, z, dev = self.torch, self.z, self.dev
        self.gen.manual_seed(10_000 + 100 * step + mb)
        tokens = torch.randint(0, z["vocab"], (z["mbs"], z["seq"] + 1), device=dev,
                               generator=self.gen)
        pos = torch.arange(z["seq"], device=dev).unsqueeze(0).expand(z["mbs"], z["seq"])
        return tokens[:, :-1].contiguous(), pos, tokens[:, 1:].contiguous()

    def forward(self, step, mb):
        torch, z = self.torch, self.z
        ids, pos, labels = self.batch(step, mb)
        mask = None
        if self.cpu:  # the local spec's softmax wants a mask (True = masked)
            mask = torch.ones(z["seq"], z["seq"], dtype=torch.bool, device=self.dev).triu(1)[
                None, None]
        loss = self.ddp(ids, pos, mask, labels=labels).float().mean()
        self.step_losses.append(loss.detach())
        return loss

    def grads(self):
        return self.torch.cat([g.main_grad_buffer.data.detach().float().reshape(-1)
                               for g in self.pgb.parameter_groups
                               if g.main_grad_buffer is not None])

    def finish_step(self, step, ev):
        if ev is not None:
            ev[1].record()
            self.events.append(ev)
        g = self.grads().cpu()
        self.steps.append({"grads": g, "losses": self.torch.stack(self.step_losses).cpu()})
        self.step_losses.clear()
        if not self.torch.isfinite(g).all() and "nonfinite_step" not in self.res:
            self.res["nonfinite_step"] = step
        return g

    def start_step(self):
        self.ddp.zero_grad_buffer()
        if self.cpu:
            return None
        cuda = self.torch.cuda
        ev = (cuda.Event(enable_timing=True), cuda.Event(enable_timing=True))
        ev[0].record()
        return ev

    def later_steps(self):
        last = self.last
        for step in range(1, self.c["steps"]):
            ev = self.start_step()
            with self.ddp.no_sync():
                for mb in range(last):
                    self.forward(step, mb).backward()
            self.forward(step, last).backward()
            self.ddp.finish_grad_sync()
            g = self.finish_step(step, ev)
        return g


def _first_step(st, c, res, run):
    # step 0, stage by stage, driven as Megatron-LM's schedule does (forward_backward_no_pipelining:
    # one ddp.no_sync() around every microbatch but the last, entered even with one microbatch)
    ev = run.start_step()
    last = run.last
    no_sync = contextlib.ExitStack()
    no_sync.enter_context(run.ddp.no_sync())
    if last == 0:
        no_sync.close()
    loss = st.run("forward", lambda: run.forward(0, 0))
    res["loss0"] = float(loss.detach())
    st.run("backward", loss.backward)
    for mb in range(1, c["microbatches"]):
        if mb == last:
            no_sync.close()
        st.run(f"microbatch{mb}", lambda mb=mb: run.forward(0, mb).backward())
    no_sync.close()
    st.run("finish_grad_sync", run.ddp.finish_grad_sync)
    return st.run("read_grads", lambda: run.finish_step(0, ev))


def _record(c, res, mods, run, g, truth):
    torch = mods["torch"]
    if not run.cpu:
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in run.events)
        res["step_ms_median"] = round(ms[len(ms) // 2], 2)
        res["peak_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    res["steps_done"] = c["steps"]
    res["grad_numel"] = int(g.numel())
    res["grad_l2"] = float(g.double().norm())
    if c.get("save_grads"):
        torch.save(run.steps, c["save_grads"])
    if truth is not None:
        res["comparison"] = comparison.compare(run.steps, truth).to_dict()
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

