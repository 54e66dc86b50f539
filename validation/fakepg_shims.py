"""Shims around ``torch.distributed`` for the one-GPU fake-process-group harness.

Two independent pieces, each installed before Megatron-FSDP is imported (it binds
``_coalescing_manager`` by name at import time):

* ``install_rs_delay(cycles)``: fault injection. ``torch.cuda._sleep(cycles)`` is enqueued on the
  current stream right before every ``torch.distributed.reduce_scatter_tensor`` call (inside
  Megatron-FSDP that is the reduce-scatter stream). Stands in for a slow network or a straggler.

* ``install_nccl_semantics()``: makes the fake group's work handles behave like NCCL's.
  ``FakeWork::wait()`` in torch's FakeProcessGroup returns at once and orders nothing, and the
  fake group never ``record_stream``s the tensors it touches. ProcessGroupNCCL does both: an async
  work's ``wait()`` makes the *current* stream wait on the collective's end event, and input/output
  tensors are recorded on the collective's stream so the caching allocator cannot hand their
  memory out before the collective is done. The fake collectives run on the stream that is current
  when they are issued, so the shim records a CUDA event there and returns a work whose ``wait()``
  is ``current_stream().wait_event(event)``, and it ``record_stream``s every tensor onto that
  stream. Used to decide whether a race seen with the plain fake group is a harness artefact.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

STATS = {"rs_calls": 0, "rs_sleeps": 0, "event_works": 0, "recorded_tensors": 0}


def install_rs_delay(cycles: int) -> None:
    orig = dist.reduce_scatter_tensor

    def reduce_scatter_tensor(*args, **kwargs):
        STATS["rs_calls"] += 1
        if cycles > 0:
            torch.cuda._sleep(int(cycles))
            STATS["rs_sleeps"] += 1
        return orig(*args, **kwargs)

    reduce_scatter_tensor.__wrapped__ = orig
    dist.reduce_scatter_tensor = reduce_scatter_tensor


class EventWork:
    """A work handle with NCCL's wait semantics: the caller's current stream waits on the event
    recorded right after the (fake) collective was enqueued."""

    def __init__(self, inner, event: torch.cuda.Event):
        self._inner = inner
        self._event = event
        STATS["event_works"] += 1

    def wait(self, timeout=None):  # noqa: ARG002 - same signature as Work.wait
        torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self):
        return self._event.query()

    def get_future(self):
        return self._inner.get_future()

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _record(tensors, stream):
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)
            STATS["recorded_tensors"] += 1


def install_nccl_semantics() -> None:
    orig_cm = c10d._coalescing_manager

    @contextlib.contextmanager
    def _coalescing_manager(group=None, device=None, async_ops=False):
        key = group or c10d._get_default_group()
        with orig_cm(group, device, async_ops) as cm:
            yield cm
            ops = list(c10d._world.pg_coalesce_state.get(key, []))
        # The coalesced fake collective has now been enqueued on the current stream.
        stream = torch.cuda.current_stream()
        event = stream.record_event()
        _record([t for op in ops for t in (op.tensor, op.dst_tensor)], stream)
        if async_ops:
            cm.works = [EventWork(w, event) for w in cm.works]

    dist._coalescing_manager = _coalescing_manager

    def wrap(name, tensor_args):
        orig = getattr(dist, name)

        def collective(*args, **kwargs):
            key = kwargs.get("group")
            in_coalescing = (key or c10d._get_default_group()) in c10d._world.pg_coalesce_state
            work = orig(*args, **kwargs)
            if in_coalescing:
                return work  # launched (and handled) at the coalescing manager's exit
            stream = torch.cuda.current_stream()
            _record([kwargs.get(n) for n in tensor_args] + list(args[:2]), stream)
            if kwargs.get("async_op") and work is not None:
                return EventWork(work, stream.record_event())
            return work

        collective.__wrapped__ = orig
        setattr(dist, name, collective)

    wrap("all_gather_into_tensor", ("output_tensor", "input_tensor"))
    wrap("reduce_scatter_tensor", ("output", "input"))
    wrap("all_reduce", ("tensor",))
