"""One rank of a ``fully_shard`` training run on real Megatron-FSDP (CPU, gloo) with a real
optimizer, next to plain PyTorch.

Run as ``python optimizer_job.py CONFIG_JSON RANK WORLD STORE OUT`` with the release first on
``PYTHONPATH`` and the repository after it; ``MFSDP_HOTFIX=0`` in the environment runs the
release as shipped. ``CONFIG_JSON``: ``optimizer`` (a key of :data:`OPTIMIZERS`), ``steps``,
``strategy``, ``layout`` ("units": every parameter in a unit; "root-parameter": the root module
also owns a parameter it uses in ``forward``).
The model is wrapped with ``fully_shard_model`` and its optimizer with
``fully_shard_optimizer`` (fully_shard's API, one microbatch per step, auto-sync); each step is
zero_grad, forward, backward, ``optimizer.step()``.
Writes ``OUT/rank<R>.json``: rank 0 adds, per step, the comparison (``mfsdp_hotfix.compare``)
with plain PyTorch of the forward output, the gradient norm and the parameters after the step,
the parameters right after wrapping, and Adam's ``step`` count; every rank what the hotfix
reports.
"""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path
from typing import Any

OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adam": ("Adam", {"lr": 0.01}),
    "adam-coupled-decay": ("Adam", {"lr": 0.01, "weight_decay": 0.1}),
    "adamw": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
    "sgd-momentum": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "sgd-dampened": ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.5,
                             "weight_decay": 0.01, "nesterov": False}),
    "sgd": ("SGD", {"lr": 0.1}),
}


def optimizer_for(params: Any, name: str) -> Any:
    import torch

    cls, kwargs = OPTIMIZERS[name]
    return getattr(torch.optim, cls)(params, **kwargs)


def build(config: dict[str, Any]) -> Any:
    """The model: the selftest's stack of units, and for ``root-parameter`` a scale the root
    owns (not in any unit) applied to the output."""
    import torch

    from mfsdp_hotfix.selftest import model as model_lib

    net = model_lib.build(16, 3, 1234, "unfused")
    if config.get("layout", "units") == "root-parameter":
        net.__class__ = ScaledStack
        net.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16))
    return net


def _scaled_stack() -> type:
    from mfsdp_hotfix.selftest import model as model_lib

    class Scaled(model_lib.Stack):
        """The stack, its output scaled by a parameter the root module owns."""

        def forward(self, x: Any) -> Any:
            return super().forward(x) * self.scale

    return Scaled


ScaledStack: Any = None


def loss_of(out: Any, target: Any) -> Any:
    return ((out - target) ** 2).mean()


def run(config: dict[str, Any], rank: int, world: int, store_path: str) -> dict[str, Any]:
    global ScaledStack
    import mfsdp_hotfix
    from mfsdp_hotfix.selftest import cuda_standin

    ScaledStack = _scaled_stack()

    cuda_standin.install()
    import megatron_fsdp  # noqa: F401  (the hooks patch it here)
    import torch
    import torch.distributed as dist
    from megatron_fsdp import fully_shard
    from megatron_fsdp.fully_shard import fully_shard_optimizer

    from mfsdp_hotfix.selftest import model as model_lib
    from mfsdp_hotfix.selftest.gradient_check import gather_full
    from mfsdp_hotfix.selftest.wrapping import wrap

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world),  # type: ignore
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))
    steps = config.get("steps", 2)
    inputs = model_lib.batches(16, 8, world, 1, steps, 1234)
    targets = model_lib.batches(16, 8, world, 1, steps, 1234 + 7)
    shapes = {n: tuple(p.shape) for n, p in build(config).named_parameters()}
    strategy = config.get("strategy", "optim_grads_params")
    whole = 1 if strategy == "no_shard" else None  # no_shard: every rank holds all of it
    fsdp = wrap(fully_shard, build(config), model_lib.Unit, strategy, False,
                torch.device("cpu"), protocol="auto-sync")
    optimizer = fully_shard_optimizer(optimizer_for(fsdp.parameters(), config["optimizer"]))

    def full_params() -> dict[str, Any]:
        return gather_full({n: p.detach() for n, p in fsdp.module.named_parameters()}, shapes,
                           whole)

    seen: list[dict[str, Any]] = [{"params": full_params()}]
    for step in range(steps):
        optimizer.zero_grad()
        out = fsdp(inputs[step, 0, rank])
        loss_of(out, targets[step, 0, rank]).backward()
        named = dict(fsdp.module.named_parameters())
        grads = gather_full({n: p.grad for n, p in named.items()}, shapes, whole)
        optimizer.step()
        outs: list[Any] = [None] * world
        dist.all_gather_object(outs, out.detach())
        seen.append({"out": torch.stack(outs), "params": full_params(),
                     "grad_norm": torch.stack([g.norm() for g in grads.values()]).norm()})
    state = next(iter(optimizer.state.values()), {})
    report: dict[str, Any] = {"status": mfsdp_hotfix.status(),
                              "step_count": float(state["step"]) if "step" in state else None}
    if rank == 0:
        report.update(compare_with_reference(config, seen, inputs, targets, world))
    return report


def compare_with_reference(config: dict[str, Any], seen: list[dict[str, Any]], inputs: Any,
                           targets: Any, world: int) -> dict[str, Any]:
    """Plain PyTorch, the same model, data and optimizer: the loss is the mean over ranks of
    each rank's loss (what data parallelism averages)."""
    import torch

    from mfsdp_hotfix.compare import compare

    ref = build(config)
    optimizer = optimizer_for(ref.parameters(), config["optimizer"])
    want: list[dict[str, Any]] = [{"params": {n: p.detach().clone()
                                              for n, p in ref.named_parameters()}}]
    for step in range(len(seen) - 1):
        optimizer.zero_grad()
        outs = [ref(inputs[step, 0, r]) for r in range(world)]
        (sum(loss_of(o, targets[step, 0, r]) for r, o in enumerate(outs)) / world).backward()
        norm = torch.stack([p.grad.norm() for p in ref.parameters()]).norm()
        optimizer.step()
        want.append({"out": torch.stack([o.detach() for o in outs]), "grad_norm": norm,
                     "params": {n: p.detach().clone() for n, p in ref.named_parameters()}})
    result: dict[str, Any] = {"wrapped": compare([seen[0]["params"]], [want[0]["params"]])
                              .to_dict()}
    for key in ("out", "grad_norm", "params"):
        got = [s[key] if key != "params" else s[key] for s in seen[1:]]
        ref_steps = [w[key] for w in want[1:]]
        if key != "params":
            got, ref_steps = [{key: g} for g in got], [{key: w} for w in ref_steps]
        result[key] = compare(got, ref_steps).to_dict()
    result["grad_norm_ratio"] = [float(s["grad_norm"] / w["grad_norm"])
                                 for s, w in zip(seen[1:], want[1:], strict=True)]
    first = [(s["params"][n] - seen[0]["params"][n]).norm() /
             (w["params"][n] - want[0]["params"][n]).norm()
             for s, w in zip(seen[1:2], want[1:2], strict=True) for n in w["params"]]
    result["first_update_ratio"] = float(sum(first) / len(first)) if first else math.nan
    return result


def fsdp(release: str) -> Path:
    """The unpacked megatron-fsdp ``release``, for :func:`run_job`."""
    import releases

    return releases.unpacked("megatron-fsdp", release)


def assert_exact(report: dict[str, Any]) -> None:
    """Rank 0's report: the wrapped model, the output, the gradient norm and the parameters
    after the step all equal plain PyTorch's."""
    assert "exception" not in report and "died" not in report, report
    for key in ("wrapped", "out", "grad_norm", "params"):
        assert report[key]["outcome"] == "exact", (key, report[key])


def run_job(release: Path, hotfix: bool, world: int = 2, **config: Any) -> dict[str, Any]:
    """Every rank of one run, as a test runs it; rank 0's report, or ``{"died": returncodes}``
    where no rank 0 report was written (a rank killed by a signal: SIGSEGV is -11)."""
    import rank_jobs

    reports, statuses, logs = rank_jobs.run_ranks(Path(__file__), release, config, world, hotfix,
                                                  timeout=300)
    if reports[0] is None:
        return {"died": statuses, "log": logs[0][-2000:]}
    return reports[0]


if __name__ == "__main__":
    import rank_jobs

    rank_jobs.main(run)
