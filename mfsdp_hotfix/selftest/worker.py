"""One rank of a selftest case: real Megatron-FSDP on CPU/gloo, checked against plain PyTorch.

Run by the runner as ``python -m mfsdp_hotfix.selftest.worker SPEC_JSON RANK WORLD STORE OUT``,
once per rank, with the chosen release first on ``PYTHONPATH``.  It installs the ``torch.cuda``
stand-in (only here, in this process), imports the release (the hotfix, when enabled, is already
imported as the parent package and patches it through its import hooks), wraps the release's
pools with the ordering checker, trains ``iterations`` steps of ``microbatches``
forward/backward passes driven as ``spec.protocol`` says (``protocol.accumulate``), then
``finish_grad_sync``, gathers the full gradients and compares them with a
single-process reference, then takes an SGD step on the shards (and the reference) and
``zero_grad_buffer``s before the next iteration.  It writes
``OUT/rank{R}.json`` and exits.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mfsdp_hotfix.selftest import protocol as accumulation
from mfsdp_hotfix.selftest.gradient_check import (
    GradCheck,
    gather_full,
    reference_gradients,
    sgd_step,
)
from mfsdp_hotfix.selftest.spec import BY_COPY, CaseSpec
from mfsdp_hotfix.selftest.wrapping import wrap

if TYPE_CHECKING:  # at run time imported after the release is, by _install_checks
    from mfsdp_hotfix.selftest.ordering import OrderingChecker

STANDALONE = "megatron_fsdp"
VENDORED = "megatron.core.distributed.fsdp.src.megatron_fsdp"


def resolve_flavour(flavour: str) -> str:
    """``auto``: megatron-core's vendored copy when megatron-core is importable, else standalone.

    (Standalone Megatron-FSDP prefers megatron-core's config classes when both are importable,
    so a user with megatron-core is running that copy's world anyway.)  Nothing of Megatron is
    imported, but the lookup fires the hotfix's import trigger where it is armed (which arms the
    audit too): in the CPU worker, install the ``torch.cuda`` stand-in first.
    """
    if flavour != "auto":
        return flavour
    spec = importlib.util.find_spec("megatron")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "core/distributed/fsdp/src/megatron_fsdp/__init__.py").exists():
            return "core"
    if importlib.util.find_spec(STANDALONE) is not None:
        return "standalone"
    raise ImportError("no Megatron-FSDP copy is importable "
                      "(neither megatron_fsdp nor megatron-core)")


def _release_info(flavour: str, package: ModuleType) -> dict[str, Any]:
    dist = "megatron-core" if flavour == "core" else "megatron-fsdp"
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(package, "__version__", "unknown")
    return {"flavour": flavour, "dist": dist, "version": version,
            "path": str(Path(package.__file__ or "").parent),
            "python": sys.version.split()[0]}


def _hotfix_status() -> Any:
    module = sys.modules.get("mfsdp_hotfix")
    status = getattr(module, "status", None)
    if status is None:
        return None
    try:
        return json.loads(json.dumps(status(), default=repr))
    except Exception as exc:  # a broken status() is reported, not fatal
        return {"status_error": repr(exc)}


def _rank_loss(spec: CaseSpec, loss: Any, world: int) -> Any:
    """What a rank back-propagates: with "per-token" the release only sums over ranks, so the
    1/world size of the mean is applied here (a power of two: exact)."""
    return loss / world if spec.grad_reduce == "per-token" else loss


def run_rank(spec: CaseSpec, rank: int, world: int, store_path: str) -> dict[str, Any]:
    """This rank's run of the case, as its report: ``crashed`` unless the run got through; the
    case's exception, or ``cannot_import`` where the release is not here; on rank 0, how far
    the gradients were from the reference; the ordering checker's and the hotfix's state."""
    started = time.perf_counter()
    report: dict[str, Any] = {"rank": rank, "crashed": True}
    release = _import_release(spec, report)
    if release is None:
        return report
    pgb, fully_shard = release
    spec = _reduction_for(spec, pgb)
    report["grad_reduce"] = spec.grad_reduce
    checker = _install_checks(spec, pgb)
    _join_group(spec, rank, world, store_path)
    inputs, targets = _batches(spec, world)
    try:
        fsdp = _build_fsdp(spec, fully_shard, world, report)
        fsdp_started = time.perf_counter()
        check = _train(spec, fsdp, inputs, targets, rank, world)
        report["fsdp_s"] = time.perf_counter() - fsdp_started
        report["crashed"] = False
        if rank == 0:
            report.update(check.fields())
    except BaseException as exc:  # any failure is the case's outcome
        report["exception"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-4000:]
    report["ordering"] = checker.summary()
    audit = sys.modules.get("mfsdp_hotfix.audit")
    if audit is not None:  # MFSDP_HOTFIX_AUDIT: this worker skips atexit, so finish it here
        audit.finish()
    report["hotfix_status"] = _hotfix_status()
    report["worker_s"] = time.perf_counter() - started
    return report


def _import_release(spec: CaseSpec, report: dict[str, Any]
                    ) -> tuple[ModuleType, ModuleType] | None:
    """The release's ``param_and_grad_buffer`` and ``fully_shard`` modules, imported under the
    ``torch.cuda`` stand-in (None: the copy asked for is not here, which ``report`` says)."""
    from mfsdp_hotfix.selftest import cuda_standin

    # First: resolve_flavour's lookup of ``megatron`` already fires the hotfix's import
    # trigger, which arms the audit on whatever torch.cuda is then (see cuda_standin.install).
    cuda_standin.install()
    report["hotfix_status"] = _hotfix_status()
    if spec.hotfix == "late":  # the model is built before the hotfix installs
        from mfsdp_hotfix import trigger

        trigger.disarm()
    try:
        flavour = resolve_flavour(spec.flavour)
        package = importlib.import_module(VENDORED if flavour == "core" else STANDALONE)
    except ImportError as exc:  # the copy asked for is not here: nothing can be tested
        report["cannot_import"] = {"module": exc.name, "error": f"{type(exc).__name__}: {exc}"}
        report["exception"] = report["cannot_import"]["error"]
        return None
    report["release"] = _release_info(flavour, package)
    pgb = importlib.import_module(package.__name__ + ".param_and_grad_buffer")
    fully_shard = importlib.import_module(package.__name__ + ".fully_shard")
    report["hotfix_status"] = _hotfix_status()  # again: hooks may have fired on that import
    return pgb, fully_shard


def _reduction_for(spec: CaseSpec, pgb: ModuleType) -> CaseSpec:
    """``BY_COPY`` resolved for the copy imported: per-token where its code has, or may have,
    sharded-grads-summed-unscaled (scale-then-sum is wrong there as shipped and refused with the
    hotfix: no fix to show), scale-then-sum elsewhere."""
    if spec.grad_reduce != BY_COPY:
        return spec
    from mfsdp_hotfix import detection, registry, release_defects

    copy = next(copy for copy in registry.COPIES if copy.buffer_module == pgb.__name__)
    has = release_defects.carried(release_defects.SHARDED_GRADS_SUMMED_UNSCALED,
                                  detection.detect_module(copy, pgb).shapes)
    return replace(spec, grad_reduce="scale-then-sum" if has is False else "per-token")


def _install_checks(spec: CaseSpec, pgb: ModuleType) -> OrderingChecker:
    """The ordering checker on the release's pools (returned, to read at the end), and gloo's
    stand-in PREMUL_SUM where the case reduces with it."""
    from mfsdp_hotfix.selftest.ordering import OrderingChecker

    checker = OrderingChecker()
    checker.install(pgb)
    if spec.grad_reduce == "premul-sum":
        from mfsdp_hotfix.selftest import premul

        premul.install()
    return checker


def _join_group(spec: CaseSpec, rank: int, world: int, store_path: str) -> None:
    """Join the case's gloo group, met at the file store the runner named."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(30.0, spec.timeout_s / 2)))


def _batches(spec: CaseSpec, world: int) -> tuple[Any, Any]:
    """The inputs and targets of every iteration, microbatch and rank (the same on every rank,
    so that rank 0 can compute the reference)."""
    import torch

    from mfsdp_hotfix.selftest import model as model_lib

    dtype = getattr(torch, spec.dtype)
    inputs = model_lib.batches(spec.hidden, spec.tokens, world, spec.microbatches,
                               spec.iterations, spec.seed, dtype)
    targets = model_lib.batches(spec.hidden, spec.tokens, world, spec.microbatches,
                                spec.iterations, spec.seed + 7, dtype)
    return inputs, targets


def _build_fsdp(spec: CaseSpec, fully_shard: ModuleType, world: int, report: dict[str, Any]
                ) -> Any:
    """The case's model wrapped by the release; with ``hotfix="late"``, the hotfix installed
    after that and applied to it (what ``apply_to`` returned goes into ``report``)."""
    import torch
    import torch.distributed as dist

    from mfsdp_hotfix.selftest import model as model_lib

    net = model_lib.build(spec.hidden, spec.units, spec.seed, spec.linear,
                          getattr(torch, spec.dtype), spec.wide_units, spec.experts,
                          spec.norm, spec.outside, spec.head)
    if spec.experts:  # expert-parallel over every rank: a group of their own
        expert_parallel = dist.new_group(list(range(world)))
        for module in net.modules():
            if isinstance(module, model_lib.Experts):
                module.group = expert_parallel
    fsdp = wrap(fully_shard, net, model_lib.Unit, spec.strategy, spec.double_buffer,
                torch.device("cpu"), spec.grad_reduce == "per-token", spec.options,
                spec.outer, spec.grad_comm_dtype, spec.protocol,
                spec.grad_reduce == "premul-sum", spec.overlap_grad_reduce,
                bool(spec.experts))
    if spec.hotfix == "late":
        import mfsdp_hotfix

        mfsdp_hotfix.install()
        report["apply_to_after_install"] = mfsdp_hotfix.apply_to(fsdp)
    return fsdp


def _train(spec: CaseSpec, fsdp: Any, inputs: Any, targets: Any, rank: int, world: int
           ) -> GradCheck:
    """``spec.iterations`` training steps; each step's full gradients are digested, and on rank
    0 compared with the reference's, before the SGD step on the shards."""
    import torch

    reference = (reference_gradients(spec, inputs, targets, getattr(torch, spec.dtype))
                 if rank == 0 else None)
    check = GradCheck()
    for it in range(spec.iterations):
        grads = _step_gradients(spec, fsdp, inputs, targets, it, rank, world)
        check.add(grads, it, reference[it] if reference is not None else None)
        if spec.lr:  # optimizer step on the shards, then back into the model's weights
            sgd_step(fsdp.module.parameters(), spec.lr)
            fsdp.install_optimized_model_weights()
    return check


def _step_gradients(spec: CaseSpec, fsdp: Any, inputs: Any, targets: Any, it: int, rank: int,
                    world: int) -> dict[str, Any]:
    """Iteration ``it``'s microbatches, driven as ``spec.protocol`` says, and the full
    gradients then gathered from every rank's shards."""
    from mfsdp_hotfix.selftest import model as model_lib

    fsdp.zero_grad_buffer()

    def microbatch(mb: int) -> None:
        out = fsdp(inputs[it, mb, rank])
        _rank_loss(spec, model_lib.loss_fn(out, targets[it, mb, rank]), world).backward()

    accumulation.accumulate(fsdp, spec.protocol, spec.microbatches, microbatch)
    accumulation.finish(fsdp, spec.protocol)
    named = dict(fsdp.module.named_parameters())
    return gather_full({n: p.grad for n, p in named.items()},
                       {n: tuple(p.shape) for n, p in named.items()},
                       1 if spec.strategy == "no_shard" else world // spec.outer)


def main(argv: list[str]) -> int:
    spec_json, rank, world, store_path, out_dir = argv
    spec = CaseSpec.from_json(spec_json)
    out = Path(out_dir) / f"rank{rank}.json"
    try:
        report = run_rank(spec, int(rank), int(world), store_path)
    except BaseException as exc:  # reported as a harness error
        report = {"rank": int(rank), "crashed": True, "harness_error": True,
                  "exception": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-4000:]}
    out.write_text(json.dumps(report, default=repr))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a peer stuck in a collective must not hang us, and gloo
    # teardown has crashed natively before.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
