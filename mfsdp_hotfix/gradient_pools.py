"""The gradient pools the audit watches: the pool allocator classes a release may build its
double-buffer pools from, which of those pools hold gradients, and where a built buffer keeps
them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolAllocator:
    """One double-buffer pool allocator class a release may build its pools from, and the two
    methods through which a bucket takes and gives back a slot (what the audit watches)."""

    cls: str
    allocate: str
    free: str
    since: str  # the first releases that have it


# Every pool allocator a known release has. The audit watches each one present in a copy; a
# gradient pool built from any other class is reported as unwatched, never as ordered.
POOL_ALLOCATORS = (
    PoolAllocator("FixedPoolAllocator", "allocate", "free",
                  "megatron-core 0.14.0 / megatron-fsdp 0.1.0 (fsdp_double_buffer=True)"),
    PoolAllocator("MaxPoolAllocator", "allocate", "free",
                  "megatron-core 0.19.0 / megatron-fsdp 0.6.0 (fsdp_double_buffer=True with "
                  "megatron_fsdp_max_pool_double_buffer / maxpool_double_buffer=True)"),
)
# The pools (by their ``name``) that hold gradients: the main gradient buckets and HSDP's
# gradient-communication buckets. The parameter pools (fsdp_params, fsdp_fp8_transpose_params)
# are all-gather targets, not reduce-scatter sources, and are not judged by the rule.
GRAD_POOLS = frozenset({"fsdp_grads", "hsdp_grad_comm"})
# Where a built ParamAndGradBuffer keeps its gradient pools (None: not built, e.g. no double
# buffer, or no HSDP).
GRAD_POOL_ATTRIBUTES = ("main_grad_alloc", "hsdp_grad_comm_alloc")
