"""Put into Megatron-LM's ``pretrain_gpt.py`` process through ``PYTHONPATH``, so that the script
itself runs unchanged (``validation/megatron_lm/launch.py`` sets the variables below).

Acts only in the process whose script is ``pretrain_gpt.py`` and only when
``MFSDP_VAL_MLM_CAPTURE`` names a folder, or when ``MFSDP_VAL_MLM_INJECT=1`` (everything below but
the capture: ``validation/parity_gpu``, whose runs are read by ``mfsdp-hotfix parity`` itself);
then, before Megatron is imported:

* ``MFSDP_VAL_MLM_FAKE_NCCL=1``: NCCL work semantics for torch's fake process group (Megatron-LM's
  ``--fake-process-group``), and ``MFSDP_VAL_MLM_RS_DELAY_CYCLES``: a ``torch.cuda._sleep`` before
  every reduce-scatter (``fakepg_shims``, the same shims as the other phases);
* APEX's ``fused_weight_gradient_mlp_cuda`` replaced by a stub whose kernels raise, when it is
  not installed (``core_gpt_case.install_apex_stub``: with Megatron-FSDP the wgrad goes through TE);
* ``megatron.core.datasets.utils.compile_helpers``: the wheel ships the compiled dataset helpers
  but no Makefile, so ``make`` would fail and Megatron would exit; the stand-in imports the shipped
  ``helpers_cpp`` instead (so a missing helper still fails);
* ``megatron.training.training.train_step`` wrapped: after every iteration, the reported losses,
  the grad norm, every parameter group's gradient buffer (the reduced gradient the optimizer
  read) and its weight buffers (the updated parameters) are cloned on the current stream (no
  host synchronisation is added); at exit they go to ``capture.pt`` with ``capture.json``
  (iterations, gradient-pool allocations, stages reached, the exception if one ended the run).

Then the ``sitecustomize`` this one shadows runs (the hotfix's bootstrap puts its own first and
chains to this one, which chains on).
"""

import importlib.machinery
import importlib.util
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
STATE = {"stages": ["started"], "iterations": 0, "pool_allocations": {}, "buffers": {},
         "error": None}
STEPS = []


def _capturing():
    return bool(os.environ.get("MFSDP_VAL_MLM_CAPTURE"))


def _active():
    return (_capturing() or os.environ.get("MFSDP_VAL_MLM_INJECT") == "1") and \
        os.path.basename(sys.argv[0] if sys.argv else "") == "pretrain_gpt.py"


def _stage(name):
    if name not in STATE["stages"]:
        STATE["stages"].append(name)


def _setup():
    validation = os.path.dirname(HERE)
    sys.path.append(validation)  # after the release: nothing there shadows Megatron
    import core_gpt_case
    import fakepg_shims

    if os.environ.get("MFSDP_VAL_MLM_FAKE_NCCL") == "1":
        fakepg_shims.install_nccl_semantics()
        fakepg_shims.install_rs_delay(int(os.environ.get("MFSDP_VAL_MLM_RS_DELAY_CYCLES", "0")))
    STATE["shims"] = fakepg_shims.STATS
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        core_gpt_case.install_apex_stub()
        STATE["apex_stub"] = True
    import wrapt

    wrapt.register_post_import_hook(_shipped_helpers, "megatron.core.datasets.utils")
    if not _capturing():
        return
    wrapt.register_post_import_hook(_wrap_train_step, "megatron.training.training")
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        STATE["error"] = {"type": kind.__name__, "message": str(value)[:2000],
                          "traceback": "".join(traceback.format_exception(kind, value, tb))[-6000:]}
        previous(kind, value, tb)

    sys.excepthook = excepthook
    import atexit

    atexit.register(_save)


def _shipped_helpers(module):
    def compile_helpers():
        from megatron.core.datasets import helpers_cpp  # noqa: F401 - shipped by the wheel

        _stage("dataset-helpers")

    module.compile_helpers = compile_helpers


def _buffers(model):
    """(name, parameter-group buffer holder) of every Megatron-FSDP parameter/gradient buffer."""
    for chunk_index, chunk in enumerate(model if isinstance(model, (list, tuple)) else [model]):
        for module in chunk.modules():
            pgb = getattr(module, "param_and_grad_buffer", None)
            if pgb is not None:
                yield chunk_index, pgb
                break


def _count_pool(pgb, chunk_index):
    for attr in ("main_grad_alloc", "weight_alloc"):
        alloc = getattr(pgb, attr, None)
        if alloc is None or not hasattr(alloc, "allocate"):
            continue
        key = f"{chunk_index}/{attr}"
        entry = STATE["pool_allocations"].setdefault(
            key, {"class": type(alloc).__name__, "calls": 0})
        inner = alloc.allocate

        def allocate(*args, _inner=inner, _entry=entry, **kwargs):
            _entry["calls"] += 1
            return _inner(*args, **kwargs)

        alloc.allocate = allocate
    STATE["buffers"][str(chunk_index)] = [
        {attr: (None if getattr(g, attr, None) is None else
                {"distributed": bool(getattr(g, attr).is_data_distributed),
                 "dtype": str(getattr(g, attr).dtype)})
         for attr in ("model_weight_buffer", "main_weight_buffer", "main_grad_buffer")}
        for g in pgb.parameter_groups]


def _wrap_train_step(module):
    original = module.train_step

    def train_step(*args, **kwargs):
        model = kwargs["model"] if "model" in kwargs else args[2]
        if "training" not in STATE["stages"]:
            _stage("training")
            for chunk_index, pgb in _buffers(model):
                _count_pool(pgb, chunk_index)
        out = original(*args, **kwargs)
        try:
            _capture(model, out)
        except Exception as exc:  # never change the run; the driver reports it as a failure
            STATE.setdefault("capture_errors", []).append(f"{type(exc).__name__}: {exc}"[:500])
        return out

    module.train_step = train_step


def _capture(model, out):
    import torch

    step = {}
    for name, value in (out[0] or {}).items():
        if isinstance(value, (tuple, list)):
            value = torch.stack([torch.as_tensor(v).float() for v in value])
        step[f"loss/{name}"] = torch.as_tensor(value).detach().clone()
    grad_norm = out[5]
    if grad_norm is not None:
        step["grad_norm"] = torch.as_tensor(grad_norm, dtype=torch.float64).detach().clone()
    for chunk_index, pgb in _buffers(model):
        for i, group in enumerate(pgb.parameter_groups):
            for attr, name in (("main_grad_buffer", "grad"), ("main_weight_buffer", "main_param"),
                               ("model_weight_buffer", "param")):
                buf = getattr(group, attr, None)
                if buf is not None and buf.data is not None:
                    step[f"{name}/{chunk_index}.{i}"] = buf.data.detach().clone()
    STEPS.append(step)
    STATE["iterations"] += 1


def _save():
    folder = os.environ["MFSDP_VAL_MLM_CAPTURE"]
    try:
        if STEPS:
            import torch

            torch.save([{k: v.cpu() for k, v in s.items()} for s in STEPS],
                       os.path.join(folder, "capture.pt"))
    except Exception as exc:  # a dead CUDA context: the json still says how far it got
        STATE["save_error"] = f"{type(exc).__name__}: {exc}"[:1000]
    STATE["hotfix_loaded"] = "mfsdp_hotfix" in sys.modules
    if STATE["hotfix_loaded"]:
        try:
            STATE["hotfix_status"] = json.loads(json.dumps(
                sys.modules["mfsdp_hotfix"].status(), default=repr))
        except Exception as exc:
            STATE["hotfix_status"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(folder, "capture.json"), "w") as f:
        json.dump(STATE, f, indent=1, default=str)


def _chain():
    """The next ``sitecustomize`` after this folder on ``sys.path``."""
    here = [i for i, p in enumerate(sys.path) if os.path.abspath(p or ".") == HERE]
    rest = sys.path[here[0] + 1:] if here else []
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if _active():
    _setup()
_chain()
