"""Shims around ``torch.distributed`` for GPU runs: the slow-reduce-scatter fault, and NCCL work
semantics for torch's one-process fake group.

Each is installed before Megatron-FSDP is imported (it binds ``_coalescing_manager`` by name at
import time). Used by the GPU selftest worker and by ``validation/`` (through
``validation/fakepg_shims.py``, which loads this file without importing ``mfsdp_hotfix``, so
that its "as shipped" cases stay unpatched). This module imports nothing of this package.

* ``install_rs_delay(cycles)`` (``set_rs_delay(cycles)`` changes it later): fault injection.
  ``torch.cuda._sleep(cycles)`` is enqueued on the current stream right before every
  ``torch.distributed.reduce_scatter_tensor`` call (inside Megatron-FSDP that is the
  reduce-scatter stream). Stands in for a slow network or a straggler:
  the reduce-scatter, and whatever waits for it, finish later than the next unit's backward.
  ``measure_cycles_per_ms()`` calibrates the cycles with CUDA events.

* ``install_nccl_semantics()``: makes the fake group's work handles behave like NCCL's.
  ``FakeWork::wait()`` in torch's FakeProcessGroup returns at once and orders nothing, and the
  fake group never ``record_stream``s the tensors it touches. ProcessGroupNCCL does both: an async
  work's ``wait()`` makes the *current* stream wait on the collective's end event, and input/output
  tensors are recorded on the collective's stream so the caching allocator cannot hand their
  memory out before the collective is done. The fake collectives run on the stream that is current
  when they are issued, so the shim records a CUDA event there and returns a work whose ``wait()``
  is ``current_stream().wait_event(event)``, and it ``record_stream``s every tensor onto that
  stream. Without it, a one-GPU run shows races that real NCCL cannot have.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_cuda: Any = torch.cuda  # some of its functions are untyped in torch's stubs
STATS = {"rs_calls": 0, "rs_sleeps": 0, "event_works": 0, "recorded_tensors": 0}
_DELAY = {"cycles": 0}  # of the reduce-scatter delay; set_rs_delay changes it

# Calibration: cycles of the largest sleep, repeated; the median of its rate is used.
CALIBRATION_CYCLES = (1_000_000, 10_000_000, 50_000_000)
CALIBRATION_REPEATS = 3


def cycles_per_ms(samples: Iterable[tuple[int, float]]) -> float:
    """``torch.cuda._sleep`` cycles per millisecond from ``(cycles, elapsed ms)`` samples: the
    median rate of the longest sleeps (short ones are dominated by launch overhead)."""
    timed = [(cycles, ms) for cycles, ms in samples if ms > 0 and cycles > 0]
    if not timed:
        raise ValueError("no usable calibration sample (every elapsed time was 0)")
    longest = max(cycles for cycles, _ in timed)
    return float(statistics.median(cycles / ms for cycles, ms in timed if cycles == longest))


def delay_cycles(delay_ms: float, rate: float) -> int:
    """Cycles that make ``torch.cuda._sleep`` last ``delay_ms`` at ``rate`` cycles/ms."""
    if delay_ms < 0 or rate <= 0:
        raise ValueError(f"delay {delay_ms} ms at {rate} cycles/ms")
    return int(round(delay_ms * rate))


def measure_cycles_per_ms() -> tuple[float, list[tuple[int, float]]]:
    """Time ``torch.cuda._sleep`` on the current device with CUDA events; (rate, samples)."""
    samples = []
    for cycles in CALIBRATION_CYCLES:
        for _ in range(CALIBRATION_REPEATS):
            start = _cuda.Event(enable_timing=True)
            end = _cuda.Event(enable_timing=True)
            start.record()
            _cuda._sleep(cycles)
            end.record()
            end.synchronize()
            samples.append((cycles, float(start.elapsed_time(end))))
    return cycles_per_ms(samples), samples


def install_rs_delay(cycles: int) -> None:
    """Sleep ``cycles`` before every reduce-scatter (0: none, until :func:`set_rs_delay`)."""
    set_rs_delay(cycles)
    orig = dist.reduce_scatter_tensor

    def reduce_scatter_tensor(*args: Any, **kwargs: Any) -> Any:
        STATS["rs_calls"] += 1
        if _DELAY["cycles"] > 0:
            _cuda._sleep(_DELAY["cycles"])
            STATS["rs_sleeps"] += 1
        return orig(*args, **kwargs)

    reduce_scatter_tensor.__wrapped__ = orig  # type: ignore[attr-defined]
    dist.reduce_scatter_tensor = reduce_scatter_tensor


def set_rs_delay(cycles: int) -> None:
    """The cycles of the installed delay from now on: the shim is installed before the release is
    imported (which binds it), the delay is calibrated later, in the run's turn on the GPU."""
    _DELAY["cycles"] = int(cycles)


class EventWork:
    """A work handle with NCCL's wait semantics: the caller's current stream waits on the event
    recorded right after the (fake) collective was enqueued."""

    def __init__(self, inner: Any, event: torch.cuda.Event) -> None:
        self._inner = inner
        self._event: Any = event
        STATS["event_works"] += 1

    def wait(self, timeout: Any = None) -> bool:  # noqa: ARG002 - same signature as Work.wait
        torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return bool(self._event.query())

    def get_future(self) -> Any:
        return self._inner.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _record(tensors: Iterable[Any], stream: torch.cuda.Stream) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)
            STATS["recorded_tensors"] += 1


def install_nccl_semantics() -> None:
    world: Any = c10d._world
    orig_cm = c10d._coalescing_manager

    @contextlib.contextmanager
    def _coalescing_manager(group: Any = None, device: Any = None,
                            async_ops: bool = False) -> Iterator[Any]:
        key = group or c10d._get_default_group()
        with orig_cm(group, device, async_ops) as cm:
            yield cm
            ops = list(world.pg_coalesce_state.get(key, []))
        # The coalesced fake collective has now been enqueued on the current stream.
        stream = torch.cuda.current_stream()
        event = stream.record_event()
        _record([t for op in ops for t in (op.tensor, op.dst_tensor)], stream)
        if async_ops:
            cm.works = [EventWork(w, event) for w in cm.works]

    setattr(dist, "_coalescing_manager", _coalescing_manager)  # noqa: B010 - not in the stubs

    def wrap(name: str, tensor_args: tuple[str, ...]) -> None:
        orig = getattr(dist, name)

        def collective(*args: Any, **kwargs: Any) -> Any:
            key = kwargs.get("group")
            in_coalescing = (key or c10d._get_default_group()) in world.pg_coalesce_state
            work = orig(*args, **kwargs)
            if in_coalescing:
                return work  # launched (and handled) at the coalescing manager's exit
            stream = torch.cuda.current_stream()
            _record([kwargs.get(n) for n in tensor_args] + list(args[:2]), stream)
            if kwargs.get("async_op") and work is not None:
                return EventWork(work, stream.record_event())
            return work

        collective.__wrapped__ = orig  # type: ignore[attr-defined]
        setattr(dist, name, collective)

    wrap("all_gather_into_tensor", ("output_tensor", "input_tensor"))
    wrap("reduce_scatter_tensor", ("output", "input"))
    wrap("all_reduce", ("tensor",))
