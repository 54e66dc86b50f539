"""Fix ``ordered-drain``: a drain that is right in every era.

``GradReducePipeline._enforce_double_buffer_limit`` runs before a gradient bucket is taken from the
fixed pool. It must (1) retire queued reduce-scatters until at most pool-size units are live,
counting the incoming one (0.18 retires down to one, which makes a guarded getter reuse the slot of
the reduce-scatter it just issued), and (2) order the *writer*: the stream current at the call is
the one that will write the next wgrad into the recycled slot, so it must wait on the completion
event of each reduce-scatter it retires. 0.18 and 0.19 drain under ``torch.cuda.stream(rs_stream)``,
which makes only the reduce-scatter stream wait: the slot can be overwritten while its
reduce-scatter still reads it. Here the release's own ``wait_for_previous_grad_reduce`` runs on the
caller's stream, where each retired entry's ``event.wait()`` lands.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .. import guard
from ..fix_catalogue import ORDERED_DRAIN
from ..patching import Undo, wrap_attribute
from ..registry import RELEASE_POOL_SIZE


def entries_to_keep(pipeline: Any, add_buckets: list[int]) -> int | None:
    """How many queued reduce-scatters may stay in flight when ``add_buckets`` come in
    (None: no double buffer, nothing to enforce)."""
    buffer = pipeline.buffer
    if not buffer.ddp_config.fsdp_double_buffer:
        return None
    pool_size = pool_size_of(buffer)
    groups = buffer.parameter_groups
    live_units = {groups[b].fsdp_unit_id for b in add_buckets
                  if groups[b].fsdp_unit_id in buffer.double_buf_units}
    assert len(live_units) <= pool_size, (
        f"Double buffer limit exceeded: units {sorted(live_units)} need more than the pool's "
        f"{pool_size} slots at once.")
    keep_n = len(pipeline.grad_reduce_queue)
    for _, _, bucket_id in reversed(pipeline.grad_reduce_queue):
        live_units.add(groups[bucket_id].fsdp_unit_id)
        if len(live_units) > pool_size:
            keep_n -= 1
    return keep_n


def pool_size_of(buffer: Any) -> int:
    """N, the slots of the gradient pool: the built allocator's own ``size`` (what exists, even
    if the config changed after the model was built); with no pool built (no FSDP unit module),
    the configured ``fsdp_buffer_count`` (NVIDIA PR #6316), 2 where the release has no such
    option. A built pool without an int ``size`` raises (reported as an incident)."""
    allocator = buffer.main_grad_alloc
    if allocator is None:
        return int(getattr(buffer.ddp_config, "fsdp_buffer_count", RELEASE_POOL_SIZE))
    size = allocator.size
    if not isinstance(size, int) or size < 1:
        raise TypeError(f"{type(allocator).__name__}.size is {size!r}, not a slot count")
    return size


def apply(buffer_module: ModuleType) -> Undo:
    """Replace ``GradReducePipeline._enforce_double_buffer_limit`` in this copy."""

    def replacement(wrapped: Any, instance: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        # AssertionError passes: the pool-limit check, kept as every release has it.
        keep_n = guard.attempt(ORDERED_DRAIN, "_enforce_double_buffer_limit",
                               lambda: entries_to_keep(instance, *args, **kwargs),
                               passes=(AssertionError,))
        if keep_n is guard.SKIPPED:
            return wrapped(*args, **kwargs)
        if keep_n is not None:
            # Deliberately on the caller's current stream: see the module docstring.
            instance.wait_for_previous_grad_reduce(keep_n)
        return None

    return wrap_attribute(buffer_module.GradReducePipeline, "_enforce_double_buffer_limit",
                          replacement, ORDERED_DRAIN.id)
