"""How a training loop drives gradient accumulation over microbatches (a *protocol*).

Megatron-FSDP reduces gradients differently depending on how the trainer tells it where an
optimizer step's microbatches end, and the harnesses must drive it as real trainers do, or they
measure a loop nobody runs. Two protocols exist:

``megatron-lm`` (the default: Megatron-LM, and Megatron-Bridge through it)
    megatron-core's ``FullyShardedDataParallel`` builds ``MegatronFSDP`` with
    ``sync_model_each_microbatch=False`` and its schedule
    (``forward_backward_no_pipelining``) runs every microbatch but the last inside
    ``model.no_sync()``, the last outside it, then ``finish_grad_sync()``. Unsharded
    gradients (ZeRO-1) and HSDP's DP-Outer reduction are reduced once, after the last
    microbatch.
``auto-sync``
    ``fully_shard`` / ``fully_shard_model``'s default, ``sync_model_each_microbatch=True``:
    every microbatch ends with a full gradient synchronisation (``finish_grad_sync()``), ZeRO-1's
    whole gradient buffer and HSDP's DP-Outer group included. The release documents (a warning
    in ``set_model_auto_sync``) that with ZeRO-1 or HSDP the buffer must then be zeroed after
    every microbatch, i.e. that this protocol does not accumulate for those strategies.

What both mean, and what the harnesses compare with: the gradient of an optimizer step is the
sum over its microbatches of the mean over data-parallel ranks of each rank's loss gradient
(Megatron-LM's loss functions divide by the number of microbatches themselves; the harness's
loss does not, so its reference is the plain sum).

An API a release lacks is an error naming it (``ProtocolError``), never a silent skip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mfsdp_hotfix.errors import ProtocolError as ProtocolError

MEGATRON_LM = "megatron-lm"
AUTO_SYNC = "auto-sync"
PROTOCOLS = (MEGATRON_LM, AUTO_SYNC)
DEFAULT = MEGATRON_LM

DESCRIPTIONS = {
    MEGATRON_LM: "Megatron-LM's: no_sync() around every microbatch but the last, "
                 "sync_model_each_microbatch=False",
    AUTO_SYNC: "fully_shard's default: sync_model_each_microbatch=True, a full gradient "
               "synchronisation after every microbatch",
}


def check(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown accumulation protocol {protocol!r}; "
                         f"one of {', '.join(PROTOCOLS)}")
    return protocol


def auto_sync(protocol: str) -> bool:
    """``sync_model_each_microbatch`` (``MegatronFSDP``'s ``model_auto_sync``) of a protocol."""
    return check(protocol) == AUTO_SYNC


def wrap_options(protocol: str) -> dict[str, Any]:
    """The keyword ``fully_shard_model`` / ``MegatronFSDP(...)`` must be built with: passed
    explicitly (never left to a default that differs between the two entry points), so that a
    release without it fails naming it."""
    return {"sync_model_each_microbatch": auto_sync(protocol)}


def _api(model: Any, name: str) -> Any:
    try:
        return getattr(model, name)
    except AttributeError:
        raise ProtocolError(
            f"{type(model).__name__} has no {name}: this release cannot be driven with "
            "Megatron-LM's accumulation protocol") from None


def verify(model: Any, protocol: str) -> None:
    """After wrapping: the model's ``model_auto_sync`` is what the protocol needs."""
    want = auto_sync(protocol)
    got = _api(model, "model_auto_sync")
    if bool(got) != want:
        raise ProtocolError(f"{type(model).__name__}.model_auto_sync is {got!r}; the "
                            f"{protocol} protocol needs {want!r}")


def reduces_once(protocol: str, strategy: str, outer: int = 1) -> bool:
    """Whether the release reduces a step's gradients over all ranks once, after the last
    microbatch, rather than once per microbatch: under ``megatron-lm``, unsharded gradients
    (ZeRO-1 ``"optim"``, ``"no_shard"``) without HSDP. The reference adds in that order."""
    return check(protocol) == MEGATRON_LM and strategy in ("optim", "no_shard") and outer == 1


@contextmanager
def _no_sync(model: Any) -> Iterator[None]:
    with _api(model, "no_sync")():
        yield


def accumulate(model: Any, protocol: str, microbatches: int,
               step: Callable[[int], None]) -> None:
    """Run ``step(index)`` (one microbatch's forward and backward) ``microbatches`` times as the
    protocol's trainer does; the caller then calls :func:`finish`.

    ``megatron-lm`` is megatron-core's ``forward_backward_no_pipelining``: one ``no_sync()``
    context around every microbatch but the last (entered even when there is only one, as
    there), the last outside it.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")
    if check(protocol) == MEGATRON_LM:
        with _no_sync(model):
            for index in range(microbatches - 1):
                step(index)
        step(microbatches - 1)
        return
    for index in range(microbatches):
        step(index)


def finish(model: Any, protocol: str) -> None:
    """What the protocol's trainer does between the last backward and the optimizer step.
    ``megatron-lm`` calls ``finish_grad_sync()``. Under ``auto-sync`` the release has called it
    at the end of every backward, and ``fully_shard``'s optimizer step does not call it again
    (``sync_grad_before_optimizer_step`` applies only without auto-sync): a second call would
    reduce unsharded gradients again where ``overlap_grad_reduce`` is off."""
    if check(protocol) == MEGATRON_LM:
        model.finish_grad_sync()
