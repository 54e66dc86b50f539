"""``mfsdp-hotfix parity`` puts this folder first on ``PYTHONPATH`` of every run it compares (the
reference, the candidate, the shipped run), the same way: it records what Megatron-LM's
``training_log`` is given, at full precision, then runs the ``sitecustomize`` it shadows.

Megatron prints the grad norm to 3 decimals, too coarse for a small norm; this writes, from the
process that prints (as ``print_rank_last``: the last rank, or each process of a fake process
group), one JSON line per call with the iteration, the grad norm and the losses as Python floats
(``repr``, every bit), to the file that ``MFSDP_PARITY_CAPTURE`` names (``{rank}`` in it becomes
the rank). Arguments are bound by name, so every release's signature is read the same way (0.14
and 0.15 have a ``decoupled_learning_rate`` before ``iteration``).

It owes nothing to the hotfix: it imports only the standard library and ``wrapt``, never
``mfsdp_hotfix`` (importing that package arms the fixes), so it works with ``MFSDP_HOTFIX=0``
and with no fix applied; it records what it finds of ``mfsdp_hotfix`` already loaded in the
process. It never breaks the run: any failure is one warning line and the run goes on without
the capture.
"""

import importlib.machinery
import importlib.util
import json
import os
import sys
import types

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not loaded at interpreter start: no cost to the run
    import inspect
    from typing import Any

VARIABLE = "MFSDP_PARITY_CAPTURE"
MODULE = "megatron.training.training"
# Shared by every execution of this file in the process (a chain may run it twice).
_STATE_NAME = "_mfsdp_parity_capture_state"


def _warn(what: str, exc: BaseException) -> None:
    sys.stderr.write(f"mfsdp-hotfix parity: the capture {what} ({type(exc).__name__}: {exc}); "
                     "the run goes on, compared on its printed lines only\n")


def _state() -> "Any":
    state: Any = sys.modules.get(_STATE_NAME)
    if state is None:
        state = types.ModuleType(_STATE_NAME)
        state.__dict__.update(
            ran=set(),  # the sitecustomize files this chain has run
            hooked=False, stream=None,
            off=False)  # after a failure, or on a rank that does not print
        sys.modules[_STATE_NAME] = state
    return state


def _rank_and_size() -> "tuple[int, int, bool]":
    """(rank, world size, whether this process prints): as Megatron's ``print_rank_last``, the
    last rank, or every process of a fake process group or of none."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
        return rank, size, dist.get_backend() == "fake" or rank == size - 1
    env = os.environ
    rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
    size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
    return rank, size, True


def _hotfix_seen() -> "dict[str, Any]":
    """What this process holds of mfsdp_hotfix: not loaded, or its state and the fixes applied."""
    package = sys.modules.get("mfsdp_hotfix")
    if package is None:
        return {"hotfix": "not loaded"}
    status = package.status()
    applied = sorted({fix for copy in status.get("copies", [])
                      for fix, info in (copy.get("fixes") or {}).items()
                      if info.get("state") == "applied"})
    return {"hotfix": status.get("hotfix"), "fixes_applied": applied,
            "disabled_fixes": status.get("settings", {}).get("disabled_fixes", [])}


def _number(value: "Any") -> "float | None":
    if value is None:
        return None
    if hasattr(value, "float") and hasattr(value, "sum"):  # a tensor, as Megatron sums it
        return float(value.float().sum().item())
    return float(value)


def _record(state: "Any", signature: "inspect.Signature", args: "tuple[Any, ...]",
            kwargs: "dict[str, Any]") -> None:
    bound = signature.bind(*args, **kwargs).arguments
    if state.stream is None:
        rank, size, prints = _rank_and_size()
        if not prints:
            state.off = True  # not the rank that prints: nothing to record here
            return
        path = os.environ[VARIABLE].replace("{rank}", str(rank))
        state.stream = open(path, "a", buffering=1)
        process = {"kind": "process", "rank": rank, "world_size": size, "pid": os.getpid(),
                   "parameters": list(signature.parameters)}
        try:
            process.update(_hotfix_seen())
        except Exception as exc:
            process["hotfix"] = f"unreadable: {type(exc).__name__}: {exc}"
        state.stream.write(json.dumps(process) + "\n")
    line = {"kind": "iteration", "iteration": int(bound["iteration"]),
            "grad_norm": _number(bound.get("grad_norm")),
            "losses": {str(k): _number(v) for k, v in (bound.get("loss_dict") or {}).items()},
            "skipped": _number(bound.get("skipped_iter"))}
    state.stream.write(json.dumps(line) + "\n")


def _wrap(module: types.ModuleType) -> None:
    import inspect

    import wrapt

    state = _state()
    signature = inspect.signature(module.training_log)

    def training_log(wrapped: "Any", instance: "Any", args: "tuple[Any, ...]",
                     kwargs: "dict[str, Any]") -> "Any":
        result = wrapped(*args, **kwargs)
        if not state.off:
            try:
                _record(state, signature, args, kwargs)
            except Exception as exc:
                state.off = True
                _warn("stopped", exc)
        return result

    wrapt.wrap_function_wrapper(module, "training_log", training_log)


def _on_import(module: types.ModuleType) -> None:
    try:
        _wrap(module)
    except Exception as exc:
        _warn(f"could not wrap {MODULE}.training_log", exc)


def _install(state: "Any") -> None:
    if state.hooked or not os.environ.get(VARIABLE):
        return
    state.hooked = True
    try:
        import wrapt

        wrapt.register_post_import_hook(_on_import, MODULE)
    except Exception as exc:
        _warn("is not installed", exc)


def _chain(state: "Any") -> None:
    """Run the next ``sitecustomize`` after this folder on ``sys.path`` that this chain has not
    run yet (another chaining one may have run this file again)."""
    here = os.path.dirname(os.path.abspath(__file__))
    state.ran.add(os.path.abspath(__file__))
    positions = [i for i, p in enumerate(sys.path) if os.path.abspath(p or ".") == here]
    for entry in sys.path[positions[0] + 1:] if positions else []:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is None or spec.loader is None or spec.origin is None:
            continue
        if os.path.abspath(spec.origin) in state.ran:
            continue
        state.ran.add(os.path.abspath(spec.origin))
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
        return


try:
    _install(_state())
except Exception as exc:
    _warn("could not start", exc)
_chain(_state())
