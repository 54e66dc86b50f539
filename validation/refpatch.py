"""Validation-only prototype of the gradient fix, used as a control next to ``mfsdp_hotfix``.

Not the product: ``mfsdp_hotfix`` is what is validated. This is the smallest patch that states the
rule from docs (getter guard + drain on the caller's stream with threshold ``> 2``), applied to
already-imported module objects, so the matrix has a second, independent implementation of the
same rule to compare against (and something to run while the package is not importable).
"""

from __future__ import annotations

import functools


def _enforce_ordered(self, add_buckets):
    """0.19 body (threshold ``> 2``), but the drain runs on the caller's current stream, so each
    retired reduce-scatter's ``event.wait()`` orders the stream that will write the recycled slot."""
    if not self.buffer.ddp_config.fsdp_double_buffer:
        return
    groups = self.buffer.parameter_groups
    units = {groups[b].fsdp_unit_id for b in add_buckets
             if groups[b].fsdp_unit_id in self.buffer.double_buf_units}
    assert len(units) <= 2, f"Double buffer limit exceeded: {units}"
    keep_n = len(self.grad_reduce_queue)
    for _, _, b in reversed(self.grad_reduce_queue):
        units.add(groups[b].fsdp_unit_id)
        if len(units) > 2:
            keep_n -= 1
    self.wait_for_previous_grad_reduce(keep_n)  # no rs_stream context: caller's stream waits


def apply(pkg_name: str) -> dict:
    import importlib

    pgb = importlib.import_module(pkg_name + ".param_and_grad_buffer")
    mf = importlib.import_module(pkg_name + ".megatron_fsdp")
    pgb.GradReducePipeline._enforce_double_buffer_limit = _enforce_ordered
    orig_init = mf.MegatronFSDP._init_fsdp_param_and_grad_buffer
    info = {"guarded_params": 0, "already_guarded": 0}

    @functools.wraps(orig_init)
    def _init(self, *a, **k):
        out = orig_init(self, *a, **k)
        pipeline = self.grad_reduce_pipeline
        for group in self.param_and_grad_buffer.parameter_groups:
            for p in group.params:
                g = getattr(p, "get_main_grad", None)
                if g is None:
                    continue
                f = g.__func__
                if "_enforce_double_buffer_limit" in f.__code__.co_names:
                    info["already_guarded"] += 1
                    continue

                def guarded(param, _f=f, _pl=pipeline):
                    if param._gbuf.is_data_distributed:
                        _pl._enforce_double_buffer_limit([param._gbuf.bucket_id])
                    return _f(param)

                p.get_main_grad = guarded.__get__(p)
                info["guarded_params"] += 1
        return out

    mf.MegatronFSDP._init_fsdp_param_and_grad_buffer = _init
    return info
