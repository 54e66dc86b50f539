"""One variant, built in its worker: the imports (the hotfix first, where it is on), the fake
2-rank group, the model wrapped in Megatron-FSDP; and the check that refuses to report a number
for a variant that is not what it says it is."""

from __future__ import annotations

import sys
import time

from harness_process import release_version  # stdlib-only at import

from .model import build_classes
from .plan import STRATEGY


def phase_timer(info):
    """``phase(name)`` records in ``info["phases_s"]`` the seconds since the last phase ended."""
    t = time.time()

    def phase(name):
        nonlocal t
        now = time.time()
        info["phases_s"][name] = round(now - t, 2)
        t = now

    return phase


def build(spec, info, phase):
    """Import and build one variant, filling ``info``; return torch, the hotfix module (None
    when the variant runs as shipped) and the model wrapped in Megatron-FSDP."""
    hotfix = None
    if spec["hotfix"]:
        import mfsdp_hotfix as hotfix  # before anything imports Megatron-FSDP
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    import fakepg_shims  # validation/ is on sys.path; binds before Megatron-FSDP is imported

    fakepg_shims.install_nccl_semantics()
    phase("import_torch")
    import transformer_engine
    import transformer_engine.pytorch as te

    phase("import_te")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cuda", (2, 1), mesh_dim_names=("dp", "tp"))
    import importlib

    mfpkg = importlib.import_module(spec["pkg"])
    mfmod = importlib.import_module(spec["pkg"] + ".megatron_fsdp")
    phase("import_megatron")
    info.update(torch=torch.__version__, gpu=torch.cuda.get_device_name(0),
                te=transformer_engine.__version__, release_version=release_version(spec["pkg"]),
                release_file=mfpkg.__file__)

    Block, Model = build_classes(torch, te)
    torch.manual_seed(1234)
    module = Model(spec["units"], spec["hidden"], spec["ffn"], spec["fuse"])
    info["n_params"] = sum(p.numel() for p in module.parameters())
    cfg = mfmod.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=STRATEGY[spec["zero"]],
        outer_dp_sharding_strategy="no_shard", overlap_grad_reduce=True,
        overlap_param_gather=True, average_in_collective=False,
        fsdp_double_buffer=spec["db"], check_for_nan_in_grad=False)
    dist_index = mfpkg.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp")
    model = mfpkg.MegatronFSDP(module, dist_index, ddp_config=cfg,
                               mixed_precision_policy=mfpkg.MixedPrecisionPolicy(),
                               fsdp_unit_modules=[Block], device=dev)
    phase("build")
    pgb = model.param_and_grad_buffer
    info["double_buffer"] = bool(model.ddp_config.fsdp_double_buffer)
    info["double_buf_units"] = len(getattr(pgb, "double_buf_units", []) or [])
    info["fuse_wgrad"] = sorted({m.fuse_wgrad_accumulation for b in module.units
                                 for m in (b.qkv, b.proj, b.mlp)})
    check_variant(spec, hotfix, info)
    return torch, hotfix, model


def check_variant(spec, hotfix, res):
    """Refuse to report a number for a variant that is not what it says it is."""
    problems = []
    if res["double_buffer"] != spec["db"]:
        problems.append(f"fsdp_double_buffer is {res['double_buffer']}, expected {spec['db']}")
    if res["fuse_wgrad"] != [spec["fuse"]]:
        problems.append(f"TE fuse_wgrad_accumulation {res['fuse_wgrad']}, expected {spec['fuse']}")
    loaded = sys.modules.get("mfsdp_hotfix")
    res["hotfix_loaded"] = loaded is not None
    if hotfix is not None:
        st = hotfix.status()
        copies = [c for c in st["copies"] if c.get("imported") and c["package"] == spec["pkg"]]
        applied = sorted({k for c in copies for k, f in c["fixes"].items()
                          if f["state"] == "applied"})
        res["hotfix_state"], res["hotfix_applied"] = st["hotfix"], applied
        if st["hotfix"] != "active" or not applied:
            problems.append(f"hotfix {st['hotfix']}, fixes applied to {spec['pkg']}: {applied}")
    elif loaded is not None:
        state = loaded.status()["hotfix"]
        res["hotfix_state"] = state
        if state != "off":
            problems.append(f"mfsdp_hotfix was imported and is {state} in a shipped variant")
    if problems:
        res["invalid"] = "; ".join(problems)
