"""``selftest --gpu``'s real worker (``gpu_worker``), rehearsed on the CPU for the tests.

Where the hardware is missing: ``torch.cuda`` is the selftest's stand-in (streams and events that
keep happens-before clocks, so the audit counts what it would count), ``torch.device("cuda", N)``
is the CPU, and the GPU sleep and its calibration do nothing. No race can happen on the CPU, so
this shows the structure (preparing, the turn, training, the truth kept and compared, the audit's
files), not the race. Used as ``python -m cpu_rehearsal_worker RUN_JSON OUT_DIR``.
"""

import sys
from typing import Any

import torch

from mfsdp_hotfix.selftest import cuda_standin

cuda_standin.install()  # before anything looks up megatron (the audit instruments torch.cuda)
_DEVICE = torch.device


class _CudaIsTheCpu(type):
    """``torch.device("cuda", N)`` gives the CPU; ``isinstance(x, torch.device)`` still holds."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _DEVICE)

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.device:
        if args and str(args[0]).startswith("cuda"):
            return _DEVICE("cpu")
        return _DEVICE(*args, **kwargs)


class _Device(metaclass=_CudaIsTheCpu):
    pass


cuda: Any = torch.cuda
torch.device = _Device  # type: ignore[misc, assignment]
cuda.set_device = lambda *args, **kwargs: None
cuda.get_device_name = lambda *args, **kwargs: "CPU rehearsal"
cuda._sleep = lambda cycles: None

from mfsdp_hotfix.selftest import gpu_shims, gpu_worker  # noqa: E402

gpu_shims.measure_cycles_per_ms = lambda: (1000.0, [])  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(gpu_worker.main(sys.argv[1:]))
