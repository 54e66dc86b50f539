"""Code shapes recognised by structure rather than by text.

A fingerprint names one exact text; a fork or a backport that makes the same change in its own
words (ROCm/Megatron-LM PR #146 ports NVIDIA #5222's getter guard through
``self.grad_reduce_pipeline`` instead of ``p._megatron_fsdp_model.grad_reduce_pipeline``) has a
new text but the property the fixes care about. Each test here reads one function's source and
answers one yes/no question about its syntax tree; the registry names the test per shape
(:data:`RECOGNISERS`). One module per family of functions read, on the syntax-tree matchers of
:mod:`.syntax` (and, for the hooks and the overwrite setter, the decisions :mod:`.decisions`
evaluates).
"""

from __future__ import annotations

from collections.abc import Callable

from . import core_linear, double_buffer, hooks, overwrite_setter, synchronous_reductions

# Each test a registry shape names (``Shape.structure``), by that name.
RECOGNISERS: dict[str, Callable[[str], bool]] = {test.__name__: test for test in (
    double_buffer.drains_before_fetching,
    double_buffer.drains_to_configured_pool_size,
    double_buffer.drains_to_configured_pool_size_on_callers_stream,
    hooks.lazy_and_reduces_unsharded_once,
    hooks.lazy_and_reduces_unsharded_always,
    overwrite_setter.always_overwrites_main_grad,
    overwrite_setter.decides_overwrite_main_grad,
    synchronous_reductions.reduces_every_buffer,
    synchronous_reductions.skips_every_buffer,
    core_linear.fsdp_wgrad_overwrites,
    core_linear.fsdp_wgrad_follows_overwrite_main_grad,
)}
