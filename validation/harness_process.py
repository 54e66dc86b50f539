"""The per-process half of the GPU harness: what one Python process sets up once and every
case it runs shares.

Fixed at import or CUDA initialisation, hence per process: the release (its folder on
``PYTHONPATH``, the import path ``pkg``), the hotfix (``fix="hotfix"`` imports ``mfsdp_hotfix``
before Megatron), the fake group of world size 2 and its mesh, the fake group's work semantics
(``pg``), the fault wrappers and TransformerEngine. A case asking for other process keys than
the process was started with is refused (the caller starts another process).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import schedule_faults
import slot_trace
from emulated_layers import build_classes

PROCESS_KEYS = ("pkg", "fix", "pg")


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
            self._slot_log = slot_trace.install(self.pgbmod.FixedPoolAllocator)
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


def release_version(pkg: str) -> str:
    from importlib import metadata

    dist_name = "megatron-fsdp" if pkg == "megatron_fsdp" else "megatron-core"
    try:
        return f"{dist_name} {metadata.version(dist_name)}"
    except Exception:
        return f"{dist_name} ?"

