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

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mfsdp_hotfix.compare import compare
from mfsdp_hotfix.selftest import protocol as accumulation
from mfsdp_hotfix.selftest.spec import CaseSpec

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


def _gather_full(grads: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                 shard_ranks: int | None = None) -> dict[str, Any]:
    """Full gradients from the ranks' row shards (Megatron-FSDP shards dim 0, rank order).

    A rank whose shard of a parameter is empty has ``grad is None`` there. An expert parameter
    (``.experts.`` in its name) is whole on every rank (its data-parallel group has one rank):
    rank 0's is taken.

    Written here rather than taken from the release: its uneven-DTensor gather uses an
    all-gather of unequal sizes, which gloo refuses.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local = {n: (g.to_local() if isinstance(g, DTensor) else g).detach().clone()
             for n, g in grads.items() if g is not None}
    shards: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shards, local)
    full = {}
    # HSDP: the first DP-Outer group's shards make a whole; no_shard: rank 0's gradients
    shards = shards[:shard_ranks]
    for name, shape in shapes.items():
        owners = shards[:1] if ".experts." in name else shards
        pieces = [s[name].reshape(-1, *shape[1:]) for s in owners if name in s]
        if not pieces:
            raise AssertionError(f"no rank has a gradient for {name} after finish_grad_sync")
        joined = torch.cat(pieces, dim=0)
        if tuple(joined.shape) != tuple(shape):
            raise RuntimeError(f"harness: shards of {name} join to {tuple(joined.shape)}, "
                               f"expected {tuple(shape)}")
        full[name] = joined
    return full


def fully_shard_model_of(release: Any) -> Any:
    """Megatron-FSDP's ``fully_shard_model`` from whatever names it: the package
    (``megatron_fsdp`` or megatron-core's vendored copy), its ``fully_shard`` module, the
    ``fully_shard`` function the package exports under the same name, or ``fully_shard_model``
    itself; anything else is a TypeError that says what is accepted."""
    found = None
    if isinstance(release, ModuleType):
        found = getattr(release, "fully_shard_model", None)
    elif callable(release) and getattr(release, "__name__", None) in ("fully_shard",
                                                                       "fully_shard_model"):
        found = getattr(sys.modules.get(getattr(release, "__module__", "") or ""),
                        "fully_shard_model", None)
    if not callable(found):
        raise TypeError(
            "wrap() takes Megatron-FSDP as its first argument: the package (megatron_fsdp, or "
            "megatron.core.distributed.fsdp.src.megatron_fsdp), its fully_shard module or "
            f"function, or fully_shard_model; got {release!r}")
    return found


def wrap(release: Any, module: Any, unit_cls: type, strategy: str,
         double_buffer: bool, device: Any, per_token_loss: bool = False,
         options: dict[str, Any] | None = None, outer: int = 1,
         grad_comm_dtype: str | None = None, protocol: str = accumulation.DEFAULT,
         div_fusion: bool = False, overlap_grad_reduce: bool = True,
         experts: bool = False) -> Any:
    """``fully_shard_model`` over all ranks of the default group, as a (ranks, 1) dp/tp mesh
    (megatron-fsdp 0.5.x needs a registered TP submesh), with the options this release accepts;
    ``options`` must all be accepted. ``outer`` > 1: HSDP, an (outer, ranks/outer, 1) mesh.
    ``release``: Megatron-FSDP, as :func:`fully_shard_model_of` accepts it (e.g.
    ``megatron_fsdp``, or ``from megatron_fsdp import fully_shard``).
    ``protocol``: the accumulation protocol the caller will drive (``protocol.accumulate``); it
    sets ``sync_model_each_microbatch``, which the release must accept.
    ``div_fusion``: keep the release's ``gradient_reduce_div_fusion=True`` (PREMUL_SUM: on gloo
    only with ``premul.install()``); False scales the buffer, then reduces with SUM.
    ``overlap_grad_reduce``: False reduces ZeRO-1 / no_shard gradients in ``finish_grad_sync``.
    ``experts``: the module has expert parameters (``model.Experts``), expert-parallel over all
    ranks: ``expt_device_mesh`` is an (expert-data-parallel 1, tp 1) mesh of this rank, as
    megatron-core's adapter builds it; a release without that option fails."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard_model = fully_shard_model_of(release)

    world = dist.get_world_size()
    hybrid: dict[str, Any] = {}
    if outer > 1:
        mesh = init_device_mesh(device.type, (outer, world // outer, 1),
                                mesh_dim_names=("dp_outer", "fsdp", "tp"))
        flat = mesh["dp_outer", "fsdp"]._flatten("dp")
        hybrid = {"dp_outer_dim": "dp_outer", "hybrid_fsdp_group": flat.get_group()}
    else:
        mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("fsdp", "tp"))
    if experts:
        if outer > 1:
            raise ValueError("harness: expert units are not built with HSDP")
        per_expert = init_device_mesh(device.type, (world, 1, 1),
                                      mesh_dim_names=("ep", "fsdp", "tp"))
        hybrid["expt_device_mesh"] = per_expert["fsdp", "tp"]
    if grad_comm_dtype is not None:
        import torch

        mixed = importlib.import_module(fully_shard_model.__module__.rsplit(".", 1)[0]
                                        + ".mixed_precision")
        hybrid["mixed_precision_policy"] = mixed.MixedPrecisionPolicy(
            grad_comm_dtype=getattr(torch, grad_comm_dtype))
    wanted: dict[str, Any] = {
        "module": module, "device_mesh": mesh, "dp_shard_dim": "fsdp", "tp_dim": "tp",
        "fsdp_unit_modules": [unit_cls],
        "zero_dp_strategy": strategy,
        "device": device, "fsdp_double_buffer": double_buffer,
        "overlap_grad_reduce": True, "overlap_param_gather": True,
        "calculate_per_token_loss": per_token_loss,
    }
    accepted = inspect.signature(fully_shard_model).parameters
    required = {**hybrid, **accumulation.wrap_options(protocol), **(options or {})}
    if not overlap_grad_reduce:  # a setting studied, so a release without it fails the case
        wanted.pop("overlap_grad_reduce")
        required["overlap_grad_reduce"] = False
    unknown = sorted(set(required) - set(accepted))
    if unknown:
        raise TypeError(f"this release's fully_shard_model has no option {', '.join(unknown)}")
    model = fully_shard_model(**{k: v for k, v in wanted.items() if k in accepted}, **required)
    accumulation.verify(model, protocol)
    # gloo has no PREMUL_SUM: by default scale first, then SUM (a setting, not a patch; the GPU
    # runs use the same, so that every backend reduces alike).
    if not div_fusion:
        if not hasattr(model.ddp_config, "gradient_reduce_div_fusion"):
            raise TypeError("this release's DistributedDataParallelConfig has no "
                            "gradient_reduce_div_fusion")
        model.ddp_config.gradient_reduce_div_fusion = False
    return model


def _rank_loss(spec: CaseSpec, loss: Any, world: int) -> Any:
    """What a rank back-propagates: with "per-token" the release only sums over ranks, so the
    1/world size of the mean is applied here (a power of two: exact)."""
    return loss / world if spec.grad_reduce == "per-token" else loss


def _reference(spec: CaseSpec, inputs: Any, targets: Any, dtype: Any) -> list[dict[str, Any]]:
    """Plain single-process PyTorch: per iteration, the sum over microbatches of the mean over
    ranks of each rank's loss gradient (what both protocols define, ``protocol``), then an SGD
    step. The additions are made in the order the release's reduction makes them, so that a
    correct run is bit-identical: where the protocol reduces once per step
    (``protocol.reduces_once``), each rank's gradients are summed over microbatches first and
    the ranks' sums then averaged; otherwise each microbatch is averaged over ranks first."""
    from mfsdp_hotfix.selftest import model as model_lib

    ref = model_lib.build(spec.hidden, spec.units, spec.seed, "plain", dtype, spec.wide_units,
                          spec.experts)
    ranks = inputs.shape[2]
    once = accumulation.reduces_once(spec.protocol, spec.strategy, spec.outer)
    out: list[dict[str, Any]] = []
    for it in range(spec.iterations):
        if once:
            per_rank = []
            for r in range(ranks):
                ref.zero_grad(set_to_none=True)
                for mb in range(spec.microbatches):
                    loss: Any = model_lib.loss_fn(ref(inputs[it, mb, r]), targets[it, mb, r])
                    loss.backward()
                per_rank.append({n: p.grad.detach().clone() for n, p in ref.named_parameters()
                                 if p.grad is not None})
            grads = {n: sum(g[n] * (1.0 / ranks) for g in per_rank) for n in per_rank[0]}
        else:
            ref.zero_grad(set_to_none=True)
            for mb in range(spec.microbatches):
                loss = sum(model_lib.loss_fn(ref(inputs[it, mb, r]), targets[it, mb, r])
                           for r in range(ranks)) / ranks
                loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()
                     if p.grad is not None}
        out.append(grads)
        for n, p in ref.named_parameters():
            p.grad = grads.get(n)
        _sgd_step(ref.parameters(), spec.lr)
    return out


def _sgd_step(params: Any, lr: float) -> None:
    """Plain SGD, the same elementwise op on full tensors (reference) and on shards (FSDP)."""
    import torch

    with torch.no_grad():
        for p in params:
            if p.grad is not None and lr:
                p.add_(p.grad, alpha=-lr)


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
                          getattr(torch, spec.dtype), spec.wide_units, spec.experts)
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
           ) -> _GradCheck:
    """``spec.iterations`` training steps; each step's full gradients are digested, and on rank
    0 compared with the reference's, before the SGD step on the shards."""
    import torch

    reference = _reference(spec, inputs, targets, getattr(torch, spec.dtype)) if rank == 0 else None
    check = _GradCheck()
    for it in range(spec.iterations):
        grads = _step_gradients(spec, fsdp, inputs, targets, it, rank, world)
        check.add(grads, it, reference[it] if reference is not None else None)
        if spec.lr:  # optimizer step on the shards, then back into the model's weights
            _sgd_step(fsdp.module.parameters(), spec.lr)
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
    return _gather_full({n: p.grad for n, p in named.items()},
                        {n: tuple(p.shape) for n, p in named.items()},
                        1 if spec.strategy == "no_shard" else world // spec.outer)


@dataclass
class _GradCheck:
    """The gathered gradients of every iteration: a digest of them, and how far they are from
    the reference's where rank 0 compared them."""

    digest: Any = field(default_factory=hashlib.sha256)
    worst_abs: float = 0.0
    worst_rel: float = 0.0
    compared: int = 0
    per_param: dict[str, float] = field(default_factory=dict)  # "name@iteration" -> error > 0

    def add(self, grads: dict[str, Any], it: int, reference: dict[str, Any] | None) -> None:
        """Iteration ``it``'s gradients, and (rank 0) the reference's for that iteration."""
        for name in sorted(grads):
            self.digest.update(name.encode())
            self.digest.update(grads[name].contiguous().numpy().tobytes())
        for name, want in (reference or {}).items():
            got = grads[name].reshape(want.shape)
            # not bit-identity (another computation): how far from it, NaN/Inf: inf
            diff = compare([{name: got}], [{name: want}]).max_abs
            if diff is None:
                diff = math.inf
            self.compared += 1
            scale = want.abs().max().item() or 1.0
            self.worst_abs = max(self.worst_abs, diff)
            self.worst_rel = max(self.worst_rel, diff / scale)
            if diff > 0:
                self.per_param[f"{name}@{it}"] = diff

    def fields(self) -> dict[str, Any]:
        """Rank 0's report fields."""
        worst = sorted(self.per_param.items(), key=lambda kv: -kv[1])[:8]
        return {"grads_compared": self.compared,  # gradients, over all iterations
                "max_abs_grad_error": self.worst_abs if self.compared else None,  # none: no match
                "max_rel_grad_error": self.worst_rel,
                "grad_digest": self.digest.hexdigest(),
                "worst_grads": dict(worst)}


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
