# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Regression test: a recycled double-buffer gradient bucket is written only after the
reduce-scatter that last read it has finished.

With ``fsdp_double_buffer``, the gradient buckets of FSDP units share a pool of fixed slots.
Before a unit takes a slot, ``GradReducePipeline._enforce_double_buffer_limit`` retires the
oldest queued reduce-scatters: it waits on each one's completion event, then frees its slot.
The next writer of that slot runs on the caller's stream (the wgrad GEMM or ``_grad_acc``'s
copy, both reaching the drain through ``get_main_grad``), so the caller's stream is the one that
must wait. Waiting under ``rs_stream`` orders only the next reduce-scatter: a reduce-scatter that
is slower than one unit's backward still reads the slot while the next unit's gradients are
written into it, and the reduced gradients are silently wrong.

The race needs a slow reduce-scatter. Its cause is checked here deterministically, without
timing: the stream each retired reduce-scatter's event is waited on.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
    GradReducePipeline,
)


class RecordingEvent:
    """A reduce-scatter's completion event that records the streams waiting on it."""

    def __init__(self, log):
        self.log = log
        self.waited_on = []

    def wait(self, stream=None):
        self.waited_on.append(stream if stream is not None else torch.cuda.current_stream())
        self.log.append(("wait", self))


def make_pipeline(num_units, rs_stream):
    """A pipeline over one gradient bucket per FSDP unit, every unit double-buffered."""
    buffer = SimpleNamespace(
        ddp_config=SimpleNamespace(fsdp_double_buffer=True, fsdp_buffer_count=2),
        parameter_groups=[
            SimpleNamespace(fsdp_unit_id=unit, main_grad_buffer=None) for unit in range(num_units)
        ],
        double_buf_units=set(range(num_units)),
        num_buckets=num_units,
        dist_index=SimpleNamespace(use_hybrid_fsdp=False),
    )
    return GradReducePipeline(buffer, rs_stream=rs_stream)


def queue_reduce_scatter(pipeline, bucket_id, log):
    """Queue bucket ``bucket_id``'s reduce-scatter as ``_bucket_group_gradient_reduce`` does."""
    event = RecordingEvent(log)
    pipeline.grad_reduce_queue.append((event, lambda: log.append(("free", event)), bucket_id))
    return event


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA streams")
def test_recycled_bucket_writer_waits_on_its_reduce_scatter():
    rs_stream = torch.cuda.Stream()
    writer = torch.cuda.Stream()
    pipeline = make_pipeline(num_units=3, rs_stream=rs_stream)
    log = []
    # Backward runs the units in reverse: units 2 and 1 hold the pool's 2 slots, and their
    # reduce-scatters are in flight.
    unit2, unit1 = (queue_reduce_scatter(pipeline, unit, log) for unit in (2, 1))

    # Unit 0's gradients are about to be written (get_main_grad -> drain -> fetch_bucket).
    with torch.cuda.stream(writer):
        pipeline._enforce_double_buffer_limit([0])

    # Unit 2's slot is recycled for unit 0: the writer waited on its reduce-scatter, and the
    # slot was freed only after that wait. Unit 1's reduce-scatter stays in flight.
    assert unit2.waited_on == [writer]
    assert log == [("wait", unit2), ("free", unit2)]
    assert unit1.waited_on == []
    assert [bucket_id for _, _, bucket_id in pipeline.grad_reduce_queue] == [1]
